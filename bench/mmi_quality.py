"""MMI reranking quality: ``mmi`` vs ``top-k`` on the same held-out chitchat contexts.

    python bench/mmi_quality.py [--limit 100] [--candidates 8] [--max-new-tokens 40] [--json out.json]
    python bench/mmi_quality.py --model smollm2 --judge chatcore-tiny-reverse --threads 1

``--model`` is any model chatcore loads (a chat-template model too: the reverse model
reads plain turns, see docs/mmi.md) and ``--reverse-model`` a reverse model with the
same tokenizer or another one (replies are then re-encoded from their text); ``auto``, the
default, is the bundled one on the model's tokenizer, as the decoder picks it.

Runs chatcore's eval harness (chatcore.evaluation.runner.evaluate, what ``chatcore
eval`` runs) for ``top-k``, ``top-k`` with the 3-gram blocking ``mmi`` samples its
candidates with, and ``mmi``, with the same contexts and seeds, and adds one column:
the mean reverse score, log P(source | reply) under the reverse model, of the replies
each configuration gave (and of the human replies). Every reply is scored the same
way, from its text, whichever decoder made it. MMI should raise the reverse score
without raising the share of degenerate replies. The seconds per reply of each
configuration, and their ratio to plain top-k, are the cost of reranking.

The reverse model that reranks also scores, so its column favours MMI by construction.
``--judge`` names a second reverse model (trained apart: another size, tokenizer or run)
that scores every reply too, in a column of its own: a gain there is not the reranker
grading itself. ``--sampling model`` samples at the model's own defaults (its
generation config or chatcore's table of known models) instead of top-k 40 at T=0.8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--reverse-model", default="auto")
    parser.add_argument("--judge", default=None, help="a second reverse model that scores every reply")
    parser.add_argument("--sampling", choices=("chatcore", "model"), default="chatcore")
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
    reverse_name = args.reverse_model
    if reverse_name == "auto":
        reverse_name = reranking.matching_reverse_model(engine.tokenizer) or "chatcore-tiny-reverse"
    reverse = reranking.load_reverse_model(reverse_name, device=engine.loaded.device)
    judges = {"reverse": reverse}
    if args.judge:
        judges["judge"] = reranking.load_reverse_model(args.judge, device=engine.loaded.device)
    contexts = engine.registry.prompt_set(args.prompts)()[: args.limit]
    sampling = {"top_k": 40, "temperature": 0.8} if args.sampling == "chatcore" else {}
    mmi_settings = {
        **sampling,
        "candidates": args.candidates,
        "reverse_model": reverse_name,
        "allow_retokenize": True,
        **parse_key_values(args.mmi_settings.split()),
    }
    unnamed = {*sampling, "reverse_model", "allow_retokenize"}
    mmi_label = " ".join(["mmi"] + [f"{k}={v}" for k, v in mmi_settings.items() if k not in unnamed])
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

    def reverse_score_list(pairs: list[tuple[list[str], str]], scorer: Any = reverse) -> list[float]:
        """log P(last context turn | reply) of each pair, each reply scored from its text."""
        tokenizer = scorer.tokenizer
        scores = []
        for context, reply in pairs:
            candidate = encode_text(tokenizer, reply)
            source = [encode_text(tokenizer, context[-1])]
            scores.append(reranking.reverse_scores(scorer, [candidate], source)[0].total)
        return scores

    per_context: dict[str, dict[str, dict[int, float]]] = {column: {} for column in judges}
    seconds: dict[str, float] = {}

    print(
        f"{len(contexts)} contexts from {args.prompts}, model {args.model}, reverse {reverse_name}, "
        f"judge {args.judge or 'none'}, sampling {sampling or 'the model defaults'}, "
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
        for column, scorer in judges.items():
            scores = reverse_score_list([(s["context"], s["reply"]) for _, s in replied], scorer)
            per_context[column][label] = {i: score for (i, _), score in zip(replied, scores)}
            report.rows[0].extra[column] = statistics.mean(scores)
            if len(report.rows) > 1:  # the human replies, once
                human = [(c.turns, c.reference) for c in contexts if c.reference]
                report.rows[1].extra[column] = statistics.mean(reverse_score_list(human, scorer))
        rows.extend(report.rows)
    print(EvalReport(rows, [], {}).table())
    print(
        f"reverse: mean log P(source | reply) under the reranking model {reverse_name}"
        + (f"; judge: the same under {args.judge}" if args.judge else "")
        + " (higher: the reply is more specific to the context)"
    )
    for column, by_label in per_context.items():
        shared = sorted(set(by_label["top-k"]) & set(by_label[mmi_label]))
        if len(shared) > 1:
            gains = [by_label[mmi_label][i] - by_label["top-k"][i] for i in shared]
            error = statistics.stdev(gains) / len(gains) ** 0.5
            print(
                f"{mmi_label} vs top-k, same contexts and seeds: {column} score {statistics.mean(gains):+.2f} nats "
                f"per context (standard error {error:.2f}), higher in {sum(g > 0 for g in gains)} of "
                f"{len(gains)} contexts"
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
