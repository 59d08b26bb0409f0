"""MMI reranking quality: ``mmi`` vs ``top-k`` on the same held-out chitchat contexts.

    python bench/mmi_quality.py [--limit 100] [--candidates 8] [--max-new-tokens 40] [--json out.json]
    python bench/mmi_quality.py --model smollm2 --reverse-model /path/to/smollm2-reverse/best --threads 1

``--model`` is any model chatcore loads (a chat-template model too: the reverse model
reads plain turns, see docs/mmi.md) and ``--reverse-model`` a reverse model with the
same tokenizer or another one (replies are then re-encoded from their text).

Runs chatcore's eval harness (chatcore.evaluation.runner.evaluate, what ``chatcore
eval`` runs) for ``top-k``, ``top-k`` with the 3-gram blocking ``mmi`` samples its
candidates with, and ``mmi``, with the same contexts and seeds, and adds one column:
the mean reverse score, log P(source | reply) under the reverse model, of the replies
each configuration gave (and of the human replies). Every reply is scored the same
way, from its text, whichever decoder made it. MMI should raise the reverse score
without raising the share of degenerate replies. The seconds per reply of each
configuration, and their ratio to plain top-k, are the cost of reranking.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--reverse-model", default="chatcore-tiny-reverse")
    parser.add_argument("--prompts", default="chitchat-heldout")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=40, help="as `chatcore eval`")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mmi-settings", default="", help='more mmi settings, e.g. "no_repeat_ngram_size=0"')
    parser.add_argument("--json", dest="json_path", default=None, help="write the reports here")
    args = parser.parse_args()

    import torch

    from chatcore.engine import Engine, ReplyOptions
    from chatcore.evaluation.runner import EvalReport, evaluate
    from chatcore.options import parse_key_values
    from chatcore.plugin_manager import PluginHost
    from chatcore.plugins.mmi import reranking
    from chatcore.text import encode_text

    if args.threads:
        torch.set_num_threads(args.threads)
    host = PluginHost()
    host.load_modules(("chatcore.plugins.top_k", "chatcore.plugins.mmi.plugin", "chatcore.evaluation.commands"))
    engine = Engine(args.model, host=host)
    reverse = reranking.load_reverse_model(args.reverse_model, device=engine.loaded.device)
    contexts = engine.registry.prompt_set(args.prompts)()[: args.limit]
    sampling = {"top_k": 40, "temperature": 0.8}
    mmi_settings = {
        **sampling,
        "candidates": args.candidates,
        "reverse_model": args.reverse_model,
        **parse_key_values(args.mmi_settings.split()),
    }
    mmi_label = " ".join(
        ["mmi"] + [f"{k}={v}" for k, v in mmi_settings.items() if k not in sampling and k != "reverse_model"]
    )
    # top-k as it comes, and with the 3-gram blocking mmi samples its candidates with.
    configurations = {
        "top-k": ReplyOptions(decoder="top-k", decoder_settings=sampling, max_new_tokens=args.max_new_tokens),
        "top-k no_repeat_ngram_size=3": ReplyOptions(
            decoder="top-k",
            decoder_settings={**sampling, "no_repeat_ngram_size": 3},
            max_new_tokens=args.max_new_tokens,
        ),
        mmi_label: ReplyOptions(decoder="mmi", decoder_settings=mmi_settings, max_new_tokens=args.max_new_tokens),
    }

    def reverse_score_list(pairs: list[tuple[list[str], str]]) -> list[float]:
        """log P(last context turn | reply) of each pair, each reply scored from its text."""
        tokenizer = reverse.tokenizer
        scores = []
        for context, reply in pairs:
            candidate = encode_text(tokenizer, reply)
            source = [encode_text(tokenizer, context[-1])]
            scores.append(reranking.reverse_scores(reverse, [candidate], source)[0].total)
        return scores

    def mean_reverse_score(pairs: list[tuple[list[str], str]]) -> float:
        return statistics.mean(reverse_score_list(pairs))

    per_context: dict[str, dict[int, float]] = {}
    seconds: dict[str, float] = {}

    print(
        f"{len(contexts)} contexts from {args.prompts}, model {args.model}, reverse {args.reverse_model}, "
        f"max_new_tokens {args.max_new_tokens}, seeds {args.seed}..{args.seed + len(contexts) - 1}"
    )
    reports: dict[str, EvalReport] = {}
    rows = []
    for label, options in configurations.items():
        started = time.perf_counter()
        report = evaluate(engine, contexts, options, label=label, seed=args.seed, include_reference=not rows)
        seconds[label] = time.perf_counter() - started
        print(f"  {label}: {seconds[label]:.0f} s")
        reports[label] = report
        replied = [(i, s) for i, s in enumerate(report.samples) if "reply" in s]
        scores = reverse_score_list([(s["context"], s["reply"]) for _, s in replied])
        per_context[label] = {i: score for (i, _), score in zip(replied, scores)}
        report.rows[0].extra["reverse"] = statistics.mean(scores)
        if len(report.rows) > 1:  # the human replies, once
            human = [(c.turns, c.reference) for c in contexts if c.reference]
            report.rows[1].extra["reverse"] = mean_reverse_score(human)
        rows.extend(report.rows)
    print(EvalReport(rows, [], {}).table())
    print(
        "reverse: mean log P(source | reply) under the reverse model "
        "(higher: the reply is more specific to the context)"
    )
    shared = sorted(set(per_context["top-k"]) & set(per_context[mmi_label]))
    if len(shared) > 1:
        gains = [per_context[mmi_label][i] - per_context["top-k"][i] for i in shared]
        error = statistics.stdev(gains) / len(gains) ** 0.5
        print(
            f"{mmi_label} vs top-k, same contexts and seeds: reverse score {statistics.mean(gains):+.2f} nats per "
            f"context (standard error {error:.2f}), higher in {sum(g > 0 for g in gains)} of {len(gains)} contexts"
        )
    plain = seconds["top-k"] / max(1, len(contexts))
    for label, total in seconds.items():
        per_reply = total / max(1, len(contexts))
        print(f"cost {label}: {per_reply:.2f} s per reply, {per_reply / plain:.2f}x top-k")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=2, ensure_ascii=False)
        )


if __name__ == "__main__":
    main()
