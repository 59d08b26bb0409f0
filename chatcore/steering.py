"""The steerer interface: middleware around one decoding step.

A steerer has a ``name``, typed ``Settings``, an optional ``setup(model, settings)`` run
once per engine and settings (whose result every reply reuses as ``self.shared``; see
:meth:`chatcore.options.Configurable.setup`), a
``prepare(session)`` called once per response, and ``wrap(step) -> step``.

Composition order (written down, and the same everywhere): steerers are applied in
the order they are given. The first wraps the model's own step, the second wraps
that, and so on, so the **last steerer is the outermost**: it sees the state first
and edits the logits last. Logit edits therefore accumulate in the given order, and
a steerer that re-runs its inner step (PPLM) re-runs every steerer listed before it.
After all steerers, the decoder's score processors run (see chatcore.processors).

A steerer instance serves one response at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from chatcore.options import Configurable
from chatcore.step import Step, StepOutput, StepState
from chatcore.values import Message

if TYPE_CHECKING:
    import torch

    from chatcore.models import LoadedModel


@dataclass
class Candidate:
    """One sampled reply, for decoders that produce several."""

    token_ids: list[int]
    text: str
    scores: dict[str, float] = field(default_factory=dict)
    chosen: bool = False


@dataclass
class GenerationSession:
    """Everything the decoding of one response needs.

    prompt_ids:      the formatted prompt (chatcore.prompting renders it).
    steerers:        in composition order (see chatcore.steering).
    generator:       the seeded random generator every sampling draw uses.
    min_new_tokens:  stop tokens are banned during the first this-many steps.
    stop_token_ids:  a row ends at any of these (default: EOS alone).
    banned_token_ids: never generated (the special tokens that are not stop tokens).
    messages:        the messages the prompt was rendered from (system first if any),
                     for decoders and steerers that read the conversation as text.
    logprobs:        keep each chosen token's log-probability and this many best
                     alternatives' (chatcore.serving.logprobs); None: none.
    candidates:      filled by decoders that sample several replies.
    details:         free-form notes for provenance (decoders and steerers may add).
    """

    model: "LoadedModel"
    prompt_ids: list[int]
    steerers: Sequence["Steerer"]
    max_new_tokens: int
    generator: "torch.Generator"
    seed: int
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    banned_token_ids: frozenset[int] = frozenset()
    messages: list[Message] = field(default_factory=list)
    logprobs: int | None = None
    candidates: list[Candidate] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_token_id(self) -> int:
        """The model's EOS: a stop token, and the filler of rows that have ended."""
        return self.model.eos_token_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every token that ends a reply (EOS when no format said otherwise)."""
        return self.stop_token_ids | {self.eos_token_id}


class Steerer(Configurable):
    """Base class for steerers. Subclasses set ``name`` and ``Settings`` and implement ``wrap``."""

    kind: ClassVar[str] = "steerer"
    # Whether one row of a batch shared with other replies may be steered by this steerer
    # (chatcore.serving). True only for a steerer whose wrapped step calls its inner step
    # once, with the state it was given, and changes nothing but the logits that come out:
    # the serving batch then runs the model for every row at once and hands each row's
    # steerers that row's output alone. A steerer that re-runs the model, edits the cache
    # or reads hidden states (PPLM, CoCon, activation steering) keeps the default, and
    # its replies are decoded in a batch of their own.
    shares_batch: ClassVar[bool] = False
    # Whether a reply with this steerer (one that does not share the batch) may run its step
    # on the serving runner's worker thread, at the same time as the shared batch's pass
    # through the same model, so that a slow step (PPLM's several passes) slows its own
    # reply alone. True only for a steerer that changes the model in no way another thread
    # could see (a forward hook must leave other threads' passes alone, as the ``vector``
    # steerer's does) and keeps nothing shared with other replies' steps unguarded. With
    # the default, the reply's step runs on the scheduler's thread and the batch waits for it.
    runs_beside: ClassVar[bool] = False
    # What the steerer does to the model step, for the composition check
    # (:func:`check_composition`), which refuses a combination that can never work when
    # the steerers are chosen, before any message is sent:
    # replaces_model     the steerer is the model step itself (CoCon runs the model in two
    #                    halves with a cache of its own): it must come first, one per reply.
    # needs_model_cache  the steerer edits the model's own key/value cache (PPLM): nothing
    #                    inside it may replace the model step, and one per reply (it
    #                    differentiates through its inner step, whose output another
    #                    such steerer has already detached from the cache).
    replaces_model: ClassVar[bool] = False
    needs_model_cache: ClassVar[bool] = False

    # Where :meth:`note` files this instance's details in the reply's provenance: the
    # steerer's name, or "name#2", "name#3" ... for later instances of one steerer in a reply.
    details_key: str = ""

    def note(self, session: "GenerationSession", details: object) -> None:
        """Record ``details`` (plain JSON-able data) for this reply's provenance, under this
        instance's own key, so two instances of one steerer never overwrite each other
        (``/why`` shows them; the conversation log keeps them)."""
        session.details[self.details_key or self.name] = details

    def prepare(self, session: "GenerationSession") -> None:
        """Called once per response, before the first step."""

    def wrap(self, step: Step) -> Step:
        raise NotImplementedError


def check_composition(steerers: Sequence[type[Steerer]]) -> None:
    """Refuse steerer classes, in composition order, that can never work together (OptionError).

    The message is one line naming both steerers; every entry point (command line, REPL,
    Discord, HTTP, Python API) shows it when the steerers are chosen.
    """
    from chatcore.errors import OptionError

    replacing = [index for index, cls in enumerate(steerers) if cls.replaces_model]
    if len(replacing) > 1:
        names = " and ".join(repr(steerers[index].name) for index in replacing[:2])
        raise OptionError(f"steerers {names} both replace the model step: give only one of them")
    caching = [cls for cls in steerers if cls.needs_model_cache]
    if len(caching) > 1:
        names = " and ".join(repr(cls.name) for cls in caching[:2])
        raise OptionError(f"steerers {names} both edit the model's own key/value cache: give only one of them")
    if replacing:
        # Checked before the order: no order makes these two work, so the message must not
        # suggest one.
        replacer = steerers[replacing[0]]
        for cls in steerers:
            if cls.needs_model_cache:
                raise OptionError(
                    f"steerer {cls.name!r} edits the model's own key/value cache and cannot be "
                    f"combined with {replacer.name!r}, which replaces the model step"
                )
    if replacing and replacing[0] > 0:
        first = steerers[replacing[0]]
        raise OptionError(
            f"steerer {first.name!r} replaces the model step, so it must come first "
            f"(give it before {steerers[0].name!r})"
        )


LAYER_ATTRIBUTE = "chatcore_step_layer"
CALLER_ATTRIBUTE = "chatcore_step_caller"  # for a failure of the model: the steerer layer that called it


def _tag_failures(step: Step, layer: str, inner: list[Any] | None = None) -> Step:
    """Mark an exception escaping ``step`` with the layer it came from, unless an inner
    layer already did: the innermost layer that raised is the one to blame.

    ``inner``: for a steerer's layer, where the step it wraps leaves its output's logits; the
    steerer's own output is checked against them (a StepOutput whose logits have the inner
    logits' shape), so that a steerer returning something else is blamed, not whatever
    reads its scores next."""

    def tagged(state: StepState) -> StepOutput:
        try:
            if inner is not None:
                inner.clear()
            output = step(state)
            if inner is not None:
                _check_output(output, inner)
            return output
        except Exception as error:
            if not hasattr(error, LAYER_ATTRIBUTE):
                setattr(error, LAYER_ATTRIBUTE, layer)
            elif inner is not None and failed_layer(error) == "model" and not hasattr(error, CALLER_ATTRIBUTE):
                setattr(error, CALLER_ATTRIBUTE, layer)  # the first steerer it passes through called the model
            raise

    return tagged


def _check_output(output: Any, inner: list[Any]) -> None:
    """A steerer's step output, where it called the step it wraps this time and that gave a
    StepOutput: a StepOutput too, whose logits have the same shape and are floating point."""
    wrapped = getattr(inner[-1], "shape", None) if inner else None
    if wrapped is None:
        return
    shape = getattr(getattr(output, "logits", None), "shape", None)
    if not isinstance(output, StepOutput) or shape is None:
        raise TypeError(f"its step returned {type(output).__name__}, not a StepOutput with logits")
    if tuple(shape) != tuple(wrapped):
        raise ValueError(
            f"its step returned logits of shape {tuple(shape)}, where the step it wraps gave {tuple(wrapped)}"
        )
    floating = getattr(output.logits, "is_floating_point", None)
    if floating is not None and not floating():
        raise TypeError(f"its step returned logits of {output.logits.dtype}: scores are floating point")


def _noting(step: Step, inner: list[Any]) -> Step:
    """``step``, leaving its output's logits in ``inner`` for the steerer that wraps it."""

    def noted(state: StepState) -> StepOutput:
        output = step(state)
        inner.append(output.logits if isinstance(output, StepOutput) else None)
        return output

    return noted


def failed_layer(error: BaseException) -> str | None:
    """``"model"``, ``"steerer:NAME"``, or None if the error did not come from a step."""
    return getattr(error, LAYER_ATTRIBUTE, None)


def model_caller(error: BaseException) -> str | None:
    """For a failure of the model (:func:`failed_layer` ``"model"``): ``"steerer:NAME"``, the
    steerer whose step called the model with the state it failed on, or None where the
    model was called by the loop itself."""
    return getattr(error, CALLER_ATTRIBUTE, None)


def compose(step: Step, steerers: Sequence[Steerer]) -> Step:
    """Wrap ``step`` by each steerer in order (the last one given is the outermost).

    Every layer is tagged so that a failure names the steerer (or the model) it came from.
    """
    step = _tag_failures(step, "model")
    seen: list[tuple[str, list[Any]]] = []  # each steerer's layer, and what the step it wraps gave it
    for steerer in steerers:
        layer = f"steerer:{steerer.name}"
        inner: list[Any] = []
        try:
            wrapped = steerer.wrap(_noting(step, inner))
        except Exception as error:  # a failure while wrapping is the steerer's too
            if not hasattr(error, LAYER_ATTRIBUTE):
                setattr(error, LAYER_ATTRIBUTE, layer)
            raise
        step = _tag_failures(wrapped, layer, inner)
        seen.append((layer, inner))
    setattr(step, SEEN_ATTRIBUTE, seen)
    return step


SEEN_ATTRIBUTE = "chatcore_layers_seen"


def scores_spoiled_by(step: Step, logits: Any) -> str | None:
    """The layer of a composed ``step`` (``"steerer:NAME"``) whose output at its last call first
    had a row with no finite score or a NaN, given ``logits``, the outermost layer's output;
    None where none had (or the model's own scores were so already). Reads the scores: for
    finding whom to blame once selecting from them has failed, not for every step."""
    import torch

    def spoiled(scores: Any) -> bool:
        if not isinstance(scores, torch.Tensor) or scores.dim() == 0:
            return False
        finite = torch.isfinite(scores) | (scores == float("-inf"))  # -inf bans a token; NaN, +inf spoil
        return bool((~finite).any()) or bool((~torch.isfinite(scores)).all(dim=-1).any())

    seen: list[tuple[str, list[Any]]] = getattr(step, SEEN_ATTRIBUTE, [])
    outputs = [inner[-1] if inner else None for _, inner in seen[1:]] + [logits]
    if seen and spoiled(seen[0][1][-1] if seen[0][1] else None):
        return None  # the model gave them so
    for (layer, _), output in zip(seen, outputs):
        if spoiled(output):
            return layer
    return None
