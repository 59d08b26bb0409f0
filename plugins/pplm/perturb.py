"""The PPLM perturbation, one decoding step at a time, on transformers' caches.

For every new token the wrapped step does (B rows at once; x = the token fed now):

1. the **plain pass**: x from the decoder's cache, exactly as without PPLM. Its cache
   (advanced by x) is what the step returns, so the conversation's history is never
   rewritten, and its next-token distribution p is the reference for the KL term and
   the fusion;
2. the **perturbation**: key/value deltas per perturbed layer (zeros to start) over the most recent
   ``window_length`` positions of the *perturbed past*; ``num_iterations`` times: run x
   from past + deltas, take loss = attribute loss + kl_scale * KL(p~ || p) per row,
   differentiate w.r.t. the deltas only, and step ``delta -= step * w * g / n ** gamma``,
   with ``step`` from :meth:`PerturbConfig.step_size`, ``w`` the window's (decay) weights
   and ``n`` the largest norm of ``w * g`` so far in the reply, per row and layer (keys
   and values together);
3. the **perturbed pass**: x from past + final deltas; with ``carry`` its keys and values,
   with the deltas baked in, make the perturbed past of the next step;
4. the **fusion**: scores = plain logits + gm_scale * (log p~ - log p), i.e. the
   geometric mixture p~^gm * p^(1-gm) as unnormalised log-probabilities. A zero
   perturbation gives back the plain logits bit for bit.

The step is written once over a runner of its passes (:mod:`chatcore.plugins.pplm.passes`), and
its gradient iterations in :mod:`chatcore.plugins.pplm.loop`. Two runners, with the same results
(tests/test_pplm_runner.py):

- **lean** (:mod:`chatcore.plugins.pplm.lean_passes`; GPT-2 and Llama-family models, PPLM the
  innermost steerer): the passes run through :class:`chatcore.plugins.pplm.runner.Runner` from
  the past as tensors, with low-rank deltas (:class:`chatcore.plugins.pplm.deltas.LowRankDeltas`)
  whose gradients come from two small probes. When the perturbation starts from the
  plain past (no carried perturbation, every row writing) the plain pass is the first
  iteration's forward.
- **model** (:mod:`chatcore.plugins.pplm.model_passes`; any other model, or other steerers inside
  PPLM, whose edits must take part): every pass is the inner step on a fresh
  ``DynamicCache`` built from past + dense deltas, and ``torch.autograd.grad`` gives the
  gradients w.r.t. the dense deltas.

Nothing re-runs the whole sequence: an optimised step costs num_iterations + 2 one-token
forwards (num_iterations + 1 on the lean path without a carried perturbation) and
num_iterations one-token backwards; after ``grad_length`` tokens (or between
``steer_every`` steps) it costs the plain and the perturbed forward only (the plain pass
alone without ``carry``). Until the first perturbation the perturbed past *is* the plain
one and no second past is kept. With ``layer_share`` below 1 only the top layers' past
is perturbed: on the lean path every pass after the first starts at the lowest perturbed
layer (the layers below see no delta, so their output is the first pass's), and the
backward passes stop there.

The first reply token is steered too: at the prompt step the plain pass runs on the whole
prompt as usual, and the perturbation treats the prompt's last token as x and the rest
of that pass's cache as the past.

Rows that have finished (their fed token is EOS) are left out of the optimisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from chatcore.api import Step, StepOutput, StepState

from .deltas import apply_deltas
from .hidden import ReplyHidden
from .kv import GrowingPast, Past, normal
from .lean_passes import LeanPasses
from .loop import MIN_LOG_PROB, NORM_EPSILON, Optimiser, fuse, kl_divergence, window_weights
from .model_passes import ModelPasses
from .passes import key_mask_of, plain_pass

if TYPE_CHECKING:
    from .attribute import AttributeModel
    from .config import PerturbConfig
    from .passes import PassRunner
    from .runner import Runner

__all__ = [
    "MIN_LOG_PROB",
    "NORM_EPSILON",
    "Perturbation",
    "apply_deltas",
    "fuse",
    "key_mask_of",
    "kl_divergence",
    "window_weights",
]


class Perturbation:
    """PPLM's state for one response, and the wrapped step (see the module docstring).

    ``runner``: a :class:`chatcore.plugins.pplm.runner.Runner` for the model, used for the
    perturbed passes when the inner step is the model's own (no other steerer inside
    PPLM); without it every pass goes through the inner step with a fresh cache.

    ``trace``: set to a list to record, for every optimised step, the attribute losses,
    KL terms and gradient norms of each iteration (costs a device sync; for tests and
    tuning, off by default).
    """

    def __init__(
        self,
        config: PerturbConfig,
        attribute: AttributeModel,
        model: Any,
        eos_token_id: int,
        runner: Runner | None = None,
        max_new_tokens: int = 0,
    ) -> None:
        self.config = config
        self.attribute = attribute
        self.model = model
        self.eos_token_id = eos_token_id
        self.runner = runner
        self.max_new_tokens = max_new_tokens
        self.trace: list[dict[str, Any]] | None = None
        # Updated in place: the steerer hands this dict to the response's provenance.
        self.summary: dict[str, Any] = {
            "attribute": attribute.describe(),
            "optimised_steps": 0,
            "inner_calls": 0,
            "runner_passes": 0,
        }
        self.hidden = ReplyHidden(attribute, model, config.horizon_length)
        self.optimiser = Optimiser(config, attribute, eos_token_id, self.hidden, self.summary)
        self.reset()

    def reset(self) -> None:
        self._perturbed: Past | GrowingPast | None = None  # None while it equals the plain past
        self.hidden.reset()
        self.optimiser.reset()

    @property
    def perturbed_past(self) -> Past | None:
        """The perturbed past (keys and values per layer), or None while it is the plain one."""
        if isinstance(self._perturbed, GrowingPast):
            return self._perturbed.view()
        return self._perturbed

    def _perturbed_base(self, length: int) -> Past:
        assert self._perturbed is not None
        if isinstance(self._perturbed, GrowingPast):
            assert self._perturbed.length == length, (self._perturbed.length, length)
            return self._perturbed.view()
        return self._perturbed

    def wrap(self, inner: Step) -> Step:
        def steered(state: StepState) -> StepOutput:
            # The decoding loop runs under inference_mode; gradients need it off here.
            with torch.inference_mode(False):
                return self.step(inner, state)

        return steered

    # -- one decoding step ---------------------------------------------------------------------
    def step(self, inner: Step, state: StepState) -> StepOutput:
        if state.step == 0:
            self.reset()
        state = state.replace(
            input_ids=normal(state.input_ids),
            sequences=normal(state.sequences),
            attention_mask=normal(state.attention_mask),
            position_ids=normal(state.position_ids),
        )
        past_len = state.sequences.size(1) - 1
        optimise = self.config.optimises(state.step) and past_len >= 1
        if past_len < 1 or (self._perturbed is None and not optimise):
            # Nothing to steer: exactly the inner step (a zero step size is unsteered output).
            needs_hidden = self.attribute.needs_hidden
            return self._finish(state, plain_pass(inner, state, needs_hidden, self.summary))
        return self._steer(self._passes(inner, state), state, past_len, optimise)

    def _passes(self, inner: Step, state: StepState) -> PassRunner[Any, Any]:
        """The runner of this step's passes: the lean one where it computes what the inner step does."""
        needs_hidden = self.attribute.needs_hidden
        if self.runner is not None and self.runner.usable():
            from transformers import DynamicCache

            # At the prompt step the prompt pass is the model's own, the rest lean.
            if state.input_ids.size(1) > 1 or isinstance(state.cache, DynamicCache):
                return LeanPasses(self.runner, inner, state, self.config, needs_hidden, self.summary)
        return ModelPasses(inner, self.model, self.config, needs_hidden, self.summary)

    def _steer(self, passes: PassRunner[Any, Any], state: StepState, past_len: int, optimise: bool) -> StepOutput:
        """The plain pass, the optimisation, the perturbed pass and the fusion (module docstring)."""
        fed = self._fed(state)
        merge = (
            passes.merges(state)
            and optimise
            and self._perturbed is None
            and not self.attribute.needs_hidden
            and bool(self.optimiser.active_rows(fed).all())
        )
        plain, plain_past = passes.plain(state, past_len, merge)
        base = self._perturbed_base(past_len) if self._perturbed is not None else plain_past
        deltas = rows = first = None
        if optimise:
            deltas, rows, first = self.optimiser.optimise(passes, fed, base, plain, self.trace)
        if plain is None:
            assert first is not None, "the first iteration was to be the plain pass"
            plain = passes.plain_from(first)
        if deltas is None and self._perturbed is None:
            return self._finish(state, plain)
        with torch.no_grad():
            full = deltas
            if deltas is not None and rows is not None:  # finished rows: zero deltas
                full = passes.spread(deltas, rows, fed.input_ids.size(0))
            perturbed = passes.run(fed, base, full, (), False)
            if self.config.carry:
                capacity = past_len + 1 + max(self.max_new_tokens - state.step, 1)
                self._perturbed = passes.carry(self._perturbed, base, deltas, rows, perturbed, capacity)
        return self._finish(state, plain.replace(logits=self._fuse(plain.logits, perturbed.logits)))

    @staticmethod
    def _fed(state: StepState) -> StepState:
        """The state of the fed token x (at the prompt step: the prompt's last token)."""
        if state.input_ids.size(1) > 1:
            return state.replace(input_ids=state.input_ids[:, -1:], position_ids=state.position_ids[:, -1:])
        return state

    def _fuse(self, plain_logits: torch.Tensor, perturbed_logits: torch.Tensor) -> torch.Tensor:
        plain_log_probs = torch.log_softmax(plain_logits.float(), dim=-1)
        perturbed_log_probs = torch.log_softmax(perturbed_logits.float(), dim=-1)
        return fuse(plain_logits, plain_log_probs, perturbed_log_probs, self.config.gm_scale)

    def _finish(self, state: StepState, plain: StepOutput) -> StepOutput:
        """Note the plain hidden state for the discriminator; return what the caller asked for."""
        self.hidden.note(plain)
        return plain if state.output_hidden_states else plain.replace(hidden_states=None)
