"""The prompts of replies that start at the same step, read in one forward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chatcore.models import cache_holding, output_cache

if TYPE_CHECKING:
    import torch


from chatcore.serving.jobs import Job


def packed_prompts(model: Any, cache_argument: str, jobs: list[Job]) -> tuple["torch.Tensor", list[Any]]:
    """One forward pass over the prompts of ``jobs`` (each from ``job.prefilled``, after the
    key/values in ``job.cache``): each prompt's last-token (1, V) logits, stacked (J, V), and a
    DynamicCache per job holding its whole prompt.

    The new tokens of every prompt are laid end to end as one row, after every prompt's cached
    keys; a 4-D mask lets a token attend to its own prompt's cached keys and, causally, to its
    own new tokens, and each token keeps its position in its own prompt:

        keys:   [cached 0 | cached 1 | ... | new 0 | new 1 | ...]
    """
    import torch

    from chatcore.serving.slots import CALL_COST_SCORES, CALL_COST_SCORES_GPU, packed_pass, packed_plan

    device = jobs[0].sequences.device
    cached = [[(layer.keys[:1], layer.values[:1]) for layer in job.cache.layers] if job.cache else None for job in jobs]
    past = [layers[0][0].shape[2] if layers else 0 for layers in cached]
    new = [job.prompt_length - job.prefilled for job in jobs]
    total_past, total_new = sum(past), sum(new)
    ids = torch.cat([job.sequences[0, job.prefilled : job.prompt_length] for job in jobs])[None]  # (1, T)
    positions = torch.cat([torch.arange(job.prefilled, job.prompt_length, device=device) for job in jobs])[None]
    owner = torch.repeat_interleave(torch.arange(len(jobs), device=device), torch.tensor(new, device=device))  # (T,)
    past_owner = torch.repeat_interleave(torch.arange(len(jobs), device=device), torch.tensor(past, device=device))
    key_owner = torch.cat([past_owner, owner])  # (P + T,)
    column = torch.arange(total_new, device=device)
    causal = torch.ones(total_new, total_past + total_new, dtype=torch.bool, device=device)
    causal[:, total_past:] = column[None, :] <= column[:, None]
    visible = causal & (key_owner[None, :] == owner[:, None])  # (T, P + T)
    dtype = model.dtype
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    if total_past:
        layer_count = len(next(layers for layers in cached if layers))
        joined = [
            (
                torch.cat([layers[index][0] for layers in cached if layers], dim=2),
                torch.cat([layers[index][1] for layers in cached if layers], dim=2),
            )
            for index in range(layer_count)
        ]
        cache = cache_holding(joined, model.config)
    else:
        cache = cache_holding([], model.config)
    ends = torch.tensor(new, device=device).cumsum(0) - 1
    # Long cached prefixes: each prompt's attention over its own keys only (see packed_plan).
    call_cost = CALL_COST_SCORES_GPU if device.type == "cuda" else CALL_COST_SCORES
    with torch.inference_mode(), packed_pass(model, packed_plan(past, new, call_cost)) as extra:
        output = model(
            input_ids=ids,
            attention_mask=mask[None, None],
            position_ids=positions,
            **{cache_argument: cache},
            use_cache=True,
            logits_to_keep=ends,
            **extra,
        )
    full = output_cache(output)
    caches = []
    past_start, new_start = 0, total_past
    for layers, length, count in zip(cached, past, new):
        own = []
        for index, layer in enumerate(full.layers):
            keys = layer.keys[:, :, new_start : new_start + count]
            values = layer.values[:, :, new_start : new_start + count]
            if layers:
                keys = torch.cat([layers[index][0], keys], dim=2)
                values = torch.cat([layers[index][1], values], dim=2)
            own.append((keys, values))
        caches.append(cache_holding(own, model.config))
        past_start += length
        new_start += count
    return output.logits[0].float(), caches
