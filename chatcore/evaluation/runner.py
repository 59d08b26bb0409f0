"""Running a decoder + steerer configuration over a prompt set and measuring it."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from chatcore.evaluation.metrics import contains_any, distinct_n, is_degenerate, words
from chatcore.evaluation.prompts import EvalContext

if TYPE_CHECKING:
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.serving import Scheduler


@dataclass
class EvalRow:
    label: str
    count: int
    perplexity: float | None
    distinct_1: float
    distinct_2: float
    distinct_3: float
    mean_length: float
    degenerate_share: float
    attribute_share: float | None = None
    tokens_per_s: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class EvalReport:
    rows: list[EvalRow]
    samples: list[dict[str, Any]]
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "rows": [asdict(r) for r in self.rows], "samples": self.samples}

    def table(self) -> str:
        headers = ["", "n", "ppl", "dist-1", "dist-2", "dist-3", "len", "degen", "attr", "tok/s"]
        lines = []
        for row in self.rows:
            lines.append(
                [
                    row.label,
                    str(row.count),
                    f"{row.perplexity:.1f}" if row.perplexity is not None else "-",
                    f"{row.distinct_1:.3f}",
                    f"{row.distinct_2:.3f}",
                    f"{row.distinct_3:.3f}",
                    f"{row.mean_length:.1f}",
                    f"{row.degenerate_share:.1%}",
                    f"{row.attribute_share:.1%}" if row.attribute_share is not None else "-",
                    f"{row.tokens_per_s:.0f}" if row.tokens_per_s is not None else "-",
                ]
            )
            for key, value in row.extra.items():
                if key not in headers:
                    headers.append(key)
                lines[-1].append(f"{value:.3f}")
        widths = [max(len(h), *(len(line[i]) if i < len(line) else 1 for line in lines)) for i, h in enumerate(headers)]
        out = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
        for line in lines:
            out.append("  ".join((c.rjust(w) if i else c.ljust(w)) for i, (c, w) in enumerate(zip(line, widths))))
        return "\n".join(out)


def reply_perplexity(
    engine: "Engine", pairs: Sequence[tuple[list[str], str]], system: str | None = None
) -> float | None:
    """exp(mean NLL per token) of each reply (and the token that ends it) given its context, in
    the engine's prompt format, under the plain model: no steering, no decoder."""
    import torch

    from chatcore.errors import ChatcoreError
    from chatcore.prompting import prompt_budget, scripted_messages
    from chatcore.text import clean_message

    model, prompt_format = engine.loaded.model, engine.prompt_format
    total_nll, total_tokens = 0.0, 0
    for context, reply in pairs:
        reply_ids = prompt_format.encode_text(reply) + [prompt_format.end_of_reply_id]
        if engine.loaded.max_positions - len(reply_ids) < 2:
            continue
        messages = scripted_messages([clean_message(turn) for turn in context], system)
        budget = prompt_budget(engine.loaded.max_positions, len(reply_ids))
        try:
            prompt = prompt_format.fit(messages, budget).token_ids
        except ChatcoreError:  # no room for this context (the reply's own failure is counted elsewhere)
            continue
        if len(prompt) + len(reply_ids) > engine.loaded.max_positions:
            continue
        ids = torch.tensor([prompt + reply_ids], device=engine.loaded.device)
        with torch.inference_mode():
            logits = (
                model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 : -1].float()
            )  # (R, V)
        targets = ids[0, len(prompt) :]
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        total_tokens += targets.numel()
    return math.exp(total_nll / total_tokens) if total_tokens else None


def summarize(
    label: str,
    replies: Sequence[str],
    perplexity: float | None,
    vocabulary: set[str] | None,
    tokens_per_s: float | None = None,
) -> EvalRow:
    return EvalRow(
        label=label,
        count=len(replies),
        perplexity=perplexity,
        distinct_1=distinct_n(replies, 1),
        distinct_2=distinct_n(replies, 2),
        distinct_3=distinct_n(replies, 3),
        mean_length=sum(len(words(r)) for r in replies) / max(1, len(replies)),
        degenerate_share=sum(is_degenerate(r) for r in replies) / max(1, len(replies)),
        attribute_share=(sum(contains_any(r, vocabulary) for r in replies) / max(1, len(replies)))
        if vocabulary is not None
        else None,
        tokens_per_s=tokens_per_s,
    )


def evaluate(
    engine: "Engine",
    contexts: Sequence[EvalContext],
    options: "ReplyOptions",
    label: str = "model",
    vocabulary: set[str] | None = None,
    seed: int = 0,
    include_reference: bool = True,
    system: str | None = None,
    scheduler: "Scheduler | None" = None,
) -> EvalReport:
    """Reply to every context (seed ``seed + i`` for the i-th) and measure the replies.

    With a ``scheduler`` (chatcore.serving), every context is submitted at once and the
    replies are decoded together; each is the same as alone (the seeds are per reply),
    and tokens per second is then the whole set's, over its wall time.
    """

    from chatcore.errors import ChatcoreError

    replies, pairs, samples = [], [], []
    new_tokens, seconds = 0, 0.0
    started_all = time.perf_counter()
    submitted: list[Any] = []
    if scheduler is not None:
        for index, context in enumerate(contexts):
            try:
                conversation = engine.scripted(context.turns, system)
                submitted.append(scheduler.respond(conversation, options.replace(seed=seed + index)))
            except ChatcoreError as error:
                submitted.append(error)
    for index, context in enumerate(contexts):
        run_options = options.replace(seed=seed + index)
        started = time.perf_counter()
        try:
            if submitted:
                if isinstance(submitted[index], ChatcoreError):
                    raise submitted[index]
                response = submitted[index]
            else:
                response = engine.reply_to(context.turns, run_options, system=system)
            text = response.text()
        except ChatcoreError as error:
            samples.append({"context": context.turns, "error": str(error)})
            continue
        seconds += time.perf_counter() - started
        new_tokens += len(response.token_ids)
        replies.append(text)
        pairs.append((context.turns, text))
        sample = {"context": context.turns, "reply": text}
        if context.reference is not None:
            sample["reference"] = context.reference
        if "candidates" in response.provenance:
            sample["candidates"] = response.provenance["candidates"]
        samples.append(sample)
    if submitted:
        seconds = time.perf_counter() - started_all
    rows = [
        summarize(
            label,
            replies,
            reply_perplexity(engine, pairs, system),
            vocabulary,
            new_tokens / seconds if seconds else None,
        )
    ]
    references = [(c.turns, c.reference) for c in contexts if c.reference]
    if include_reference and references:
        rows.append(
            summarize("human", [r for _, r in references], reply_perplexity(engine, references, system), vocabulary)
        )
    settings = {
        "model": engine.loaded.name,
        "decoder": options.decoder,
        "decoder_settings": options.decoder_settings,
        "steerers": options.steerers,
        "max_new_tokens": options.max_new_tokens,
        "seed": seed,
        "contexts": len(contexts),
        "system": system,
        "prompt_format": engine.prompt_format.name,
    }
    return EvalReport(rows, samples, settings)
