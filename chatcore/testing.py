"""Helpers for testing chatcore plugins, with or without pytest.

chatcore's pytest plugin (:mod:`chatcore.pytest_plugin`) wraps these as fixtures:

    build_tiny_model(directory)          a tiny random GPT-2 (or Llama, Qwen2, Gemma ...) with the
                                         bundled model's tokenizer (and, optionally, a chat template)
    plugin_host(*plugins)                greedy and top-k plus only the plugins under test
    make_engine(model, *plugins)         an Engine on that host
    build_conversation(engine, *turns)   a conversation with scripted turns
    compare_to_baseline(engine, ...)     eval metrics of a steerer vs no steering
    openers()                            the 30 chat openers `chatcore eval --prompts openers` uses

and ``decode_steps(session, select)`` runs a hand-made GenerationSession through the
runner that decodes every reply, yielding each step's chosen tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.decoding import Decoder, Select
from chatcore.errors import ChatcoreError, PluginError
from chatcore.evaluation import prompts
from chatcore.evaluation.prompts import EvalContext
from chatcore.evaluation.runner import EvalReport, EvalRow
from chatcore.models import DEFAULT_MODEL, resolve_model_path
from chatcore.plugin_manager import PluginHost

if TYPE_CHECKING:
    import torch

    from chatcore.conversation import Conversation
    from chatcore.decoding import GenerationSession, Sampled
    from chatcore.engine import Engine
    from chatcore.models import LoadedModel
    from chatcore.processors import ScoreProcessor

# chatcore's own decoders every test host gets, by their entry-point names.
BASE_PLUGINS = ("greedy", "top_k")


# A ChatML chat template (the format of SmolLM2, Qwen2 and others), for tiny chat models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHITECTURES = ("gpt2", "llama", "qwen2", "mistral", "gemma", "phi3")


def build_tiny_model(
    directory: str | Path,
    layers: int = 2,
    width: int = 32,
    heads: int = 2,
    positions: int = 128,
    seed: int = 0,
    tokenizer: str = DEFAULT_MODEL,
    architecture: str = "gpt2",
    chat_template: str | None = None,
) -> Path:
    """Write a tiny causal LM folder: random weights (seeded) and the real byte-level
    BPE tokenizer of a bundled model (chatcore-tiny's, by default).

    ``architecture`` is one of ``ARCHITECTURES`` (GPT-2 or a Llama-family model with
    rotary positions, RMSNorm and, from 2 heads up, grouped-query attention).
    ``chat_template``: a Jinja chat template (e.g. ``CHATML_TEMPLATE``) for the tokenizer;
    its ``<|im_start|>`` / ``<|im_end|>`` markers are added as special tokens.

    Its replies are gibberish, but every code path is the real one: the same tokenizer,
    ``from_pretrained`` loading and forward pass as a full-size model, in a fraction of
    a second.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config

    if architecture not in ARCHITECTURES:
        raise ValueError(f"`architecture` must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}")
    directory = Path(directory)
    real_tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer))
    if chat_template is not None:
        real_tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        real_tokenizer.chat_template = chat_template
    eos = real_tokenizer.eos_token_id
    ids = {"eos_token_id": eos, "bos_token_id": eos, "pad_token_id": eos}
    torch.manual_seed(seed)
    config: Any
    if architecture == "gpt2":
        config = GPT2Config(
            vocab_size=len(real_tokenizer), n_positions=positions, n_embd=width, n_layer=layers, n_head=heads, **ids
        )
    else:
        config = AutoConfig.for_model(
            architecture,
            vocab_size=len(real_tokenizer),
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=width // heads,
            max_position_embeddings=positions,
            tie_word_embeddings=True,
            **ids,
        )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    real_tokenizer.save_pretrained(str(directory))
    return directory


def plugin_host(*plugins: Any) -> PluginHost:
    """A host with the greedy and top-k decoders and ``plugins``: module names,
    modules, or other objects with hookimpls. Installed plugins are not loaded.

    Raises PluginError if a plugin is refused (an import error, a misspelled hook).
    """
    host = PluginHost()
    host.load_builtins(BASE_PLUGINS)
    for plugin in plugins:
        if isinstance(plugin, str):
            host.load_modules((plugin,))
        else:
            name = getattr(plugin, "__name__", None) or type(plugin).__name__
            host.register(plugin, name)
            host.check_pending()
    if host.problems:
        first = host.problems[0]
        raise PluginError(first.plugin, f"refused at {first.stage}: {first.message}")
    return host


def make_engine(model: "str | LoadedModel", *plugins: Any) -> "Engine":
    """An Engine on ``model`` whose registry holds greedy, top-k and ``plugins`` only.

    A plugin problem (a hook that raises, a registration that is refused: not a Steerer,
    a name clash) fails here, naming the plugin: a plugin under test must load cleanly.
    """
    from chatcore.engine import Engine
    from chatcore.errors import PluginError

    engine = Engine(model, host=plugin_host(*plugins))
    if engine.host.problems:
        first = engine.host.problems[0]
        raise PluginError(first.plugin, f"failed at {first.stage}: {first.message}")
    return engine


def build_conversation(engine: "Engine", *turns: str) -> "Conversation":
    """A conversation whose turns alternate so that the last one is the user's (the
    same rule, and the same cleaning of each turn, as ``Engine.reply_to``)."""
    return engine.scripted(turns)


def openers() -> list[EvalContext]:
    """The 30 chat openers (``chatcore eval --prompts openers``): contexts for
    :func:`compare_to_baseline`."""
    return prompts.openers()


@dataclass
class Comparison:
    """The same contexts and seeds, replied to without and with a steerer.

    baseline, steered: metrics averaged over the seeds (see EvalRow).
    reports:           the full report of every run (replies included), by seed.
    """

    baseline: EvalRow
    steered: EvalRow
    reports: dict[str, list[EvalReport]]

    @property
    def attribute_gain(self) -> float | None:
        """Steered minus baseline share of replies with a vocabulary word."""
        if self.steered.attribute_share is None or self.baseline.attribute_share is None:
            return None
        return self.steered.attribute_share - self.baseline.attribute_share

    @property
    def perplexity_ratio(self) -> float | None:
        """Steered over baseline perplexity of the replies under the plain model (the fluency cost)."""
        if not self.steered.perplexity or not self.baseline.perplexity:
            return None
        return self.steered.perplexity / self.baseline.perplexity


def _contexts(contexts: Iterable[EvalContext | str | Sequence[str]]) -> list[EvalContext]:
    result = []
    for context in contexts:
        if isinstance(context, EvalContext):
            result.append(context)
        elif isinstance(context, str):
            result.append(EvalContext([context]))
        else:
            result.append(EvalContext(list(context)))
    if not result:
        raise ValueError("`contexts` must hold at least one context, got none")
    return result


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def mean_row(label: str, rows: Sequence[EvalRow]) -> EvalRow:
    """One row whose every metric is the mean over ``rows`` (counts are summed)."""
    return EvalRow(
        label=label,
        count=sum(r.count for r in rows),
        perplexity=_mean([r.perplexity for r in rows]),
        distinct_1=statistics.fmean(r.distinct_1 for r in rows),
        distinct_2=statistics.fmean(r.distinct_2 for r in rows),
        distinct_3=statistics.fmean(r.distinct_3 for r in rows),
        mean_length=statistics.fmean(r.mean_length for r in rows),
        degenerate_share=statistics.fmean(r.degenerate_share for r in rows),
        attribute_share=_mean([r.attribute_share for r in rows]),
        tokens_per_s=_mean([r.tokens_per_s for r in rows]),
    )


def compare_to_baseline(
    engine: "Engine",
    steerer: str,
    settings: dict[str, Any] | None = None,
    contexts: Iterable[EvalContext | str | Sequence[str]] = ("hi, how are you?", "what do you do for fun?"),
    seeds: Iterable[int] = (0,),
    vocabulary: Iterable[str] | str | None = None,
    decoder: str = "top-k",
    decoder_settings: dict[str, Any] | None = None,
    max_new_tokens: int = 24,
) -> Comparison:
    """Reply to ``contexts`` without and with ``steerer`` and measure both.

    Each seed runs every context once (context i uses ``seed + i``, as in
    ``chatcore eval``), so the baseline and the steered run sample with the same
    random draws. ``vocabulary`` is a set of words or phrases, or the name of a
    built-in word list ("food", "sports", ...) or a word file, for the attribute
    share. Bad settings raise OptionError before anything is generated.
    """
    from chatcore.engine import ReplyOptions
    from chatcore.evaluation.runner import evaluate

    settings = dict(settings or {})
    engine.make_steerer(steerer, settings)
    context_list = _contexts(contexts)
    seed_list = list(seeds)
    if not seed_list:
        raise ValueError("`seeds` must hold at least one seed, got none")
    if isinstance(vocabulary, str):
        from chatcore.evaluation.commands import load_vocabulary

        words: set[str] | None = load_vocabulary(vocabulary)
    else:
        words = set(vocabulary) if vocabulary is not None else None
    plain = ReplyOptions(decoder=decoder, decoder_settings=dict(decoder_settings or {}), max_new_tokens=max_new_tokens)
    runs = {"baseline": plain, "steered": plain.replace(steerers=[(steerer, settings)])}
    reports: dict[str, list[EvalReport]] = {}
    for label, options in runs.items():
        reports[label] = [
            evaluate(engine, context_list, options, label=label, vocabulary=words, seed=seed, include_reference=False)
            for seed in seed_list
        ]
    for label, label_reports in reports.items():
        for report in label_reports:
            failed = [s["error"] for s in report.samples if "error" in s]
            if failed:
                # evaluate() skips a context that raised; a comparison must not hide it.
                raise ChatcoreError(f"the {label} run failed: {failed[0]}")
    return Comparison(
        baseline=mean_row("baseline", [r.rows[0] for r in reports["baseline"]]),
        steered=mean_row(steerer, [r.rows[0] for r in reports["steered"]]),
        reports=reports,
    )


class StepDecoder(Decoder):
    """A bare decoder for :func:`decode_steps`: the given processors and ``select`` on
    ``rows`` rows; the first row is the reply."""

    name = "test-steps"

    def __init__(
        self,
        select: "Select",
        processors: Sequence["ScoreProcessor"] = (),
        rows: int = 1,
    ) -> None:
        super().__init__(None)
        self._select, self._processors, self._rows = select, list(processors), rows

    def rows(self) -> int:
        return self._rows

    def processors(self) -> list["ScoreProcessor"]:
        return list(self._processors)

    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        return self._select(scores, generator)

    def choose(self, session: "GenerationSession", rows: Sequence["Sampled"]) -> int:
        return 0


def decode_steps(
    session: "GenerationSession",
    select: "Select",
    processors: Sequence["ScoreProcessor"] = (),
    rows: int = 1,
) -> Iterator["torch.Tensor"]:
    """Decode ``session`` (its steerers prepared) through chatcore's runner, ``rows`` rows
    from its prompt, yielding each step's (rows,) chosen tokens until every row has
    reached a stop token or ``session.max_new_tokens`` steps; rows that ended get EOS.
    A failure raises the original exception."""
    from chatcore.serving.requests import Handle
    from chatcore.serving.runner import Runner

    steps: list["torch.Tensor"] = []
    handle = Handle()
    runner = Runner(session.model)
    runner.add(handle, session, StepDecoder(select, processors, rows), observer=steps.append)
    try:
        while runner.jobs:
            runner.step()
            yield from steps
            steps.clear()
    finally:
        runner.cancel_all()
    if handle.error is not None:
        raise handle.error.__cause__ or handle.error


class ScriptedDecoder(Decoder):
    """A decoder that says fixed tokens whatever the model scores, then a stop token: for
    testing adapters and logs with replies of chosen characters. Subclasses give
    :meth:`script`; the reply's budget (``max_new_tokens``) still cuts it."""

    def script(self, session: "GenerationSession") -> list[int]:
        raise NotImplementedError

    def prepare(self, session: "GenerationSession") -> None:
        self._tokens = [*self.script(session), session.eos_token_id]
        self._position = 0

    def next_token(self) -> int:
        """The script's next token (the stop token once it is all said)."""
        token = self._tokens[min(self._position, len(self._tokens) - 1)]
        self._position += 1
        return token

    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        import torch

        return torch.full((scores.size(0),), self.next_token(), dtype=torch.long, device=scores.device)
