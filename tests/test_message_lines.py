"""A message keeps its lines and indentation on the way to the model and into the log: through
the Python API and over HTTP (the official openai client), user and assistant turns alike."""

from __future__ import annotations

from serving_steerers import serving_engine  # noqa: F401 - a fixture
from test_http_ops import running

CODE = "def f():\n    return 1\n\nprint(f())"
FLAT = "def f(): return 1 print(f())"


def test_the_python_api_keeps_a_messages_lines(engine):
    conversation = engine.conversation()
    engine.add_user(conversation, "  " + CODE.replace("\n", "   \r\n") + "\n\n\n")
    assert conversation.turns[-1].text == CODE
    prompt = engine.prompt(conversation, 8)
    assert engine.tokenizer.decode(prompt.token_ids).count("\n") >= CODE.count("\n")


def test_http_keeps_the_lines_of_user_and_assistant_messages(serving_engine):  # noqa: F811
    with running(serving_engine) as (scheduler, server, client):
        model = client.models.list().data[0].id

        def prompt_tokens(*turns: str) -> int:
            roles = ["user", "assistant"]
            messages = [{"role": roles[index % 2], "content": text} for index, text in enumerate(turns)]
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
            return reply.usage.prompt_tokens

        kept, flat = prompt_tokens(CODE), prompt_tokens(FLAT)
        assert kept != flat  # the line breaks and the indentation are tokens of the prompt
        assert prompt_tokens("hi", CODE, "and?") != prompt_tokens("hi", FLAT, "and?")
        expected = serving_engine.prompt(serving_engine.scripted([CODE]), 1).token_ids
        assert kept == len(expected)
