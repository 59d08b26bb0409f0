"""CoCon decoding speed: plain top-k vs top-k steered by ``cocon``, same model, same run.

    python bench/cocon_speed.py [--model chatcore-tiny] [--history 200] [--tokens 60] [--repeats 5]

Both decode exactly --tokens new tokens (EOS banned until then) after a conversation
whose prompt is about --history tokens; the median of --repeats alternating runs is
reported as tokens per second, with the cost per token of cocon relative to plain
(cocon seconds per token / plain seconds per token; the target is at most 1.5x).

    python bench/cocon_speed.py --train [--batch 16] [--history 32] [--continuation 24] [--repeats 5]
                                [--corpus chitchat]

With --train: the cost of one CoCon training step (every loss on: self, null, cycle with
its 8 soft-generated tokens, adversarial; forward and backward, no optimizer step) against
a plain forward and backward of the same model (all its weights trainable, next-token
loss) on the same batch of windows; medians of --repeats alternating runs and their ratio
(the target is at most 3x), the operators each dispatches (views left out: on a GPU,
where a step is bound by launching kernels, about one launch each) and their ratio, then
the share of the CoCon step each part takes. With --compile the frozen model's passes run
through torch.compile on both sides (``train cocon --compile``), after a warm-up step that
compiles them.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchlib import add_model_arguments, load_engine, long_conversation, operators


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--block", default=None, help="CoCon block (default: the bundled one for the model)")
    parser.add_argument("--content", default="music")
    parser.add_argument("--history", type=int, default=200, help="prompt length in tokens (about)")
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train", action="store_true", help="Time a training step instead (see above).")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--continuation", type=int, default=24)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="--train: compile the frozen model's passes (cocon's and the plain one's)",
    )
    parser.add_argument("--corpus", default="chitchat", help='"chitchat" or a JSONL file of dialogues (--train)')
    args = parser.parse_args()
    if args.train:
        train_step(args)
        return

    import torch
    import transformers

    from chatcore.engine import ReplyOptions

    engine = load_engine(args, "chatcore.plugins.cocon.plugin")
    device = engine.loaded.device
    n = args.tokens

    conversation = long_conversation(engine, args.history, n)
    history_tokens = len(engine.prompt(conversation, n).token_ids)

    cocon_settings = {"content": args.content}
    if args.block:
        cocon_settings["block"] = args.block
    configurations = {
        "plain top-k": [],
        f"top-k + cocon content={args.content}": [("cocon", cocon_settings)],
    }

    def sync() -> None:
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()

    def run(steerers: list) -> float:
        options = ReplyOptions(
            decoder="top-k",
            decoder_settings={"top_k": 40, "temperature": 0.8},
            seed=0,
            steerers=steerers,
            max_new_tokens=n,
            min_new_tokens=n,
        )
        sync()
        start = time.perf_counter()
        response = engine.respond(conversation, options)
        response.text()
        sync()
        elapsed = time.perf_counter() - start
        assert len(response.token_ids) == n, len(response.token_ids)
        conversation.turns.pop()  # the same history for every run
        return elapsed

    print(
        f"model {args.model} on {device}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"threads {torch.get_num_threads()}; {history_tokens}-token history, {n} new tokens"
    )
    for steerers in configurations.values():
        run(steerers)  # warm-up (loads the block, fills caches of the allocator)
    times: dict[str, list[float]] = {label: [] for label in configurations}
    for _ in range(args.repeats):
        for label, steerers in configurations.items():
            times[label].append(run(steerers))
    medians = {label: statistics.median(values) for label, values in times.items()}
    plain_label = next(iter(configurations))
    for label, seconds in medians.items():
        print(f"{label:34s} {n / seconds:8.1f} tok/s   {1000 * seconds / n:6.2f} ms/token")
    for label, seconds in medians.items():
        if label != plain_label:
            print(f"cost per token, {label} / {plain_label}: {seconds / medians[plain_label]:.2f}x")


def train_step(args) -> None:
    import torch
    from torch.nn import functional as F

    from chatcore.plugins.cocon.block import CoconBlock, CoconConfig
    from chatcore.plugins.cocon.losses import CoconLosses, HiddenDiscriminator
    from chatcore.plugins.cocon.model_split import SplitModel
    from chatcore.plugins.cocon.pipeline import CoconPipeline
    from chatcore.plugins.cocon.training import CoconTrainConfig, default_split_layer, norm_epsilon
    from chatcore.plugins.cocon.windows import WindowSampler
    from chatcore.training.corpus import load_corpus
    from chatcore.training.data import encode_dialogues

    engine = load_engine(args)
    model, tokenizer = engine.loaded.model, engine.loaded.tokenizer
    device = engine.loaded.device
    on_cuda = device.startswith("cuda")
    # bf16 autocast on a GPU, as `train cocon` runs there (precision auto)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda else torch.autocast("cpu", enabled=False)

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    config = CoconTrainConfig(
        out_dir="unused",
        model=args.model,
        batch_size=args.batch,
        history_tokens=args.history,
        continuation_tokens=args.continuation,
        cycle_from_step=0,
        adv_from_step=0,
        no_history_share=0.0,
    )
    model.eval()
    model.requires_grad_(False)
    split = SplitModel(model, default_split_layer(SplitModel(model, 1).n_layer))
    block = CoconBlock(
        CoconConfig(
            n_embd=split.n_embd,
            n_head=split.n_head,
            split_layer=split.split_layer,
            layer_norm_epsilon=norm_epsilon(model.config),
        )
    ).to(device)
    forward = model
    if args.compile:  # the frozen model's halves compiled, and the plain peer's pass as well
        from chatcore.plugins.cocon.compiled import compile_halves

        compile_halves(split)
        forward = torch.compile(model, dynamic=True)
    losses_fn = CoconLosses(CoconPipeline(split, block), config)
    discriminator = HiddenDiscriminator(split.n_embd).to(device)
    stream = encode_dialogues(load_corpus(args.corpus)[:2000], tokenizer)
    sampler = WindowSampler(stream, engine.eos_token_id, args.history, args.continuation, 0.75, None)
    windows = sampler.sample(args.batch, torch.Generator().manual_seed(0)).to(device)

    def cocon() -> float:
        sync()
        start = time.perf_counter()
        with autocast:
            batch = losses_fn(windows, torch.Generator().manual_seed(1), True, True)
            fake = batch.fake
            assert fake is not None
            ones = torch.ones(fake.size(0), device=device)
            adv = F.binary_cross_entropy_with_logits(discriminator(fake).float(), ones)
            total = sum(batch.losses.values()) + 0.2 * adv
        total.backward()
        block.zero_grad(set_to_none=True)
        discriminator.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    def plain() -> float:
        model.requires_grad_(True)
        sync()
        start = time.perf_counter()
        with autocast:
            logits = forward(input_ids=windows[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())
        loss.backward()
        sync()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        model.requires_grad_(False)
        return elapsed

    cocon(), plain()  # warm-up
    times: dict[str, list[float]] = {"cocon": [], "plain": []}
    for _ in range(args.repeats):
        times["cocon"].append(cocon())
        times["plain"].append(plain())
    cocon_s, plain_s = statistics.median(times["cocon"]), statistics.median(times["plain"])
    print(
        f"model {args.model}, threads {torch.get_num_threads()}, batch {args.batch} x "
        f"{args.history + args.continuation} tokens (history {args.history}), block after layer {split.split_layer}"
    )
    print(
        f"training step: cocon (self, null, cycle, adversarial) {cocon_s * 1000:.1f} ms   plain forward+backward "
        f"{plain_s * 1000:.1f} ms   ratio {cocon_s / plain_s:.2f}x"
    )
    if args.compile:
        print("operators: not counted (compiled kernels are not dispatched one operator at a time)")
        return
    cocon_ops, plain_ops = operators(cocon), operators(plain)
    print(
        f"operators a step runs (forward and backward, views left out; on a GPU about one kernel launch each): "
        f"cocon {cocon_ops}   plain {plain_ops}   ratio {cocon_ops / plain_ops:.2f}x"
    )
    with torch.profiler.profile() as profile:
        cocon()
    print(profile.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
