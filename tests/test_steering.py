"""Steerers: bow-bias on the tiny model, multi-token words, composition order, prepare()."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import chatcore
from chatcore.decoding import GenerationSession
from chatcore.engine import Engine, ReplyOptions
from chatcore.plugins.bow_bias import BowBiasSteerer, builtin_topics, word_variants
from chatcore.steering import Steerer, compose
from chatcore.step import StepOutput, StepState
from chatcore.text import encode_text

WORDS = "pizza,food,movie,weather"


def session_for(loaded, prompt_ids, steerers=(), max_new_tokens=4):
    return GenerationSession(
        model=loaded,
        prompt_ids=list(prompt_ids),
        steerers=list(steerers),
        max_new_tokens=max_new_tokens,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )


def prepared_bow(loaded, prompt_ids, **settings):
    steerer = BowBiasSteerer.from_options(settings)
    steerer.prepare(session_for(loaded, prompt_ids, [steerer]))
    return steerer


def state_after(prompt_ids, generated):
    sequences = torch.tensor([list(prompt_ids) + list(generated)])
    return StepState(
        input_ids=sequences[:, -1:],
        sequences=sequences,
        attention_mask=torch.ones_like(sequences),
        position_ids=torch.tensor([[sequences.size(1) - 1]]),
        cache=None,
        step=len(generated),
        prompt_length=len(prompt_ids),
    )


# -- bow-bias ------------------------------------------------------------------------------------


def test_bow_bias_covers_every_variant_of_every_word(loaded, tokenizer):
    prompt = encode_text(tokenizer, "hi") + [tokenizer.eos_token_id]
    steerer = prepared_bow(loaded, prompt, words="Pizza")
    assert word_variants("Pizza") == {"Pizza", "pizza", " Pizza", " pizza"}
    expected = {tuple(encode_text(tokenizer, form)) for form in word_variants("Pizza")}
    assert set(steerer.sequences) == expected
    # A variant that starts with a bare whitespace token is continued, never started.
    starts = {ids[0] for ids in expected if len(ids) == 1 or tokenizer.decode([ids[0]]).strip()}
    # A form without a leading space starts a word only where none is under way, and only
    # when it is one token (the first token of a longer one is a fragment: never started).
    bare_forms = [encode_text(tokenizer, form) for form in word_variants("Pizza") if not form.startswith(" ")]
    bare = {ids[0] for ids in bare_forms}
    whole = {ids[0] for ids in bare_forms if len(ids) == 1}
    assert sorted(steerer.first_tokens.tolist()) == sorted(starts - bare)
    assert sorted(steerer.bare_first_tokens.tolist()) == sorted(starts & whole - (bare - whole))


def test_bow_bias_raises_the_share_of_word_tokens(engine, loaded, tokenizer):
    prompt = encode_text(tokenizer, "what should we talk about?") + [tokenizer.eos_token_id]
    targets = set(prepared_bow(loaded, prompt, words=WORDS).first_tokens.tolist())

    def share(steerers):
        hits = total = 0
        for seed in range(6):
            response = engine.send(
                engine.conversation(),
                "what should we talk about?",
                ReplyOptions(
                    decoder="top-k",
                    decoder_settings={"top_k": 400, "temperature": 1.0},
                    seed=seed,
                    steerers=steerers,
                    min_new_tokens=20,
                    max_new_tokens=20,
                ),
            )
            response.text()
            hits += sum(token in targets for token in response.token_ids)
            total += len(response.token_ids)
        return hits / total

    plain = share([])
    steered = share([("bow-bias", {"words": WORDS, "strength": 8})])
    negative = share([("bow-bias", {"words": WORDS, "strength": -8})])
    assert steered > 0.5
    assert steered > plain * 3
    assert negative < plain


def test_bow_bias_with_a_builtin_topic_steers_greedy_decoding(engine, loaded, tokenizer):
    assert "food" in builtin_topics()
    response = engine.send(
        engine.conversation(),
        "hi",
        ReplyOptions(
            decoder="greedy",
            steerers=[("bow-bias", {"topic": "food", "strength": 20})],
            min_new_tokens=10,
            max_new_tokens=10,
        ),
    )
    response.text()
    prompt = encode_text(tokenizer, "hi") + [tokenizer.eos_token_id]
    steerer = prepared_bow(loaded, prompt, topic="food")
    biased = set(steerer.first_tokens.tolist()) | set(steerer.bare_first_tokens.tolist())
    biased |= {ids[k] for ids in steerer.sequences for k in range(1, len(ids))}
    assert all(token in biased for token in response.token_ids)


def test_bow_bias_does_not_bias_a_bare_space_token(loaded, tokenizer):
    prompt = encode_text(tokenizer, "hi") + [tokenizer.eos_token_id]
    space = encode_text(tokenizer, " ")
    assert len(space) == 1 and encode_text(tokenizer, " Pizza")[0] == space[0]  # the precondition
    steerer = prepared_bow(loaded, prompt, words="pizza")
    assert space[0] not in steerer.first_tokens.tolist()


def test_bow_bias_reads_word_files(engine, tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("# a comment\n\npizza\n  pasta  \n", encoding="utf-8")
    steerer = engine.make_steerer("bow-bias", {"file": str(path), "words": "cake"})
    assert steerer.settings.all_words() == ["cake", "pizza", "pasta"]


def test_multi_token_words_are_completed_token_by_token(loaded, tokenizer):
    prompt = encode_text(tokenizer, "hello") + [tokenizer.eos_token_id]
    strength = 5.0
    steerer = prepared_bow(loaded, prompt, words="chocolate", strength=strength)
    firsts = set(steerer.first_tokens.tolist())
    word = encode_text(tokenizer, " chocolate")
    assert len(word) >= 3  # several tokens in a 400-token vocabulary
    zeros = torch.zeros((1, len(tokenizer)))

    # at the start only first tokens are biased, the forms without a leading space too
    bare = set(steerer.bare_first_tokens.tolist())
    bias = steerer.bias(state_after(prompt, []), zeros)
    assert set(torch.nonzero(bias[0]).flatten().tolist()) == firsts | bare
    assert word[0] in firsts and word[1] not in firsts

    # after the word's first k tokens, its (k+1)-th token is biased
    for k in range(1, len(word)):
        bias = steerer.bias(state_after(prompt, [7] + word[:k]), zeros)
        assert bias[0, word[k]].item() == strength, k
        assert all(bias[0, t].item() == strength for t in firsts)

    # an unrelated ending biases first tokens only (the prompt does not count)
    unrelated = encode_text(tokenizer, " the")
    bias = steerer.bias(state_after(prompt + word[:1], unrelated), zeros)
    assert set(torch.nonzero(bias[0]).flatten().tolist()) == firsts


def test_a_form_without_a_leading_space_starts_a_word_only_where_none_is_under_way(loaded, tokenizer):
    """Its first token is often a fragment of other words: biased after a word's end it would
    glue fragments into gibberish; after a space, a line break or punctuation it starts a word."""
    prompt = encode_text(tokenizer, "hello") + [tokenizer.eos_token_id]
    whole = [word for word in ("the", "and", "you", "hi", "a", "i") if len(encode_text(tokenizer, word)) == 1]
    assert whole  # the precondition: a word that is one token without a leading space
    steerer = prepared_bow(loaded, prompt, words=",".join([*whole, "chocolate"]), strength=4.0)
    bare = set(steerer.bare_first_tokens.tolist())
    forms = [encode_text(tokenizer, form) for word in whole for form in word_variants(word) if form[:1] != " "]
    assert {encode_text(tokenizer, word)[0] for word in whole} <= bare
    assert bare <= {ids[0] for ids in forms if len(ids) == 1}
    fragment = encode_text(tokenizer, "chocolate")
    assert len(fragment) > 1 and fragment[0] not in bare  # a fragment of other words is never started
    zeros = torch.zeros((1, len(tokenizer)))
    mid_word = encode_text(tokenizer, " the")
    assert tokenizer.decode(mid_word[-1:])[-1].isalnum()
    after_word = steerer.bias(state_after(prompt, mid_word), zeros)[0]
    assert all(after_word[token].item() == 0 for token in bare)
    for boundary in (" the (", " the.\n", " the, "):
        ids = encode_text(tokenizer, boundary)
        assert not tokenizer.decode(ids[-1:])[-1:].isalnum(), boundary
        after = steerer.bias(state_after(prompt, ids), zeros)[0]
        assert all(after[token].item() == 4.0 for token in bare), boundary


def test_bow_bias_adds_to_the_inner_logits(loaded, tokenizer):
    prompt = encode_text(tokenizer, "hi") + [tokenizer.eos_token_id]
    steerer = prepared_bow(loaded, prompt, words="pizza", strength=3)
    logits = torch.randn((1, len(tokenizer)), generator=torch.Generator().manual_seed(0))
    inner = lambda state: StepOutput(logits=logits.clone(), cache="cache")  # noqa: E731
    state = state_after(prompt, [])
    output = steerer.wrap(inner)(state)
    assert output.cache == "cache"
    torch.testing.assert_close(output.logits, logits + steerer.bias(state, logits))


# -- composition order ------------------------------------------------------------------------------


@dataclass
class ForceSettings:
    token: int = 0


EVENTS: list[str] = []


class ForceSteerer(Steerer):
    """Records entering and leaving its step, then makes ``token`` the only choice."""

    name = "force"
    Settings = ForceSettings

    def prepare(self, session):
        EVENTS.append(f"prepare {self.settings.token}")

    def wrap(self, step):
        EVENTS.append(f"wrap {self.settings.token}")

        def steered(state):
            EVENTS.append(f"in {self.settings.token}")
            output = step(state)
            EVENTS.append(f"out {self.settings.token}")
            logits = torch.full_like(output.logits, -1e9)
            logits[:, self.settings.token] = 0.0
            return output.replace(logits=logits)

        return steered


class ForcePlugin:
    @chatcore.hookimpl
    def register_steerers(self, register):
        register(ForceSteerer)


@pytest.fixture
def force_engine(loaded, host):
    host.register(ForcePlugin(), "force-plugin")
    EVENTS.clear()
    yield Engine(loaded, host=host)
    EVENTS.clear()


def test_the_last_steerer_given_is_the_outermost(force_engine):
    options = ReplyOptions(
        decoder="greedy",
        steerers=[("force", {"token": 5}), ("force", {"token": 7})],
        min_new_tokens=3,
        max_new_tokens=3,
    )
    response = force_engine.send(force_engine.conversation(), "hi", options)
    response.text()
    # the last one edits the logits last, so its token wins
    assert response.token_ids == [7, 7, 7]
    assert EVENTS[:4] == ["prepare 5", "prepare 7", "wrap 5", "wrap 7"]
    steps = EVENTS[4:]
    assert steps == ["in 7", "in 5", "out 5", "out 7"] * 3

    EVENTS.clear()
    options.steerers.reverse()
    response = force_engine.send(force_engine.conversation(), "hi", options)
    response.text()
    assert response.token_ids == [5, 5, 5]
    assert EVENTS[4:8] == ["in 5", "in 7", "out 7", "out 5"]


def test_compose_wraps_in_order():
    calls = []

    class Tag(Steerer):
        name = "tag"
        Settings = ForceSettings

        def wrap(self, step):
            def steered(state):
                calls.append(self.settings.token)
                return step(state)

            return steered

    step = compose(
        lambda state: calls.append("model") or "done",
        [Tag(ForceSettings(1)), Tag(ForceSettings(2)), Tag(ForceSettings(3))],
    )
    assert step(None) == "done"
    assert calls == [3, 2, 1, "model"]
    assert compose(lambda state: state * 2, [])(21) == 42


def test_prepare_is_called_once_per_response(force_engine):
    for n in (1, 6):
        EVENTS.clear()
        response = force_engine.send(
            force_engine.conversation(),
            "hi",
            ReplyOptions(
                decoder="top-k", seed=n, steerers=[("force", {"token": 9})], min_new_tokens=n, max_new_tokens=n
            ),
        )
        assert EVENTS == []  # nothing happens before the reply is consumed
        response.text()
        assert EVENTS.count("prepare 9") == 1 and EVENTS.count("wrap 9") == 1
        assert EVENTS.index("prepare 9") < EVENTS.index("in 9")
        assert EVENTS.count("in 9") == n
        response.text()  # replaying generates nothing
        assert EVENTS.count("prepare 9") == 1 and EVENTS.count("in 9") == n


def test_steerers_see_the_documented_step_states(loaded, host, tokenizer):
    states = []

    class Spy(Steerer):
        name = "spy"
        Settings = ForceSettings

        def wrap(self, step):
            def steered(state):
                states.append(
                    (
                        state.input_ids.tolist(),
                        state.sequences.tolist(),
                        state.position_ids.tolist(),
                        state.cache is None,
                        state.step,
                        state.prompt_length,
                        state.attention_mask.tolist(),
                    )
                )
                output = step(state)
                assert output.logits.shape == (1, len(tokenizer)) and output.logits.dtype == torch.float32
                return output

            return steered

    class SpyPlugin:
        @chatcore.hookimpl
        def register_steerers(self, register):
            register(Spy)

    host.register(SpyPlugin(), "spy-plugin")
    engine = Engine(loaded, host=host)
    conversation = engine.conversation()
    engine.add_user(conversation, "hello")
    prompt = engine.prompt(conversation, 4).token_ids
    response = engine.respond(
        conversation, ReplyOptions(decoder="greedy", steerers=[("spy", {})], min_new_tokens=4, max_new_tokens=4)
    )
    response.text()
    generated = response.token_ids
    assert len(states) == 4
    p = len(prompt)
    first = states[0]
    assert first == ([prompt], [prompt], [list(range(p))], True, 0, p, [[1] * p])
    for index, (input_ids, sequences, positions, no_cache, step, prompt_length, mask) in enumerate(states[1:], 1):
        assert input_ids == [[generated[index - 1]]]
        assert sequences == [prompt + generated[:index]]
        assert positions == [[p + index - 1]]
        assert not no_cache and step == index and prompt_length == p
        assert mask == [[1] * (p + index)]


def test_steerer_combinations_that_cannot_work_are_refused_before_a_reply():
    from chatcore.engine import ReplyOptions, validate_options
    from chatcore.errors import OptionError
    from chatcore.plugin_manager import get_plugin_host
    from chatcore.registry import Registry

    registry = Registry.build(get_plugin_host())
    refused = [
        (
            [("cocon", {"content": "pizza"}), ("pplm", {"topic": "food"})],
            "'pplm' edits the model's own key/value cache",
        ),
        (
            [("bow-bias", {"topic": "food"}), ("cocon", {"content": "pizza"})],
            "'cocon' replaces the model step, so it must",
        ),
        ([("cocon", {"content": "pizza"}), ("cocon", {"content": "dogs"})], "both replace the model step"),
    ]
    for steerers, needle in refused:
        with pytest.raises(OptionError, match=needle):
            validate_options(ReplyOptions(steerers=list(steerers)), registry)
    for fine in (
        [("pplm", {"topic": "food"}), ("bow-bias", {"topic": "food"})],
        [("cocon", {"content": "pizza"}), ("bow-bias", {"topic": "food"})],
    ):
        validate_options(ReplyOptions(steerers=fine), registry)


@dataclass
class NotingSettings:
    label: str = "a"


class Noting(Steerer):
    """Notes its label and how many steps it saw: one entry per instance."""

    name = "noting"
    Settings = NotingSettings

    def wrap(self, step):
        def noted(state):
            self.steps = getattr(self, "steps", 0) + 1
            return step(state)

        return noted

    def prepare(self, session):
        self.note(session, {"label": self.settings.label})


def test_two_instances_of_one_steerer_keep_their_own_details(loaded, host):
    host.register(NotingPlugin(), "noting-plugin")
    engine = Engine(loaded, host=host)
    options = ReplyOptions(
        decoder="greedy",
        max_new_tokens=3,
        steerers=[("noting", {"label": "first"}), ("noting", {"label": "second"}), ("noting", {"label": "third"})],
    )
    response = engine.reply_to(["hello"], options)
    response.text()
    assert response.provenance["details"] == {
        "noting": {"label": "first"},
        "noting#2": {"label": "second"},
        "noting#3": {"label": "third"},
    }


class Prepared(Steerer):
    """Counts its setups: work done once per engine and settings."""

    name = "prepared"
    Settings = NotingSettings
    setups: list[str] = []

    @classmethod
    def setup(cls, model, settings):
        cls.setups.append(settings.label)
        return {"label": settings.label, "vocab": len(model.tokenizer)}

    def wrap(self, step):
        return step

    def prepare(self, session):
        self.note(session, self.shared)


class NotingPlugin:
    """Registers the two steerers above."""

    @chatcore.hookimpl
    def register_steerers(self, register):
        register(Noting)
        register(Prepared)


def test_a_steerers_setup_runs_once_per_engine_and_settings_and_every_reply_shares_it(loaded, host):
    host.register(NotingPlugin(), "noting-plugin")
    engine = Engine(loaded, host=host)
    Prepared.setups.clear()

    def reply(label):
        options = ReplyOptions(decoder="greedy", max_new_tokens=2, steerers=[("prepared", {"label": label})])
        response = engine.reply_to(["hello"], options)
        response.text()
        return response.provenance["details"]["prepared"]

    first, second, other = reply("x"), reply("x"), reply("y")
    assert Prepared.setups == ["x", "y"]
    assert first is second and first == {"label": "x", "vocab": len(loaded.tokenizer)} and other["label"] == "y"
    # Another engine sets up for itself.
    Engine(loaded, host=host).reply_to(
        ["hi"], ReplyOptions(decoder="greedy", max_new_tokens=1, steerers=[("prepared", {"label": "x"})])
    ).text()
    assert Prepared.setups == ["x", "y", "x"]
