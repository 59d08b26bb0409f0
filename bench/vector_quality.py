"""The ``vector`` steerer's effect and cost: topic or mood share and perplexity against unsteered.

    python bench/vector_quality.py [--model smollm2] [--vectors food,happy] [--strengths 4,8]
                                   [--openers 8] [--first-opener 0] [--seeds 0,100]
                                   [--max-new-tokens 32] [--json out.json]

For each vector (a built-in contrast set, ``pairs=NAME``, or a file made by ``chatcore train
vector``: ``NAME=PATH``) and each strength, replies to the first ``--openers`` of the
``openers`` prompt set, once per seed, against the unsteered replies of the same openers and
seeds, with the same decoder. Measured by chatcore.evaluation's ``evaluate``: the share of
replies on the vector's attribute, perplexity of the replies under the plain model, the
degenerate share, and tokens per second. Printed as ratios to unsteered, measured in the
same run.

``--first-opener`` and ``--openers-file`` pick a held-out set: choose the strength on one
range of openers and seeds, report on another.

The attribute of ``food`` (``sports``, any word list's name) is a word of that built-in
list; of ``happy``, more words of the built-in positive list than of the negative one (a
word count, not a trained judge).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a model name, folder or GGUF file")
    parser.add_argument("--vectors", default="food,happy", help="built-in pairs names, or NAME=PATH of saved vectors")
    parser.add_argument("--strengths", default="4,8")
    parser.add_argument("--layer", type=int, default=None, help="the layer for built-in pairs (default: a third)")
    parser.add_argument("--openers", type=int, default=8, help="how many openers, from --first-opener on")
    parser.add_argument(
        "--first-opener", type=int, default=0, help="skip this many openers (a held-out set: tune on 0, report on 8)"
    )
    parser.add_argument("--openers-file", default=None, help="openers from a file (one per line, or .jsonl)")
    parser.add_argument("--seeds", default="0,100", help="comma list: each opener is replied to once per seed")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--decoder", default="top-k", help='a decoder spec, e.g. "top-k temperature=0.7"')
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import torch

    from chatcore.cli.specs import parse_spec
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.evaluation.metrics import contains_any
    from chatcore.evaluation.prompts import load_prompt_file, openers
    from chatcore.evaluation.runner import EvalRow, evaluate
    from chatcore.plugin_manager import PluginHost
    from chatcore.wordlists import WORDLIST_DIR, read_word_file

    if args.threads:
        torch.set_num_threads(args.threads)
    host = PluginHost()
    host.load_modules(("chatcore.plugins.greedy", "chatcore.plugins.top_k", "chatcore.plugins.vector"))
    engine = Engine(args.model, host=host)
    every = load_prompt_file(args.openers_file) if args.openers_file else openers()
    contexts = every[args.first_opener : args.first_opener + args.openers]
    seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    decoder, decoder_settings = parse_spec(args.decoder)
    base = ReplyOptions(decoder=decoder, decoder_settings=decoder_settings, max_new_tokens=args.max_new_tokens)
    words = {path.stem: set(read_word_file(path)) for path in sorted(WORDLIST_DIR.glob("*.txt"))}

    def on_attribute(name: str, reply: str) -> bool:
        if name == "happy":
            lowered = reply.lower().split()
            return sum(w.strip(".,!?") in words["positive"] for w in lowered) > sum(
                w.strip(".,!?") in words["negative"] for w in lowered
            )
        return contains_any(reply, words.get(name, words["food"]))

    def run(label: str, steerers: list) -> tuple[list[str], EvalRow]:
        """Every opener once per seed: the replies, and one row averaging the seeds' rows."""
        replies: list[str] = []
        rows = []
        for seed in seeds:
            report = evaluate(
                engine, contexts, base.replace(steerers=steerers), label=label, seed=seed, include_reference=False
            )
            replies += [sample["reply"] for sample in report.samples if "reply" in sample]
            rows.append(report.rows[0])
        mean = EvalRow(
            label=label,
            count=sum(row.count for row in rows),
            perplexity=statistics.fmean(row.perplexity or 0.0 for row in rows),
            distinct_1=statistics.fmean(row.distinct_1 for row in rows),
            distinct_2=statistics.fmean(row.distinct_2 for row in rows),
            distinct_3=statistics.fmean(row.distinct_3 for row in rows),
            mean_length=statistics.fmean(row.mean_length for row in rows),
            degenerate_share=statistics.fmean(row.degenerate_share for row in rows),
            tokens_per_s=statistics.fmean(row.tokens_per_s or 0.0 for row in rows),
        )
        return replies, mean

    vectors: list[tuple[str, dict[str, object]]] = []
    for item in [item.strip() for item in args.vectors.split(",") if item.strip()]:
        name, _, path = item.partition("=")
        source: dict[str, object] = {"path": path} if path else {"pairs": name}
        if not path and args.layer is not None:
            source["layer"] = args.layer
        vectors.append((name, source))

    plain_replies, plain = run("unsteered", [])
    print(
        f"model {args.model}, decoder {args.decoder}, openers {args.first_opener}-"
        f"{args.first_opener + len(contexts) - 1} x seeds {seeds}, "
        f"{args.max_new_tokens} new tokens"
    )
    header = f"{'configuration':34s} {'attr':>6s} {'ppl':>7s} {'degen':>6s} {'tok/s':>6s}   ratios to unsteered"
    print(header)
    results: dict[str, object] = {
        "model": args.model,
        "first_opener": args.first_opener,
        "openers": len(contexts),
        "seeds": seeds,
        "rows": {},
    }
    rows: dict[str, object] = {}
    for name, source in vectors:
        plain_share = sum(on_attribute(name, reply) for reply in plain_replies) / max(1, len(plain_replies))
        print(
            f"{'unsteered (' + name + ')':34s} {plain_share:6.1%} {plain.perplexity or 0:7.2f} "
            f"{plain.degenerate_share:6.1%} {plain.tokens_per_s or 0:6.2f}"
        )
        rows[f"unsteered/{name}"] = {"share": plain_share, **plain.__dict__}
        for strength in [float(s) for s in args.strengths.split(",") if s.strip()]:
            label = f"vector {name} strength={strength:g}"
            replies, row = run(label, [("vector", {**source, "strength": strength})])
            share = sum(on_attribute(name, reply) for reply in replies) / max(1, len(replies))
            share_ratio = share / plain_share if plain_share else float("inf")
            ppl_ratio = (row.perplexity or 0) / (plain.perplexity or 1)
            cost_ratio = (plain.tokens_per_s or 0) / (row.tokens_per_s or 1)
            print(
                f"{label:34s} {share:6.1%} {row.perplexity or 0:7.2f} {row.degenerate_share:6.1%} "
                f"{row.tokens_per_s or 0:6.2f}   share {share_ratio:.2f}x, perplexity {ppl_ratio:.2f}x, "
                f"cost per token {cost_ratio:.2f}x"
            )
            print(f"    e.g. {replies[0][:110]!r}")
            rows[label] = {
                "share": share,
                "share_ratio": share_ratio,
                "perplexity_ratio": ppl_ratio,
                "cost_ratio": cost_ratio,
                "examples": replies[:4],
                **row.__dict__,
            }
    results["rows"] = rows
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
