"""The PPLM perturbation, one decoding step at a time, on transformers' caches.

For every new token the wrapped step does (B rows at once; x = the token fed now):

1. the **plain pass**: the inner step on x with the decoder's cache, exactly as without
   PPLM. Its cache is what the step returns, so the conversation's history is never
   rewritten, and its next-token distribution p is the reference for the KL term and
   the fusion;
2. the **perturbation**: per-layer key/value deltas (leaf tensors, zeros) over the most
   recent ``window_length`` positions of the *perturbed past*; ``num_iterations`` times:
   build a fresh cache from past + deltas, run the inner step on x, take
   loss = attribute loss + kl_scale * KL(p~ || p) per row, differentiate with
   ``torch.autograd.grad`` w.r.t. the deltas only, and step
   ``delta -= stepsize * w * g / n ** gamma``, with ``w`` the window's (decay) weights and
   ``n`` the largest norm of ``w * g`` so far in the reply, per row and layer (keys and
   values together);
3. the **perturbed pass**: the inner step on x from past + final deltas; its cache, with
   the deltas baked in, is the perturbed past of the next step;
4. the **fusion**: scores = plain logits + gm_scale * (log p~ - log p), i.e. the
   geometric mixture p~^gm * p^(1-gm) as unnormalised log-probabilities. A zero
   perturbation gives back the plain logits bit for bit.

Two pasts advance one token per step, as in the paper's code: the decoder's (plain) and
the perturbed one, which carries every earlier step's perturbation. Nothing re-runs the
whole sequence: an optimised step costs num_iterations + 2 one-token forwards and
num_iterations one-token backwards; after ``grad_length`` tokens (or between ``steer_every`` steps) it costs the
plain and the perturbed forward only. Until the first perturbation the perturbed past
*is* the plain one and no second cache is kept.

The first reply token is steered too: at the prompt step the plain pass runs on the whole
prompt as usual, and the perturbation treats the prompt's last token as x and the rest
of that pass's cache as the past.

Rows that have finished (their fed token is EOS) are left out of the optimisation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from chatcore.pplm.attribute import AttributeInputs, AttributeModel
from chatcore.pplm.config import PerturbConfig
from chatcore.pplm.kv import Past, fresh_cache, normal, past_length, past_of, select_rows
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


def apply_deltas(past: Past, deltas: list[torch.Tensor] | None) -> Past:
    """``past`` with ``deltas`` (keys and values of each layer in turn, each (B, H, W, D))
    added to its most recent W positions."""
    if deltas is None:
        return past
    out: Past = []
    for index, (keys, values) in enumerate(past):
        out.append((_add_recent(keys, deltas[2 * index]), _add_recent(values, deltas[2 * index + 1])))
    return out


def _add_recent(tensor: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    length, window = tensor.size(2), delta.size(2)
    assert window <= length, (window, length)
    if window == length:
        return tensor + delta.to(tensor.dtype)
    return torch.cat([tensor[:, :, : length - window], tensor[:, :, length - window :] + delta.to(tensor.dtype)], dim=2)


def _select_state(state: StepState, rows: torch.Tensor) -> StepState:
    return state.replace(input_ids=state.input_ids[rows], sequences=state.sequences[rows],
                         attention_mask=state.attention_mask[rows], position_ids=state.position_ids[rows])


def kl_divergence(log_probs: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """(B,) KL(p || q) from log-probabilities (B, V); 0 when the two are equal."""
    log_p = log_probs.clamp(min=MIN_LOG_PROB)
    log_q = reference_log_probs.clamp(min=MIN_LOG_PROB)
    return (log_probs.exp() * (log_p - log_q)).sum(-1)


def fuse(logits: torch.Tensor, plain_log_probs: torch.Tensor, perturbed_log_probs: torch.Tensor,
         gm_scale: float) -> torch.Tensor:
    """Scores whose softmax is p~^gm * p^(1-gm) (normalised): the plain ``logits`` shifted by
    gm * (log p~ - log p). Tokens the plain pass rules out (-inf) stay ruled out."""
    if gm_scale == 0.0:
        return logits
    shift = gm_scale * (perturbed_log_probs - plain_log_probs)
    shift = torch.where(torch.isfinite(plain_log_probs), shift, torch.zeros_like(shift))
    return logits + shift


class Perturbation:
    """PPLM's state for one response, and the wrapped step (see the module docstring).

    ``trace``: set to a list to record, for every optimised step, the attribute losses,
    KL terms and gradient norms of each iteration (costs a device sync; for tests and
    tuning, off by default).
    """

    def __init__(self, config: PerturbConfig, attribute: AttributeModel, model: Any, eos_token_id: int) -> None:
        self.config = config
        self.attribute = attribute
        self.model = model
        self.model_config = getattr(model, "config", None)
        self.eos_token_id = eos_token_id
        self.trace: list[dict[str, Any]] | None = None
        self.batch_size = 0
        # Updated in place: the steerer hands this dict to the response's provenance.
        self.summary: dict[str, Any] = {"attribute": attribute.describe(), "optimised_steps": 0, "inner_calls": 0}
        self.reset()

    def reset(self) -> None:
        self.perturbed_past: Past | None = None  # None while it equals the plain past
        self.hidden_sum: torch.Tensor | None = None  # (B, C) plain hidden states of the reply so far
        self.hidden_count = 0
        self.grad_norm_max: torch.Tensor | None = None  # (B, layers) largest gradient norm so far

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
        state = state.replace(input_ids=normal(state.input_ids), sequences=normal(state.sequences),
                              attention_mask=normal(state.attention_mask), position_ids=normal(state.position_ids))
        past_len = state.sequences.size(1) - 1
        optimise = self.config.optimises(state.step) and past_len >= 1
        plain = self._plain_pass(inner, state)
        if past_len < 1 or (self.perturbed_past is None and not optimise):
            return self._finish(state, plain)

        fed = state
        if state.input_ids.size(1) > 1:  # the prompt step: x is the prompt's last token
            fed = state.replace(input_ids=state.input_ids[:, -1:], position_ids=state.position_ids[:, -1:])
        base = self.perturbed_past if self.perturbed_past is not None else past_of(plain.cache, past_len)
        deltas = self._optimise(inner, fed, base, plain) if optimise else None
        if deltas is None and self.perturbed_past is None:
            return self._finish(state, plain)
        with torch.no_grad():
            cache = fresh_cache(apply_deltas(base, deltas), self.model_config)
            perturbed = self._call(inner, fed.replace(cache=cache, output_hidden_states=False))
        if self.config.carry:
            self.perturbed_past = past_of(perturbed.cache)
        plain_log_probs = torch.log_softmax(plain.logits.float(), dim=-1)
        perturbed_log_probs = torch.log_softmax(perturbed.logits.float(), dim=-1)
        fused = fuse(plain.logits, plain_log_probs, perturbed_log_probs, self.config.gm_scale)
        return self._finish(state, plain.replace(logits=fused))

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
    def _optimise(self, inner: Step, fed: StepState, base: Past, plain: StepOutput) -> list[torch.Tensor] | None:
        """The final deltas of every row (zeros for finished rows), or None if all have finished."""
        config = self.config
        batch_size = self.batch_size = fed.input_ids.size(0)
        active = self.active_rows(fed)
        if not bool(active.any()):
            return None
        rows = None if bool(active.all()) else active.nonzero().squeeze(1)
        sub_state, sub_base = fed, base
        if rows is not None:
            sub_state = _select_state(fed, rows)
            sub_base = select_rows(base, rows)
        length = past_length(sub_base)
        window = length if config.window_length == 0 else min(config.window_length, length)
        weights = window_weights(window, config.decay, fed.input_ids.device).view(1, 1, window, 1)
        targets = self.attribute.step_targets(sub_state.sequences, fed.prompt_length)
        needs_hidden = self.attribute.needs_hidden

        deltas = []
        for keys, values in sub_base:
            for tensor in (keys, values):
                batch, heads, _, head_dim = tensor.shape
                deltas.append(torch.zeros((batch, heads, window, head_dim), dtype=torch.float32,
                                          device=tensor.device, requires_grad=True))
        record: dict[str, Any] | None = None
        if self.trace is not None:
            record = {"step": fed.step, "past_length": length, "window": window, "attribute": [], "kl": [],
                      "grad_norm": []}
            self.trace.append(record)
        reference = torch.log_softmax(plain.logits.float(), dim=-1)
        reference = reference if rows is None else reference[rows]
        hidden_context = self._hidden_context(plain, rows) if needs_hidden else None
        for _ in range(config.num_iterations):
            with torch.enable_grad():
                cache = fresh_cache(apply_deltas(sub_base, deltas), self.model_config)
                output = self._call(inner, sub_state.replace(cache=cache, output_hidden_states=needs_hidden))
                log_probs = torch.log_softmax(output.logits.float(), dim=-1)  # (b, V)
                mean_hidden = None
                if hidden_context is not None:
                    mean_hidden = self._mean_hidden(output, log_probs, sub_state, hidden_context)
                attribute_loss = self.attribute.loss(AttributeInputs(log_probs, mean_hidden, targets))  # (b,)
                kl = kl_divergence(log_probs, reference)  # (b,)
                loss = (attribute_loss + config.kl_scale * kl).sum()  # rows are independent: sum
                grads = torch.autograd.grad(loss, deltas)
            norms = self._step_deltas(deltas, grads, weights, rows)
            if record is not None:
                record["attribute"].append(attribute_loss.detach().tolist())
                record["kl"].append(kl.detach().tolist())
                record["grad_norm"].append(norms.tolist())
        self.summary["optimised_steps"] += 1
        final = [delta.detach() for delta in deltas]
        if rows is None:
            return final
        full = []
        for delta in final:
            expanded = torch.zeros((batch_size, *delta.shape[1:]), dtype=delta.dtype, device=delta.device)
            full.append(expanded.index_copy_(0, rows, delta))
        return full

    @torch.no_grad()
    def _step_deltas(self, deltas: list[torch.Tensor], grads: tuple[torch.Tensor, ...], weights: torch.Tensor,
                     rows: torch.Tensor | None) -> torch.Tensor:
        """delta -= stepsize * w * g / n ** gamma, per row and layer; returns the (b,) mean of n.

        n is the largest norm of w * g seen so far in this reply (per row and layer), as
        the paper's code does for bags of words: once the loss saturates its gradient is
        tiny, and dividing by that norm ** 1.5 would make huge steps.
        """
        config = self.config
        norms = torch.stack([
            (grads[index].mul(weights).square().sum((1, 2, 3))
             + grads[index + 1].mul(weights).square().sum((1, 2, 3))).sqrt()
            for index in range(0, len(deltas), 2)
        ], dim=1) + NORM_EPSILON  # (b, layers)
        if self.grad_norm_max is None:
            self.grad_norm_max = torch.zeros((self.batch_size, norms.size(1)), device=norms.device)
        if rows is None:
            norms = torch.maximum(norms, self.grad_norm_max)
            self.grad_norm_max = norms
        else:
            norms = torch.maximum(norms, self.grad_norm_max[rows])
            self.grad_norm_max[rows] = norms
        scales = config.stepsize / norms.pow(config.gamma)  # (b, layers)
        for layer in range(norms.size(1)):
            scale = scales[:, layer].view(-1, 1, 1, 1) * weights
            deltas[2 * layer].sub_(scale * grads[2 * layer])
            deltas[2 * layer + 1].sub_(scale * grads[2 * layer + 1])
        return norms.mean(1)

    # -- the discriminator's mean hidden state ---------------------------------------------------
    def _note_hidden(self, plain: StepOutput) -> None:
        """Add the plain pass's hidden state of the fed token to the reply's running sum."""
        if not self.attribute.needs_hidden:
            return
        assert plain.hidden_states is not None, "the inner step did not return hidden states"
        hidden = plain.hidden_states[self.attribute.layer][:, -1].float()  # (B, C)
        self.hidden_sum = hidden if self.hidden_sum is None else self.hidden_sum + hidden
        self.hidden_count += 1

    def _hidden_context(self, plain: StepOutput, rows: torch.Tensor | None) -> dict[str, Any]:
        past = past_of(plain.cache)  # the plain past including the fed token: the horizon starts there
        previous = self.hidden_sum
        if rows is not None:
            past = select_rows(past, rows)
            previous = previous[rows] if previous is not None else None
        return {"past": past, "previous": previous, "count": self.hidden_count}

    def _mean_hidden(self, output: StepOutput, log_probs: torch.Tensor, fed: StepState,
                     context: dict[str, Any]) -> torch.Tensor:
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
            cache = fresh_cache(context["past"], self.model_config)
            mask, position = fed.attention_mask, fed.position_ids[:, -1:]
            for _ in range(horizon):
                soft = (probs.to(embeddings.dtype) @ embeddings[:vocab]).unsqueeze(1)  # (b, 1, C)
                mask = torch.cat([mask, mask.new_ones((mask.size(0), 1))], dim=1)
                position = position + 1
                future = self.model(inputs_embeds=soft, past_key_values=cache, attention_mask=mask,
                                    position_ids=position, use_cache=True, output_hidden_states=True,
                                    logits_to_keep=1)
                total = total + future.hidden_states[layer][:, -1].float()
                probs = torch.softmax(future.logits[:, -1, :vocab].float(), dim=-1)
                cache = future.past_key_values
        return total / (context["count"] + 1 + horizon)
