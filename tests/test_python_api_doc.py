"""docs/python-api.md cannot drift from the code.

- Every ```python block runs, in order, in one namespace (the blocks build on each other),
  on the bundled chatcore-tiny, in a temporary folder (the log example's SQLite file, the
  persona's user data folder).
- Every `Class.name` the page names in backticks exists on an instance of that class
  (instance attributes such as `Response.done` included); a `Class.method(a, b=1)` or
  `Class(a, b=1)` written as a parameter list is the method's whole signature (names,
  kinds, defaults); one written as a call (`Engine("chatcore-tiny")`, `Response.text()`)
  binds to it.
- The reply options table is `ReplyOptions`: every field, in order, with its default.
- Every error the page names is a ChatcoreError; every link resolves.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import io
import re
from pathlib import Path
from typing import Any

import pytest

from chatcore.errors import ChatcoreError

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "python-api.md"
BACKTICKED = re.compile(r"`([^`\n]+)`")
NAME_REFERENCE = re.compile(
    r"(Engine|Response|Conversation|ReplyOptions|Scheduler|Handle|ConversationStore|Turn)(?:\.(\w+))?(\(.*\))?"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
TINY_NAMES = ("chatcore-tiny",)  # what the examples may load: the test suite never loads SmolLM2 by default


def page_text() -> str:
    return PAGE.read_text(encoding="utf-8")


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page_text(), flags=re.MULTILINE | re.DOTALL)


def section(heading: str) -> str:
    """The text of the page's ``## heading`` section, up to the next one."""
    text = page_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def backticked() -> list[str]:
    return BACKTICKED.findall(page_text())


# -- the examples -----------------------------------------------------------------------------


def engine_arguments(code: str) -> list[list[Any]]:
    """The arguments of every ``Engine(...)`` call in ``code``, as literals."""
    calls = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Engine":
            calls.append([ast.literal_eval(argument) for argument in node.args] + [k.arg for k in node.keywords])
    return calls


def test_the_examples_load_only_the_bundled_tiny_model() -> None:
    calls = [call for code in python_blocks() for call in engine_arguments(code)]
    assert calls, "no example makes an Engine"
    assert all(call == [] or call == ["chatcore-tiny"] for call in calls), calls
    assert "smollm2" not in "".join(python_blocks())


def test_every_python_example_runs_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chatcore.engine import Engine

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # personas and the log's journal
    monkeypatch.delenv("CHATCORE_DB", raising=False)
    blocks = python_blocks()
    assert len(blocks) >= 8
    namespace: dict[str, Any] = {"__name__": "python_api_doc"}
    for number, code in enumerate(blocks, start=1):
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(code, f"{PAGE}, python block {number}", "exec"), namespace)
        if "print(" in code:
            assert output.getvalue().strip(), f"python block {number} printed nothing"
    engine = namespace["engine"]
    assert isinstance(engine, Engine) and engine.loaded.name in TINY_NAMES
    assert (tmp_path / "chats.sqlite3").is_file()  # the log example wrote its file where the page says


# -- names and signatures ---------------------------------------------------------------------


def parameters_of(function: Any) -> list[tuple[str, str, Any]]:
    """(kind, name, default) of each parameter but ``self``; ``inspect.Parameter.empty`` for no default."""
    return [
        (parameter.kind.name, parameter.name, parameter.default)
        for parameter in inspect.signature(function).parameters.values()
        if parameter.name != "self"
    ]


def parameters_shown(text: str) -> list[tuple[str, str, Any]] | None:
    """The parameter list ``(a, b=1, *args, c=2, **kw)`` as :func:`parameters_of` gives it, or
    None if ``text`` is no parameter list (a call such as ``("chatcore-tiny")``)."""
    try:
        definition = ast.parse(f"def shown{text}: pass").body[0]
    except SyntaxError:
        return None
    assert isinstance(definition, ast.FunctionDef), text
    arguments = definition.args
    empty = inspect.Parameter.empty
    positional = arguments.args
    defaults = [empty] * (len(positional) - len(arguments.defaults)) + [ast.literal_eval(d) for d in arguments.defaults]
    shown = [("POSITIONAL_OR_KEYWORD", a.arg, d) for a, d in zip(positional, defaults)]
    if arguments.vararg is not None:
        shown.append(("VAR_POSITIONAL", arguments.vararg.arg, empty))
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        shown.append(("KEYWORD_ONLY", argument.arg, empty if default is None else ast.literal_eval(default)))
    if arguments.kwarg is not None:
        shown.append(("VAR_KEYWORD", arguments.kwarg.arg, empty))
    return shown


def check_call(function: Any, text: str) -> None:
    """``function`` accepts the call ``text`` (``("chatcore-tiny")``, ``()``) by its arity and keywords."""
    call = ast.parse(f"call{text}", mode="eval").body
    assert isinstance(call, ast.Call), text
    signature = inspect.signature(function)
    signature = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "self"])
    signature.bind(*[None] * len(call.args), **{k.arg: None for k in call.keywords if k.arg})


@pytest.fixture
def instances(bundled_model, host):
    """An instance of each class the page names, for attributes set in ``__init__``."""
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.log.store import ConversationStore
    from chatcore.serving import Handle, Scheduler
    from chatcore.values import Turn

    engine = Engine(bundled_model, host=host)
    response = engine.reply_to(["hi"], seed=1, max_new_tokens=2)
    response.text()
    scheduler = Scheduler(engine)  # its thread starts with a first request: none is made
    yield {
        "Engine": engine,
        "Response": response,
        "Conversation": Conversation(),
        "ReplyOptions": ReplyOptions(),
        "Scheduler": scheduler,
        "Handle": Handle(),
        "ConversationStore": ConversationStore,  # only its methods are named
        "Turn": Turn("user", "hi"),
    }
    scheduler.close()


def test_every_name_the_page_gives_exists_with_the_signature_shown(instances) -> None:
    checked = []
    for span in backticked():
        match = NAME_REFERENCE.fullmatch(span)
        if match is None:
            continue
        class_name, attribute, parentheses = match.groups()
        instance = instances[class_name]
        cls = instance if isinstance(instance, type) else type(instance)
        if attribute is None and parentheses is None:
            continue
        if attribute is not None:
            assert hasattr(instance, attribute), f"`{span}`: {class_name} has no {attribute!r}"
        if parentheses is not None:
            function = getattr(cls, attribute) if attribute is not None else cls
            assert callable(function), f"`{span}`: {class_name}.{attribute} is not callable"
            shown = parameters_shown(parentheses) if parentheses != "()" else None
            if shown is None:
                check_call(function, parentheses)
            else:
                assert shown == parameters_of(function), f"`{span}` is not the signature {inspect.signature(function)}"
        checked.append(span)
    assert len(checked) >= 40, checked  # the tables name the methods: the check is not empty
    for name in ("Engine.send", "Engine.respond", "Response.text", "Response.interrupt", "Scheduler.submit"):
        assert any(span.startswith(name) for span in checked), f"the page does not name `{name}`"


def test_the_reply_options_table_is_reply_options() -> None:
    from chatcore.engine import ReplyOptions

    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section("Reply options"), flags=re.MULTILINE)
    shown = [(name, ast.literal_eval(default)) for name, default in rows]
    fields = [(name, field.default) for name, field in ReplyOptions.model_fields.items()]
    assert shown == fields


def test_every_error_the_page_names_is_a_chatcore_error() -> None:
    import chatcore.errors
    import chatcore.log
    import chatcore.serving

    modules = (chatcore.errors, chatcore.log, chatcore.serving)
    named = {span for span in backticked() if re.fullmatch(r"\w+(Error|Busy)", span) and not hasattr(builtins, span)}
    named |= set(re.findall(r"^\| `(\w+)`", section("Errors"), flags=re.MULTILINE))  # the table's first column
    assert {"ChatcoreError", "OptionError", "UnknownNameError", "ModelLoadError", "LogError", "ServerBusy"} <= named
    for name in named:
        found = [getattr(module, name) for module in modules if hasattr(module, name)]
        assert found and issubclass(found[0], ChatcoreError), f"`{name}` is no ChatcoreError of chatcore"


# -- links ------------------------------------------------------------------------------------


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_resolves_and_the_readme_links_the_page() -> None:
    links = [link for link in LINK.findall(page_text()) if "://" not in link]
    assert len(links) >= 10
    for link in links:
        target, _, anchor = link.partition("#")
        path = (PAGE.parent / target).resolve() if target else PAGE
        assert path.is_file(), f"({link}): no {path}"
        if anchor:
            assert anchor in anchors(path), f"({link}): no heading #{anchor} in {path.name}"
    assert "(docs/python-api.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
