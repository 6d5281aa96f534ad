"""Greedy AR with the whole step on the device (fast/loop.py) against the engine's compiled
step loop (generate.generate_ar on fast.make_fast(model, compile=True)). Not a test.

Both compiled (inductor on the CPU, CUDA graphs' mode on a GPU is bench_gpu's job), the chat
questions, prefill included, alternated runs after a warm-up that compiles both; prints tokens/s
(the median) and whether the tokens are the same.

  python -m scripts.bench_loop --ckpt out/smollm2 --threads 2
"""

import argparse
import statistics
import time

import torch

import fast
from checkpoint import load_checkpoint
from fast.loop import ar_step, generate_ar_device
from generate import generate_ar
from scripts.common import QUESTIONS, ints, machine


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch-sizes", type=ints, default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine("cpu"))
    ck = load_checkpoint(args.ckpt, "cpu", getattr(torch, args.dtype))
    model = fast.make_fast(ck.model, compile=True)
    step = torch.compile(ar_step, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})
    enc = lambda q: ck.tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
    n = args.new_tokens
    for batch in args.batch_sizes:
        prompts = [enc(q) for q in QUESTIONS[:batch]]
        generate_ar(model, prompts, n), generate_ar_device(model, prompts, n, (), 8, step)  # compile both
        times = {"compiled step loop": [], "device loop": []}
        for _ in range(args.rounds):
            t = time.perf_counter()
            a = [g.ids for g in generate_ar(model, prompts, n)]
            times["compiled step loop"].append(time.perf_counter() - t)
            t = time.perf_counter()
            b = generate_ar_device(model, prompts, n, (), 8, step)
            times["device loop"].append(time.perf_counter() - t)
        rates = {k: n * batch / statistics.median(v) for k, v in times.items()}
        print(f"batch {batch}: " + ", ".join(f"{k} {r:.1f} tokens/s" for k, r in rates.items())
              + f" ({rates['device loop'] / rates['compiled step loop']:.2f}x); same tokens: {a == b}")


if __name__ == "__main__":
    main()
