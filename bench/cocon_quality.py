"""CoCon's effect and cost in quality, on held-out chitchat contexts, same seeds.

    python bench/cocon_quality.py [--contents "music,pizza,dog,beach,is perfect,is horrible"]
                                  [--taus=-2,0,2,5] [--limit 100] [--rank ""] [--json report.json]

Unsteered top-k, then top-k steered by ``cocon content=C tau=T`` for every content C
and tau T, through chatcore.evaluation's ``evaluate`` (reply perplexity under the plain
model, distinct-2, degenerate share). The content share is the share of replies that
carry the content: every keyword of it (function words such as "is" left out) as
itself or a close variant (music: musical, musicians; horrible: horribly; see
chatcore.evaluation.metrics.mentions). Targets: at the block's default tau, a share of
at least 3x unsteered and a perplexity of at most 1.5x unsteered; the share should
grow with tau. With --rank: also the ``rank`` decoder on the content's keywords (8
sampled candidates, the most fluent one that carries a keyword), alone and over cocon.
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="chatcore-tiny")
    parser.add_argument("--block", default=None, help="CoCon block (default: the bundled one for the model)")
    parser.add_argument(
        "--contents",
        default="music,pizza,dog,beach,is perfect,is horrible",
        help="comma-separated contents, each steered on its own",
    )
    parser.add_argument("--taus", default="-2,0,2,5")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--decoder", default="top-k", help='a decoder spec, e.g. "top-k top_k=20"')
    parser.add_argument(
        "--rank",
        default=None,
        help="also run the rank decoder with the content's words (chatcore.evaluation.metrics."
        "content_keywords), alone and with cocon at the block's default tau: its extra "
        'settings, e.g. "candidates=8" ("" for its defaults)',
    )
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import torch
    import transformers

    from chatcore.cli.specs import parse_spec
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.evaluation.metrics import content_keywords, mentions
    from chatcore.evaluation.prompts import chitchat_heldout
    from chatcore.evaluation.runner import evaluate
    from chatcore.options import parse_key_values
    from chatcore.plugin_manager import PluginHost

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    host = PluginHost()
    host.load_modules(
        (
            "chatcore.plugins.greedy",
            "chatcore.plugins.top_k",
            "chatcore.plugins.mmi.plugin",
            "chatcore.plugins.rank",
            "chatcore.plugins.cocon.plugin",
        )
    )
    engine = Engine(args.model, host=host)
    contexts = chitchat_heldout()[: args.limit]
    decoder, decoder_settings = parse_spec(args.decoder)
    base = ReplyOptions(decoder=decoder, decoder_settings=decoder_settings, max_new_tokens=args.max_new_tokens)
    contents = [c.strip() for c in args.contents.split(",") if c.strip()]
    taus = [float(t) for t in args.taus.split(",") if t.strip()]

    def run(label: str, steerers: list, options: ReplyOptions = base) -> tuple[object, list[str]]:
        report = evaluate(
            engine,
            contexts,
            options.replace(steerers=steerers),
            label=label,
            seed=args.seed,
            include_reference=False,
        )
        errors = [s["error"] for s in report.samples if "error" in s]
        if errors:
            raise SystemExit(f"{label}: {len(errors)} contexts failed, first: {errors[0]}")
        return report.rows[0], [s["reply"] for s in report.samples]

    def share(replies: list[str], content: str) -> float:
        return sum(mentions(r, content) for r in replies) / max(1, len(replies))

    plain, plain_replies = run("top-k", [])
    last_seed = args.seed + len(contexts) - 1
    print(
        f"{len(contexts)} held-out contexts, model {args.model}, decoder {args.decoder}, "
        f"seeds {args.seed}..{last_seed}, at most {args.max_new_tokens} tokens"
    )
    print(
        f"unsteered: perplexity {plain.perplexity:.1f}, distinct-2 {plain.distinct_2:.3f}, "
        f"degenerate {plain.degenerate_share:.1%}, length {plain.mean_length:.1f} words, "
        f"{plain.tokens_per_s or 0:.1f} tok/s"
    )
    results: dict[str, object] = {
        "contexts": len(contexts),
        "decoder": args.decoder,
        "model": args.model,
        "unsteered": dataclasses.asdict(plain),
        "contents": {},
    }

    def cocon(*contents: str, **settings: object) -> list:
        """The steerers for ``cocon`` with these contents (and the --block, if given)."""
        return [("cocon", {"content": contents, **settings, **({"block": args.block} if args.block else {})})]

    null, _ = run("cocon without content", cocon())
    print(
        f"cocon without content: perplexity {null.perplexity:.1f} ({null.perplexity / plain.perplexity:.2f}x), "
        f"distinct-2 {null.distinct_2:.3f}, degenerate {null.degenerate_share:.1%}, "
        f"length {null.mean_length:.1f} words, {null.tokens_per_s or 0:.1f} tok/s"
    )
    results["no_content"] = dataclasses.asdict(null)

    def measure(
        label: str, column: str, content: str, base_share: float, steerers: list, options: ReplyOptions = base
    ) -> dict[str, object]:
        """Run one configuration, print its row, and return it for the JSON report."""
        row, replies = run(label, steerers, options)
        steered = share(replies, content)
        share_ratio = steered / base_share if base_share else float("inf")
        ppl_ratio = row.perplexity / plain.perplexity
        print(
            f"{content:14s} {column:>5s} {steered:7.1%} {share_ratio:7.1f}x {row.perplexity:6.1f} "
            f"{ppl_ratio:7.2f}x {row.distinct_2:7.3f} {row.degenerate_share:6.1%} {row.mean_length:6.1f}",
            flush=True,
        )
        return {
            "share": steered,
            "share_ratio": share_ratio,
            "perplexity_ratio": ppl_ratio,
            "row": dataclasses.asdict(row),
            "samples": replies[:5],
        }

    header = (
        f"{'content':14s} {'tau':>5s} {'share':>7s} {'x unst.':>8s} {'ppl':>6s} {'x unst.':>8s} "
        f"{'dist-2':>7s} {'degen':>6s} {'words':>6s}"
    )
    print(header)
    for content in contents:
        base_share = share(plain_replies, content)
        print(
            f"{content:14s} {'-':>5s} {base_share:7.1%} {'':8s} {plain.perplexity:6.1f} {'':8s} "
            f"{plain.distinct_2:7.3f} {plain.degenerate_share:6.1%} {plain.mean_length:6.1f}   (unsteered)"
        )
        rows: dict[str, dict[str, object]] = {}
        for tau in taus:
            rows[f"{tau:g}"] = measure(
                f"cocon {content} tau={tau:g}", f"{tau:g}", content, base_share, cocon(content, tau=(tau,))
            )
        if args.rank is not None:
            ranked = dataclasses.replace(
                base,
                decoder="rank",
                decoder_settings={
                    **decoder_settings,
                    "words": tuple(content_keywords(content)),
                    **parse_key_values(args.rank.split()),
                },
            )
            for label, steerers in ((f"rank {args.rank}".strip(), []), ("rank + cocon", cocon(content))):
                rows[label] = measure(f"{label} {content}", label, content, base_share, steerers, ranked)
        shares = [rows[f"{tau:g}"]["share"] for tau in sorted(taus)]
        monotonic = all(a <= b for a, b in zip(shares, shares[1:]))
        print(f"{'':14s} share over tau {sorted(taus)}: {'non-decreasing' if monotonic else 'NOT monotonic'}")
        results["contents"][content] = {
            "unsteered_share": base_share,
            "taus": rows,  # type: ignore[index]
            "monotonic": monotonic,
        }
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
