"""PPLM's effect and cost in quality, on held-out chitchat contexts, same seeds.

    python bench/pplm_quality.py [--model chatcore-tiny] [--format auto] [--topics food,weather,music]
                                 [--limit 100] [--offset 0] [--openers-file FILE] [--seed 0]
                                 [--pplm "stepsize=0.5"] [--rank ""] [--rank-only]
                                 [--sentiment] [--json report.json]

Held-out protocol: tune on one slice of the contexts (``--offset 0 --limit 8``) and report
on a disjoint one (``--offset 8 --limit 8``, or another ``--seed``); the contexts are the
held-out chitchat dialogues, or one opener per line of ``--openers-file``. Context i is
replied to with seed ``--seed`` + i.

For each topic: unsteered top-k vs ``pplm topic=...`` through chatcore.evaluation's
``evaluate`` (reply perplexity under the plain model, distinct-2, degenerate share, and
the share of replies containing a word of the topic). The contexts are rendered in the
model's prompt format (``--format``; auto: the tokenizer's chat template where it has one,
as for SmolLM2, else dialogpt). With --sentiment: unsteered vs
``pplm discriminator=sentiment`` towards each class, judged by AFINN (a word-list scorer,
not VADER, whose labels trained the head); needs the ``afinn`` package.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny", help="a model name, folder or GGUF file (e.g. smollm2)")
    parser.add_argument("--format", dest="prompt_format", default="auto", help="the prompt format")
    parser.add_argument("--topics", default="food,weather,music")
    parser.add_argument("--limit", type=int, default=100, help="how many contexts")
    parser.add_argument("--offset", type=int, default=0, help="skip this many contexts (held-out slice)")
    parser.add_argument("--openers-file", default=None, help="one opener per line instead of the chitchat contexts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--decoder", default="top-k", help='a decoder spec, e.g. "top-k top_k=20"')
    parser.add_argument(
        "--pplm", default="", help='extra pplm settings for the topics, e.g. "stepsize=0.1 gm_scale=0.9"'
    )
    parser.add_argument(
        "--rank",
        default=None,
        help="also run the rank decoder with each topic's words, alone and with pplm: its extra "
        'settings, e.g. "candidates=8" ("" for its defaults)',
    )
    parser.add_argument("--rank-only", action="store_true", help="with --rank: leave out pplm without ranking")
    parser.add_argument("--sentiment", action="store_true", help="also steer the shipped sentiment head")
    parser.add_argument("--sentiment-pplm", default="", help="extra pplm settings for the sentiment runs")
    parser.add_argument("--sentiment-labels", default="positive,negative", help="classes to steer towards")
    parser.add_argument("--skip-topics", action="store_true")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import torch

    from chatcore.cli.specs import parse_spec
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.evaluation.metrics import contains_any
    from chatcore.evaluation.prompts import EvalContext, chitchat_heldout
    from chatcore.evaluation.runner import evaluate
    from chatcore.options import parse_key_values
    from chatcore.plugin_manager import PluginHost
    from chatcore.wordlists import WORDLIST_DIR, read_word_file

    if args.threads:
        torch.set_num_threads(args.threads)
    host = PluginHost()
    host.load_modules(
        (
            "chatcore.plugins.greedy",
            "chatcore.plugins.top_k",
            "chatcore.plugins.bow_bias",
            "chatcore.plugins.mmi.plugin",
            "chatcore.plugins.rank",
            "chatcore.plugins.pplm.plugin",
        )
    )
    engine = Engine(args.model, host=host, prompt_format=args.prompt_format)
    if args.openers_file:
        try:
            lines = Path(args.openers_file).read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise SystemExit(f"--openers-file: {error}") from None
        every = [EvalContext([line.strip()]) for line in lines if line.strip() and not line.startswith("#")]
    else:
        every = chitchat_heldout()
    contexts = every[args.offset : args.offset + args.limit]
    if not contexts:
        raise SystemExit(f"no contexts from {args.offset} on (there are {len(every)})")
    decoder, decoder_settings = parse_spec(args.decoder)
    base = ReplyOptions(decoder=decoder, decoder_settings=decoder_settings, max_new_tokens=args.max_new_tokens)
    extra = parse_key_values(args.pplm.split())
    results: dict[str, object] = {"contexts": len(contexts), "decoder": args.decoder}

    def run(label: str, steerers: list, vocabulary: set[str] | None, options: ReplyOptions | None = None):

        report = evaluate(
            engine,
            contexts,
            (options or base).replace(steerers=steerers),
            label=label,
            vocabulary=vocabulary,
            seed=args.seed,
            include_reference=False,
        )
        return report

    plain = run("top-k", [], None)
    plain_replies = [s["reply"] for s in plain.samples if "reply" in s]
    plain_row = plain.rows[0]
    last_seed = args.seed + len(contexts) - 1
    print(
        f"model {args.model}, prompt format {engine.prompt_format.name}, contexts {args.offset}.."
        f"{args.offset + len(contexts) - 1} of {args.openers_file or 'the held-out chitchat'}, "
        f"decoder {args.decoder}, seeds {args.seed}..{last_seed}, {args.max_new_tokens} new tokens"
    )
    header = f"{'configuration':38s} {'attr':>6s} {'ppl':>7s} {'dist-2':>7s} {'degen':>6s} {'tok/s':>6s}"
    if not args.skip_topics:
        print(header)
        for topic in [t for t in args.topics.split(",") if t]:
            vocabulary = set(read_word_file(WORDLIST_DIR / f"{topic}.txt"))
            plain_share = sum(contains_any(r, vocabulary) for r in plain_replies) / max(1, len(plain_replies))
            print(
                f"{'top-k (unsteered)':38s} {plain_share:6.1%} {plain_row.perplexity:7.1f} "
                f"{plain_row.distinct_2:7.3f} {plain_row.degenerate_share:6.1%} {plain_row.tokens_per_s or 0:6.1f}"
            )
            topic_results: dict[str, object] = {
                "unsteered_share": plain_share,
                "unsteered": dataclasses_dict(plain_row),
            }
            results[topic] = topic_results
            if not (args.rank_only and args.rank is not None):
                steered = run(f"pplm {topic}", [("pplm", {"topic": topic, **extra})], vocabulary).rows[0]
                print(
                    f"{'pplm topic=' + topic + ' ' + args.pplm:38s} {steered.attribute_share:6.1%} "
                    f"{steered.perplexity:7.1f} {steered.distinct_2:7.3f} {steered.degenerate_share:6.1%} "
                    f"{steered.tokens_per_s or 0:6.1f}"
                )
                if plain_share:
                    share_ratio = steered.attribute_share / plain_share
                else:  # from none: any share on topic is a gain, none is none
                    share_ratio = float("inf") if steered.attribute_share else 0.0
                ppl_ratio = steered.perplexity / plain_row.perplexity
                # rounded: 15 % / 5 % is 2.9999... in floating point
                share_verdict = "met" if round(share_ratio, 9) >= 3 else "not met"
                ppl_verdict = "met" if round(ppl_ratio, 9) <= 1.3 else "not met"
                print(
                    f"  -> topic share {share_ratio:.2f}x unsteered (target >= 3: {share_verdict}), "
                    f"perplexity {ppl_ratio:.2f}x (target <= 1.3: {ppl_verdict}), cost per token "
                    f"{(plain_row.tokens_per_s or 0) / (steered.tokens_per_s or 1):.2f}x"
                )
                topic_results.update(
                    {"pplm": dataclasses_dict(steered), "share_ratio": share_ratio, "perplexity_ratio": ppl_ratio}
                )
            if args.rank is not None:
                ranked = base.replace(
                    decoder="rank",
                    decoder_settings={**decoder_settings, "topic": topic, **parse_key_values(args.rank.split())},
                )
                for label, steerers in (
                    (f"rank topic={topic} {args.rank}", []),
                    (f"rank + pplm topic={topic} {args.pplm}", [("pplm", {"topic": topic, **extra})]),
                ):
                    row = run(label, steerers, vocabulary, ranked).rows[0]
                    ratio = row.attribute_share / plain_share if plain_share else float("inf")
                    print(
                        f"{label:38s} {row.attribute_share:6.1%} {row.perplexity:7.1f} {row.distinct_2:7.3f} "
                        f"{row.degenerate_share:6.1%} {row.tokens_per_s or 0:6.1f}"
                    )
                    print(
                        f"  -> topic share {ratio:.2f}x unsteered, perplexity "
                        f"{row.perplexity / plain_row.perplexity:.2f}x, {row.mean_length:.1f} words"
                    )
                    topic_results[label] = dataclasses_dict(row)
    if args.sentiment:
        try:
            from afinn import Afinn
        except ImportError:
            raise SystemExit("--sentiment needs the afinn package (pip install afinn)") from None
        afinn = Afinn()
        sentiment_extra = parse_key_values(args.sentiment_pplm.split())

        def shares(replies: list[str]) -> tuple[float, float]:
            scores = [afinn.score(r) for r in replies]
            count = max(1, len(scores))
            return sum(s > 0 for s in scores) / count, sum(s < 0 for s in scores) / count

        plain_pos, plain_neg = shares(plain_replies)
        print(
            f"\nsentiment judged by AFINN: {'configuration':40s} {'positive':>8s} {'negative':>8s} {'ppl':>7s} "
            f"{'dist-2':>7s} {'degen':>6s}"
        )
        print(
            f"{'':27s}{'top-k (unsteered)':40s} {plain_pos:8.1%} {plain_neg:8.1%} {plain_row.perplexity:7.1f} "
            f"{plain_row.distinct_2:7.3f} {plain_row.degenerate_share:6.1%}"
        )
        for label in [label for label in args.sentiment_labels.split(",") if label]:
            report = run(
                f"pplm {label}",
                [("pplm", {"discriminator": "sentiment", "class_label": label, **sentiment_extra})],
                None,
            )
            replies = [s["reply"] for s in report.samples if "reply" in s]
            positive, negative = shares(replies)
            row = report.rows[0]
            name = f"pplm sentiment {label} {args.sentiment_pplm}"
            print(
                f"{'':27s}{name:40s} {positive:8.1%} {negative:8.1%} {row.perplexity:7.1f} "
                f"{row.distinct_2:7.3f} {row.degenerate_share:6.1%}"
            )
            results[f"sentiment-{label}"] = {
                "positive_share": positive,
                "negative_share": negative,
                "row": dataclasses_dict(row),
            }
        results["sentiment-unsteered"] = {"positive_share": plain_pos, "negative_share": plain_neg}
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


def dataclasses_dict(row: object) -> dict:
    import dataclasses

    return dataclasses.asdict(row)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
