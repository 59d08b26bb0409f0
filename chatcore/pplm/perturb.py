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

Two ways to run the passes, with the same results (tests/test_pplm_runner.py):

- **lean** (GPT-2 and Llama-family models, PPLM the innermost steerer): the passes run
  through :class:`chatcore.pplm.runner.Runner` from the past as tensors, and the deltas
  are kept as low-rank factors (:class:`chatcore.pplm.runner.LowRankDeltas`): with one
  query per row and head the gradient w.r.t. a layer's deltas is a sum of outer products
  (one per query head of a key/value head), recovered from the gradients of two small
  probes, so neither the deltas nor their gradients are built at full size. When the
  perturbation starts from the plain past (no carried perturbation, every row writing)
  the plain pass is the first iteration's forward.
- **generic** (any other model, or other steerers inside PPLM, whose edits must take
  part): every pass is the inner step on a fresh ``DynamicCache`` built from past +
  dense deltas (a forward appends to the cache it is given, so a cache is never reused),
  and ``torch.autograd.grad`` gives the gradients w.r.t. the dense deltas.

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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from chatcore.models import cache_keyword, output_cache
from chatcore.pplm.attribute import AttributeInputs, AttributeModel
from chatcore.pplm.config import PerturbConfig
from chatcore.pplm.kv import GrowingPast, Past, fresh_cache, normal, past_length, past_of, select_rows
from chatcore.pplm.runner import LowRankDeltas, RunOutput, Start
from chatcore.step import Step, StepOutput, StepState

# Probabilities below this count as this in the KL term (as the paper's code does), so a
# token one distribution rules out does not make the loss infinite.
MIN_LOG_PROB = math.log(1e-15)
NORM_EPSILON = 1e-15


def window_weights(window: int, decay: bool, device: Any = "cpu") -> torch.Tensor:
    """(W,) weights of the window's positions, oldest first: ones, or with ``decay`` a
    ramp 1/W, 2/W, ..., 1 that leaves the newest position the largest updates."""
    if not decay:
        return torch.ones(window, device=device)
    return torch.arange(1, window + 1, device=device, dtype=torch.float32) / window


def apply_deltas(past: Past, deltas: list[torch.Tensor] | None, first_layer: int = 0) -> Past:
    """``past`` with ``deltas`` (keys and values of each layer in turn from ``first_layer``
    up, each (B, H, W, D)) added to its most recent W positions."""
    if deltas is None:
        return past
    out: Past = list(past[:first_layer])
    for index, (keys, values) in enumerate(past[first_layer:]):
        out.append((_add_recent(keys, deltas[2 * index]), _add_recent(values, deltas[2 * index + 1])))
    return out


def _add_recent(tensor: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    length, window = tensor.size(2), delta.size(2)
    assert window <= length, (window, length)
    if window == length:
        return tensor + delta.to(tensor.dtype)
    return torch.cat([tensor[:, :, : length - window], tensor[:, :, length - window :] + delta.to(tensor.dtype)], dim=2)


def key_mask_of(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """(B, T) bool keys to attend to, or None when every key counts (no left padding)."""
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask


def _select_state(state: StepState, rows: torch.Tensor) -> StepState:
    return state.replace(
        input_ids=state.input_ids[rows],
        sequences=state.sequences[rows],
        attention_mask=state.attention_mask[rows],
        position_ids=state.position_ids[rows],
    )


def kl_divergence(log_probs: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """(B,) KL(p || q) from log-probabilities (B, V); 0 when the two are equal."""
    log_p = log_probs.clamp(min=MIN_LOG_PROB)
    log_q = reference_log_probs.clamp(min=MIN_LOG_PROB)
    return (log_probs.exp() * (log_p - log_q)).sum(-1)


def fuse(
    logits: torch.Tensor, plain_log_probs: torch.Tensor, perturbed_log_probs: torch.Tensor, gm_scale: float
) -> torch.Tensor:
    """Scores whose softmax is p~^gm * p^(1-gm) (normalised): the plain ``logits`` shifted by
    gm * (log p~ - log p). Tokens the plain pass rules out (-inf) stay ruled out."""
    if gm_scale == 0.0:
        return logits
    shift = gm_scale * (perturbed_log_probs - plain_log_probs)
    shift = torch.where(torch.isfinite(plain_log_probs), shift, torch.zeros_like(shift))
    return logits + shift


@dataclass
class Pass:
    """One forward pass from a (perturbed) past.

    cache:  through the model's own forward: the fresh cache it filled (past + x);
    new:    through the GPT-2 runner: the fed token's keys and values, per layer.
    """

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    cache: Any = None
    new: Past | None = None


Forward = Callable[[StepState, Past, "list[torch.Tensor] | None", bool], Pass]


@dataclass
class _Setup:
    """What the iterations of one step share (for the rows still writing: ``rows``, or all)."""

    rows: torch.Tensor | None
    state: StepState
    base: Past
    window: int
    first_layer: int  # the lowest perturbed layer (the deltas hold the layers from it up)
    weights: torch.Tensor | None  # (W,) decay weights, or None
    targets: Any
    reference: torch.Tensor | None  # (b, V) plain log-probabilities (None: the first pass is the plain one)
    hidden_context: dict[str, Any] | None
    record: dict[str, Any] | None


class Perturbation:
    """PPLM's state for one response, and the wrapped step (see the module docstring).

    ``runner``: a :class:`chatcore.pplm.runner.Runner` for the model, used for the
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
        runner: Any = None,
        max_new_tokens: int = 0,
    ) -> None:
        self.config = config
        self.attribute = attribute
        self.model = model
        self.model_config = getattr(model, "config", None)
        self.eos_token_id = eos_token_id
        self.runner = runner
        self.max_new_tokens = max_new_tokens
        self.trace: list[dict[str, Any]] | None = None
        self.batch_size = 0
        # Updated in place: the steerer hands this dict to the response's provenance.
        self.summary: dict[str, Any] = {
            "attribute": attribute.describe(),
            "optimised_steps": 0,
            "inner_calls": 0,
            "runner_passes": 0,
        }
        self.reset()

    def reset(self) -> None:
        self._perturbed: Past | GrowingPast | None = None  # None while it equals the plain past
        self.hidden_sum: torch.Tensor | None = None  # (B, C) plain hidden states of the reply so far
        self.hidden_count = 0
        self.grad_norm_max: torch.Tensor | None = None  # (B, layers) largest gradient norm so far

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
            return self._finish(state, self._plain_pass(inner, state))
        if self._lean(state):
            return self._lean_step(inner, state, past_len, optimise)
        return self._generic_step(inner, state, past_len, optimise)

    def _lean(self, state: StepState) -> bool:
        if self.runner is None or not self.runner.usable():
            return False
        if state.input_ids.size(1) > 1:
            return True  # the prompt step: the prompt pass is the model's own, the rest lean
        from transformers import DynamicCache

        return isinstance(state.cache, DynamicCache)

    @staticmethod
    def _fed(state: StepState) -> StepState:
        """The state of the fed token x (at the prompt step: the prompt's last token)."""
        if state.input_ids.size(1) > 1:
            return state.replace(input_ids=state.input_ids[:, -1:], position_ids=state.position_ids[:, -1:])
        return state

    def _generic_step(self, inner: Step, state: StepState, past_len: int, optimise: bool) -> StepOutput:
        """Every pass through the inner step, from fresh transformers caches."""
        plain = self._plain_pass(inner, state)
        fed = self._fed(state)
        base = self._perturbed_base(past_len) if self._perturbed is not None else past_of(plain.cache, past_len)

        def forward(sub_state: StepState, sub_base: Past, deltas: list[torch.Tensor] | None, hidden: bool) -> Pass:
            first_layer = self.config.first_perturbed_layer(len(sub_base))
            cache = fresh_cache(apply_deltas(sub_base, deltas, first_layer), self.model_config)
            output = self._call(inner, sub_state.replace(cache=cache, output_hidden_states=hidden))
            return Pass(logits=output.logits, hidden_states=output.hidden_states, cache=output.cache)

        deltas = None
        if optimise:
            deltas = self._optimise(
                forward, fed, base, plain, context=lambda rows: self._hidden_context(past_of(plain.cache), rows)
            )
        if deltas is None and self._perturbed is None:
            return self._finish(state, plain)
        with torch.no_grad():
            perturbed = forward(fed, base, None if deltas is None else list(deltas.unbind(0)), False)
        if self.config.carry:
            self._perturbed = past_of(perturbed.cache)
        return self._finish(state, plain.replace(logits=self._fuse(plain.logits, perturbed.logits)))

    def _lean_step(self, inner: Step, state: StepState, past_len: int, optimise: bool) -> StepOutput:
        """The passes from the past as tensors, through the runner (see chatcore.pplm.runner),
        with the deltas kept as low-rank factors (:class:`chatcore.pplm.runner.LowRankDeltas`).

        When the perturbation starts from the plain past with every row writing, the plain
        pass *is* the first iteration's forward (its deltas are zero): one pass fewer.
        """
        runner = self.runner
        fed = self._fed(state)
        wants_hidden = state.output_hidden_states or self.attribute.needs_hidden
        prompt_step = state.input_ids.size(1) > 1

        starts: dict[int, Start] = {}  # per fed-token tensor: what no delta changes
        first_layer = self.config.first_perturbed_layer(len(runner.layers))

        def forward(
            sub_state: StepState,
            sub_base: Past,
            deltas: LowRankDeltas | None,
            probes: tuple[torch.Tensor, torch.Tensor] | None,
            hidden: bool,
        ) -> RunOutput:
            self.summary["runner_passes"] += 1
            key = id(sub_state.input_ids)
            output = runner.forward(
                sub_base,
                sub_state.position_ids,
                input_ids=sub_state.input_ids,
                key_mask=key_mask_of(sub_state.attention_mask),
                deltas=deltas,
                probes=probes,
                hidden_states=hidden,
                start=starts.get(key),
                from_layer=first_layer,
            )
            assert output.start is not None
            starts[key] = output.start
            return output

        plain: StepOutput | None = None
        if prompt_step:  # the whole prompt, through the model as the decoder would run it
            plain = self._plain_pass(inner, state)
            plain_past = past_of(plain.cache, past_len)
        else:
            plain_past = past_of(state.cache)
        base = self._perturbed_base(past_len) if self._perturbed is not None else plain_past

        def plain_output(first: RunOutput) -> StepOutput:
            """The plain pass's output: the decoder's cache advanced by the fed token."""
            for index, (keys, values) in enumerate(first.new):
                state.cache.update(keys.detach(), values.detach(), index)
            hidden = None
            if first.hidden_states is not None:
                hidden = tuple(h.detach() for h in first.hidden_states)
            return StepOutput(logits=first.logits.detach(), cache=state.cache, hidden_states=hidden)

        merge = (
            optimise
            and plain is None
            and self._perturbed is None
            and not self.attribute.needs_hidden
            and bool(self.active_rows(fed).all())
        )
        if plain is None and not merge:
            with torch.no_grad():
                plain = plain_output(forward(state, plain_past, None, None, wants_hidden))
        deltas: LowRankDeltas | None = None
        rows: torch.Tensor | None = None
        if optimise:

            def context(rows: torch.Tensor | None) -> dict[str, Any]:
                assert plain is not None
                return self._hidden_context(past_of(plain.cache), rows)

            deltas, rows, first = self._optimise_lean(
                forward, fed, base, plain, context, first_hidden=state.output_hidden_states
            )
            if plain is None:
                assert first is not None
                plain = plain_output(first)
        assert plain is not None
        if deltas is None and self._perturbed is None:
            return self._finish(state, plain)
        with torch.no_grad():
            full = deltas
            if deltas is not None and rows is not None:  # finished rows: zero deltas
                full = deltas.expand_rows(rows, fed.input_ids.size(0))
            perturbed = forward(fed, base, full, None, False)
            if self.config.carry:
                if not isinstance(self._perturbed, GrowingPast):
                    capacity = past_len + 1 + max(self.max_new_tokens - state.step, 1)
                    self._perturbed = GrowingPast(base, capacity)
                if deltas is not None and rows is None:
                    self._perturbed.add_recent_products(
                        deltas.key_a, deltas.key_b, deltas.value_a, deltas.value_b, first_layer
                    )
                elif deltas is not None:
                    self._perturbed.add_recent(deltas.dense(), rows, first_layer)
                self._perturbed.append(perturbed.new)
        return self._finish(state, plain.replace(logits=self._fuse(plain.logits, perturbed.logits)))

    def _fuse(self, plain_logits: torch.Tensor, perturbed_logits: torch.Tensor) -> torch.Tensor:
        plain_log_probs = torch.log_softmax(plain_logits.float(), dim=-1)
        perturbed_log_probs = torch.log_softmax(perturbed_logits.float(), dim=-1)
        return fuse(plain_logits, plain_log_probs, perturbed_log_probs, self.config.gm_scale)

    def _plain_pass(self, inner: Step, state: StepState) -> StepOutput:
        with torch.no_grad():
            wants_hidden = state.output_hidden_states or self.attribute.needs_hidden
            return self._call(inner, state.replace(output_hidden_states=wants_hidden))

    def _finish(self, state: StepState, plain: StepOutput) -> StepOutput:
        """Note the plain hidden state for the discriminator; return what the caller asked for."""
        self._note_hidden(plain)
        return plain if state.output_hidden_states else plain.replace(hidden_states=None)

    def _call(self, inner: Step, state: StepState) -> StepOutput:
        self.summary["inner_calls"] += 1
        return inner(state)

    def active_rows(self, fed: StepState) -> torch.Tensor:
        """(B,) bool: rows still writing their reply (a fed EOS after the prompt ends one)."""
        if fed.step == 0:
            return torch.ones(fed.input_ids.size(0), dtype=torch.bool, device=fed.input_ids.device)
        return fed.input_ids[:, -1] != self.eos_token_id

    # -- the gradient iterations -----------------------------------------------------------------
    def _rows_and_window(
        self,
        fed: StepState,
        base: Past,
        plain: StepOutput | None,
        context: Callable[[torch.Tensor | None], dict[str, Any]],
    ) -> "_Setup | None":
        """What the iterations of this step share, for the rows still writing (None if none is)."""
        config = self.config
        self.batch_size = fed.input_ids.size(0)
        active = self.active_rows(fed)
        if not bool(active.any()):
            return None
        rows = None if bool(active.all()) else active.nonzero().squeeze(1)
        assert plain is not None or rows is None, "the plain pass doubles as the first iteration only for all rows"
        sub_state, sub_base = fed, base
        if rows is not None:
            sub_state = _select_state(fed, rows)
            sub_base = select_rows(base, rows)
        length = past_length(sub_base)
        window = length if config.window_length == 0 else min(config.window_length, length)
        reference = None
        if plain is not None:
            reference = torch.log_softmax(plain.logits.float(), dim=-1)
            reference = reference if rows is None else reference[rows]
        record = None
        if self.trace is not None:
            record = {
                "step": fed.step,
                "past_length": length,
                "window": window,
                "attribute": [],
                "kl": [],
                "grad_norm": [],
            }
            self.trace.append(record)
        return _Setup(
            rows=rows,
            state=sub_state,
            base=sub_base,
            window=window,
            first_layer=self.config.first_perturbed_layer(len(base)),
            weights=window_weights(window, True, fed.input_ids.device) if config.decay else None,
            targets=self.attribute.step_targets(sub_state.sequences, fed.prompt_length),
            reference=reference,
            hidden_context=context(rows) if self.attribute.needs_hidden else None,
            record=record,
        )

    def _loss(self, setup: "_Setup", log_probs: torch.Tensor, output: Any) -> torch.Tensor:
        """Attribute loss + kl_scale * KL, summed over rows (they are independent)."""
        mean_hidden = None
        if setup.hidden_context is not None:
            mean_hidden = self._mean_hidden(output, log_probs, setup.state, setup.hidden_context)
        attribute_loss = self.attribute.loss(AttributeInputs(log_probs, mean_hidden, setup.targets))  # (b,)
        assert setup.reference is not None
        kl = kl_divergence(log_probs, setup.reference)  # (b,)
        if setup.record is not None:
            setup.record["attribute"].append(attribute_loss.detach().tolist())
            setup.record["kl"].append(kl.detach().tolist())
        return (attribute_loss + self.config.kl_scale * kl).sum()

    def _optimise(
        self,
        forward: Forward,
        fed: StepState,
        base: Past,
        plain: StepOutput,
        context: Callable[[torch.Tensor | None], dict[str, Any]],
    ) -> torch.Tensor | None:
        """The final dense deltas of every row, (2 * perturbed layers, B, H, W, D) with zeros
        for finished rows, or None if all have finished."""
        setup = self._rows_and_window(fed, base, plain, context)
        if setup is None:
            return None
        keys = setup.base[0][0]
        # One leaf for all perturbed layers' key and value deltas: one gradient tensor, one update.
        layers = len(setup.base) - setup.first_layer
        delta = torch.zeros(
            (2 * layers, keys.size(0), keys.size(1), setup.window, keys.size(3)),
            dtype=torch.float32,
            device=keys.device,
            requires_grad=True,
        )
        weights = None if setup.weights is None else setup.weights.view(1, 1, 1, -1, 1)
        for _ in range(self.config.num_iterations):
            with torch.enable_grad():
                output = forward(setup.state, setup.base, list(delta.unbind(0)), self.attribute.needs_hidden)
                loss = self._loss(setup, torch.log_softmax(output.logits.float(), dim=-1), output)
                (grad,) = torch.autograd.grad(loss, delta)
            norms = self._step_deltas(delta, grad, weights, setup.rows)
            if setup.record is not None:
                setup.record["grad_norm"].append(norms.tolist())
        self.summary["optimised_steps"] += 1
        final = delta.detach()
        if setup.rows is None:
            return final
        full = final.new_zeros((final.size(0), self.batch_size, *final.shape[2:]))
        return full.index_copy_(1, setup.rows, final)

    @torch.no_grad()
    def _step_deltas(
        self, delta: torch.Tensor, grad: torch.Tensor, weights: torch.Tensor | None, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """delta -= step * w * g / n ** gamma, per row and layer; returns the (b,) mean of n.

        n is the largest norm of w * g seen so far in this reply (per row and layer, keys
        and values together), as the paper's code does for bags of words: once the loss
        saturates its gradient is tiny, and dividing by that norm ** 1.5 would make huge steps.
        """
        config = self.config
        if weights is not None:
            grad = grad * weights
        layers = grad.size(0) // 2
        squares = grad.square().sum((2, 3, 4))  # (2 * layers, b)
        norms = squares.view(layers, 2, -1).sum(1).sqrt().t() + NORM_EPSILON  # (b, layers)
        norms = self._running_norm_max(norms, rows)
        scales = (config.step_size(layers) / norms.pow(config.gamma)).t().repeat_interleave(2, dim=0)  # (2 * layers, b)
        delta.sub_(grad * scales.view(*scales.shape, 1, 1, 1))
        return norms.mean(1)

    def _optimise_lean(
        self,
        forward: Callable[..., RunOutput],
        fed: StepState,
        base: Past,
        plain: StepOutput | None,
        context: Callable[[torch.Tensor | None], dict[str, Any]],
        first_hidden: bool = False,
    ) -> tuple[LowRankDeltas | None, torch.Tensor | None, RunOutput | None]:
        """As :meth:`_optimise`, with low-rank deltas: returns the final deltas of the rows
        still writing (None if none is), those rows (None: all), and the first iteration's
        pass when ``plain`` is None (then that pass, from zero deltas, is the plain pass)."""
        setup = self._rows_and_window(fed, base, plain, context)
        if setup is None:
            return None, None, None
        keys = setup.base[0][0]
        layers, batch, heads, head_dim = len(setup.base) - setup.first_layer, keys.size(0), keys.size(1), keys.size(3)
        group = self.runner.group
        needs_hidden = self.attribute.needs_hidden
        deltas: LowRankDeltas | None = None
        first: RunOutput | None = None
        for iteration in range(self.config.num_iterations):
            with torch.enable_grad():
                probes = (
                    keys.new_zeros((layers, batch, heads, group, setup.window), requires_grad=True),
                    keys.new_zeros((layers, batch, heads, group, head_dim), requires_grad=True),
                )
                output = forward(
                    setup.state, setup.base, deltas, probes, needs_hidden or (first_hidden and iteration == 0)
                )
                log_probs = torch.log_softmax(output.logits.float(), dim=-1)  # (b, V)
                if setup.reference is None:  # this pass is the plain one
                    first, setup.reference = output, log_probs.detach()
                score_grad, output_grad = torch.autograd.grad(self._loss(setup, log_probs, output), probes)
            assert output.queries is not None and output.window_probs is not None
            deltas, norms = self._step_low_rank(
                deltas,
                score_grad.float(),
                output.queries.float(),
                output.window_probs.float(),
                output_grad.float(),
                setup.weights,
                setup.rows,
            )
            if setup.record is not None:
                setup.record["grad_norm"].append(norms.tolist())
        self.summary["optimised_steps"] += 1
        return deltas, setup.rows, first

    @torch.no_grad()
    def _step_low_rank(
        self,
        deltas: LowRankDeltas | None,
        score_grad: torch.Tensor,
        queries: torch.Tensor,
        window_probs: torch.Tensor,
        output_grad: torch.Tensor,
        weights: torch.Tensor | None,
        rows: torch.Tensor | None,
    ) -> tuple[LowRankDeltas, torch.Tensor]:
        """The step of :meth:`_step_deltas` on low-rank deltas; returns them and the (b,) mean of n.

        Per layer, row and key/value head the key deltas' gradient is score_grad^T @ query,
        (W, G) @ (G, D), a sum over the G query heads reading that key/value head, and the
        value deltas' gradient is window_probs^T @ output_grad. The squared norm of a
        product A^T B is sum((A A^T) * (B B^T)) (G x G matrices), so the norm of w * g
        needs no (W, D) tensor, and the step adds G outer products.
        Shapes: (layers, b, H_kv, G, W) and (layers, b, H_kv, G, D).
        """
        config = self.config
        if weights is not None:
            score_grad, window_probs = score_grad * weights, window_probs * weights

        def squared_norm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return ((a @ a.transpose(-1, -2)) * (b @ b.transpose(-1, -2))).sum((-1, -2))  # (layers, b, H_kv)

        squares = (squared_norm(score_grad, queries) + squared_norm(window_probs, output_grad)).sum(-1)  # (layers, b)
        norms = self._running_norm_max(squares.sqrt().t() + NORM_EPSILON, rows)  # (b, layers)
        scales = (-config.step_size(norms.size(1)) / norms.pow(config.gamma)).t()[:, :, None, None, None]
        step = (
            (score_grad * scales).transpose(-1, -2),
            queries,
            (window_probs * scales).transpose(-1, -2),
            output_grad,
        )
        deltas = LowRankDeltas(*step) if deltas is None else deltas.plus(*step)
        return deltas, norms.mean(1)

    def _running_norm_max(self, norms: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """(b, layers) norms -> the largest seen so far in the reply, per row and layer."""
        if self.grad_norm_max is None:
            self.grad_norm_max = torch.zeros((self.batch_size, norms.size(1)), device=norms.device)
        if rows is None:
            norms = torch.maximum(norms, self.grad_norm_max)
            self.grad_norm_max = norms
        else:
            norms = torch.maximum(norms, self.grad_norm_max[rows])
            self.grad_norm_max[rows] = norms
        return norms

    # -- the discriminator's mean hidden state ---------------------------------------------------
    def _note_hidden(self, plain: StepOutput) -> None:
        """Add the plain pass's hidden state of the fed token to the reply's running sum."""
        if not self.attribute.needs_hidden:
            return
        assert plain.hidden_states is not None, "the inner step did not return hidden states"
        hidden = plain.hidden_states[self.attribute.layer][:, -1].float()  # (B, C)
        self.hidden_sum = hidden if self.hidden_sum is None else self.hidden_sum + hidden
        self.hidden_count += 1

    def _hidden_context(self, past: Past, rows: torch.Tensor | None) -> dict[str, Any]:
        """``past``: the plain past including the fed token (the horizon starts there)."""
        previous = self.hidden_sum
        if rows is not None:
            past = select_rows(past, rows)
            previous = previous[rows] if previous is not None else None
        return {"past": past, "previous": previous, "count": self.hidden_count}

    def _mean_hidden(
        self, output: Pass, log_probs: torch.Tensor, fed: StepState, context: dict[str, Any]
    ) -> torch.Tensor:
        """(b, C) mean over the reply's earlier positions (plain), the fed token (perturbed)
        and ``horizon_length`` soft tokens: expected embeddings under the predicted
        distribution, run from the plain past (gradients reach the deltas through them)."""
        assert output.hidden_states is not None
        layer = self.attribute.layer
        total = output.hidden_states[layer][:, -1].float()
        if context["previous"] is not None:
            total = total + context["previous"]
        horizon = self.config.horizon_length
        if horizon:
            embeddings = self.model.get_input_embeddings().weight.detach()  # (V', C)
            vocab = min(embeddings.size(0), log_probs.size(-1))
            probs = log_probs[:, :vocab].exp()
            mask, position = fed.attention_mask, fed.position_ids[:, -1:]
            past: Past = context["past"]
            cache = None if output.new is not None else fresh_cache(past, self.model_config)
            for index in range(horizon):
                soft = (probs.to(embeddings.dtype) @ embeddings[:vocab]).unsqueeze(1)  # (b, 1, C)
                mask = torch.cat([mask, mask.new_ones((mask.size(0), 1))], dim=1)
                position = position + 1
                if cache is None:  # the runner, as for the other passes
                    self.summary["runner_passes"] += 1
                    future = self.runner.forward(
                        past, position, inputs_embeds=soft, key_mask=key_mask_of(mask), hidden_states=True
                    )
                    hidden, logits = future.hidden_states[layer][:, -1], future.logits
                    if index + 1 < horizon:
                        past = [
                            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                            for (k, v), (nk, nv) in zip(past, future.new)
                        ]
                else:
                    out = self.model(
                        inputs_embeds=soft,
                        **{cache_keyword(self.model): cache},
                        attention_mask=mask,
                        position_ids=position,
                        use_cache=True,
                        output_hidden_states=True,
                        logits_to_keep=1,
                    )
                    hidden, logits, cache = out.hidden_states[layer][:, -1], out.logits[:, -1], output_cache(out)
                total = total + hidden.float()
                probs = torch.softmax(logits[:, :vocab].float(), dim=-1)
        return total / (context["count"] + 1 + horizon)
