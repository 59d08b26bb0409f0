"""The Python API's refusals of wrong input: one ChatcoreError line, never a raw error from deep
inside, and nothing added to a conversation or fired to a plugin before the refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

import chatcore
from chatcore.anatomy import UnsupportedModelError
from chatcore.api import anatomy_of
from chatcore.engine import Engine, ReplyOptions
from chatcore.errors import ChatcoreError, ModelLoadError, OptionError, UnknownNameError
from chatcore.log import LogError, open_store
from chatcore.models import load_model


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    """The refusal's message, checked to be one line."""
    message = str(error.value)
    assert message and "\n" not in message, message
    return message


class UserMessages:
    """Counts ``on_user_message``: a refused call must not have fired it."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    @chatcore.hookimpl
    def on_user_message(self, turn) -> None:
        self.texts.append(turn.text)


@pytest.fixture
def user_messages(engine) -> UserMessages:
    recorder = UserMessages()
    assert engine.host.register(recorder, "user-messages-test")
    engine.host.check_pending()
    return recorder


# -- scripted turns ---------------------------------------------------------------------------


@pytest.mark.parametrize("turns", ["hello", b"hello", bytearray(b"hello"), None, 5])
def test_scripted_and_reply_to_refuse_what_is_not_a_list_of_turns(engine, user_messages, turns):
    for call in (lambda: engine.scripted(turns), lambda: engine.reply_to(turns)):
        with pytest.raises(ChatcoreError) as refused:
            call()
        message = one_line(refused)
        assert "list of turns" in message and "['hello']" in message
    assert user_messages.texts == []


def test_scripted_reads_a_list_or_tuple_of_turns(engine):
    for turns in (["hello"], ("hello",)):
        conversation = engine.scripted(turns)
        assert [(turn.role, turn.text) for turn in conversation.turns] == [("user", "hello")]
    conversation = engine.scripted(["hi", "hello there", "how are you?"])
    assert [turn.role for turn in conversation.turns] == ["user", "bot", "user"]


# -- conversations ------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [None, "abc", ["hello"], {"turns": []}])
def test_send_and_respond_refuse_what_is_not_a_conversation(engine, user_messages, given):
    for call in (
        lambda: engine.send(given, "hello"),
        lambda: engine.respond(given),
        lambda: engine.add_user(given, "hello"),
    ):
        with pytest.raises(ChatcoreError) as refused:
            call()
        assert "must be a Conversation" in one_line(refused)
    assert user_messages.texts == []


# -- options ----------------------------------------------------------------------------------


def test_options_as_a_dict_are_read_as_reply_options_everywhere(engine):
    expected = engine.reply_to(["hello"], ReplyOptions(seed=1, max_new_tokens=8))
    expected_text = expected.text()
    assert expected.provenance["seed"] == 1

    conversation = engine.conversation()
    sent = engine.send(conversation, "hello", options={"seed": 1, "max_new_tokens": 8})
    assert sent.text() == expected_text and sent.provenance["seed"] == 1
    assert [turn.role for turn in conversation.turns] == ["user", "bot"]

    replied = engine.reply_to(["hello"], options={"seed": 1, "max_new_tokens": 8})
    assert replied.text() == expected_text

    responded = engine.respond(engine.scripted(["hello"]), {"seed": 1, "max_new_tokens": 8})
    assert responded.text() == expected_text

    # Keywords win over the dict, as they win over a ReplyOptions.
    assert engine.options_for({"seed": 1}, seed=2).seed == 2
    assert engine.options_for(ReplyOptions(seed=1), seed=2).seed == 2
    # The dict's spec strings are read as the keywords' are.
    assert engine.options_for({"decoder": "top-k top_k=5"}) == engine.options_for(decoder="top-k top_k=5")
    # ... and so is a ReplyOptions' own.
    assert ReplyOptions(decoder="top-k top_k=5") == engine.options_for(decoder="top-k top_k=5")
    with pytest.raises(OptionError, match="given in the decoder's spec and in decoder_settings"):
        ReplyOptions(decoder="top-k top_k=5", decoder_settings={"top_k": 3})


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (5, "must be a ReplyOptions or a dict of its fields"),
        ("top-k", "must be a ReplyOptions or a dict of its fields"),
        (["seed", 1], "must be a ReplyOptions or a dict of its fields"),
        ({"sed": 1}, "unknown reply option 'sed'"),
        ({"seed": -1}, "`seed`"),
        ({"decoder": "nope"}, "unknown decoder 'nope'"),
    ],
)
def test_bad_options_are_refused_in_one_line_and_lose_nothing(engine, user_messages, options, needle):
    conversation = engine.conversation()
    for call in (
        lambda: engine.send(conversation, "hello", options=options),
        lambda: engine.reply_to(["hello"], options=options),
        lambda: engine.respond(engine.conversation(), options),
        lambda: engine.check_options(options),
    ):
        with pytest.raises((OptionError, UnknownNameError)) as refused:
            call()
        assert needle in one_line(refused)
    assert conversation.turns == []
    assert user_messages.texts == []


# -- models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [5, None, 1.5, ["chatcore-tiny"]])
def test_engine_refuses_a_model_not_named_by_a_string_or_path(host, model):
    for call in (lambda: Engine(model, host=host), lambda: load_model(model)):
        with pytest.raises(ModelLoadError) as refused:
            call()
        assert "a model is named by a string" in one_line(refused)


def test_engine_takes_a_model_folder_as_a_path(host, tiny_model_dir):
    engine = Engine(Path(tiny_model_dir), host=host)
    assert engine.loaded.name == str(tiny_model_dir)
    assert engine.reply_to(["hello"], seed=1, max_new_tokens=4).text() is not None


def test_engine_refuses_a_device_that_is_no_name(host, loaded):
    with pytest.raises(ModelLoadError) as refused:
        load_model("chatcore-tiny", device=5)
    assert "unknown device 5" in one_line(refused)


@pytest.mark.parametrize("model", ["not a model", None, 5, object()])
def test_anatomy_of_refuses_what_is_not_a_model(model):
    with pytest.raises(UnsupportedModelError) as refused:
        anatomy_of(model)
    assert "anatomy_of takes a Hugging Face causal LM" in one_line(refused)


def test_anatomy_of_says_to_pass_a_loaded_models_model(loaded):
    with pytest.raises(UnsupportedModelError) as refused:
        anatomy_of(loaded)
    assert "LoadedModel" in one_line(refused) and "pass its .model" in one_line(refused)
    assert anatomy_of(loaded.model).model is loaded.model


def test_anatomy_of_refuses_a_torch_module_that_is_no_hugging_face_model():
    import torch

    with pytest.raises(UnsupportedModelError) as refused:
        anatomy_of(torch.nn.Linear(2, 2))
    assert "Linear is not a Hugging Face model" in one_line(refused)


# -- prompt formats ---------------------------------------------------------------------------


def test_an_unknown_prompt_format_lists_the_same_names_wherever_it_is_given(engine, loaded, host):
    with pytest.raises(UnknownNameError) as from_conversation:
        engine.conversation(prompt_format="nope")
    with pytest.raises(UnknownNameError) as from_engine:
        Engine(loaded, host=host, prompt_format="nope")
    assert one_line(from_conversation) == one_line(from_engine)
    assert "(available: auto, " in one_line(from_conversation)
    # Both take what they list.
    assert engine.conversation(prompt_format="auto").prompt_format == engine.prompt_format.name
    assert Engine(loaded, host=host, prompt_format="auto").prompt_format.name == engine.prompt_format.name


@pytest.mark.parametrize("name", [5, ["dialogpt"]])
def test_a_prompt_format_not_named_by_a_string_is_refused(engine, loaded, host, name):
    for call in (
        lambda: engine.conversation(prompt_format=name),
        lambda: Engine(loaded, host=host, prompt_format=name),
    ):
        with pytest.raises(UnknownNameError) as refused:
            call()
        assert "a prompt format is named by a string (available: auto, " in one_line(refused)


# -- the conversation log ---------------------------------------------------------------------


@pytest.mark.parametrize("url", [5, 1.5, ["log.sqlite3"]])
def test_open_store_refuses_what_is_not_a_url_or_path(url):
    with pytest.raises(LogError) as refused:
        open_store(url)
    assert "is named by a URL or a file's path" in one_line(refused)


def test_open_store_takes_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the journal's folder is in it
    with open_store(tmp_path / "log.sqlite3") as store:
        assert store.file_path == (tmp_path / "log.sqlite3").resolve()


@pytest.fixture
def memory_store():
    with open_store(":memory:") as store:
        yield store


@pytest.mark.parametrize("text", [5, None, b"hello"])
def test_search_refuses_text_that_is_no_string(memory_store, text):
    with pytest.raises(LogError) as refused:
        memory_store.search(text)
    assert "the search text must be a string" in one_line(refused)


@pytest.mark.parametrize("conversation_id", [None, 5, b"abc"])
def test_a_conversation_id_that_is_no_string_is_refused(memory_store, conversation_id):
    for call in (
        lambda: memory_store.resume(conversation_id),
        lambda: memory_store.get_conversation(conversation_id),
        lambda: memory_store.load_turns(conversation_id),
        lambda: memory_store.delete_conversation(conversation_id),
    ):
        with pytest.raises(LogError) as refused:
            call()
        assert "a conversation id is a string" in one_line(refused)
