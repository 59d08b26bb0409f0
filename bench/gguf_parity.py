"""A converted GGUF folder against another conversion of the same file: weights and greedy replies.

    python bench/gguf_parity.py OLD_FOLDER NEW_FOLDER [--max-new-tokens 32]

Both are loaded in float32 on the CPU (chatcore's CPU default). Prints whether every weight
of NEW equals OLD's rounded to NEW's stored dtype (bfloat16 for a quantized file), then
greedy replies to five prompts from each, and where they part.
"""

from __future__ import annotations

import argparse

PROMPTS = (
    "hi, how are you?",
    "what is the capital of France?",
    "tell me a short story about a dog.",
    "what should I cook tonight?",
    "explain what a rainbow is.",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch

    from chatcore.engine import Engine, ReplyOptions
    from chatcore.testing import plugin_host

    torch.set_num_threads(1)
    host = plugin_host("chatcore.plugins.greedy")
    old = Engine(args.old, host=host, device="cpu", dtype="float32")
    new = Engine(args.new, host=host, device="cpu", dtype="float32")
    old_state, new_state = old.loaded.model.state_dict(), new.loaded.model.state_dict()
    same = all(torch.equal(old_state[k].to(torch.bfloat16).float(), new_state[k]) for k in new_state)
    print(f"every weight of NEW == OLD's rounded to bfloat16: {same}")
    options = ReplyOptions(decoder="greedy", max_new_tokens=args.max_new_tokens)
    equal = 0
    for prompt in PROMPTS:
        replies = []
        for engine in (old, new):
            response = engine.reply_to([prompt], options)
            response.text()
            replies.append(response)
        a, b = replies
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        equal += a.token_ids == b.token_ids
        print(f"{prompt!r}: {'equal' if a.token_ids == b.token_ids else f'parts at token {first}'}")
        if a.token_ids != b.token_ids:
            print(f"   old: {a.text()!r}\n   new: {b.text()!r}")
    print(f"greedy replies equal: {equal}/{len(PROMPTS)} ({args.max_new_tokens} new tokens each)")


if __name__ == "__main__":
    main()
