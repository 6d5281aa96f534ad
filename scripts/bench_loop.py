"""Greedy AR, the τ window and exact mode with the whole step on the device (fast/loop.py)
against the engine's step loops, eager and compiled (generate.generate_ar, generate.generate and
exact.generate_exact on fast.make_fast(model, compile=True), its step toggled). Not a test.

Inductor on the CPU (CUDA graphs' mode on a GPU is bench_gpu's job), the chat questions, prefill
included, alternated runs after a warm-up that compiles; prints tokens/s (the median), the time
ratios (device loop / eager, device loop / compiled step loop), ms per forward (the run's time
over its forwards: the most any row ran) and whether the tokens are the same in all three; then
each decoder's device-loop forward against AR's.

  python -m scripts.bench_loop --ckpt out/smollm2 --threads 2
"""

import argparse
import statistics
import time

import torch

import fast
from checkpoint import load_checkpoint
from exact import generate_exact
from fast.loop import (
    ar_step,
    compiled_steps,
    exact_step,
    generate_ar_device,
    generate_exact_device,
    generate_window_device,
    window_step,
)
from fast.step import switch_step
from generate import generate, generate_ar
from scripts.common import QUESTIONS, ints, machine


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch-sizes", type=ints, default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tau", type=float, default=0.95, help="the τ window's (B = 4)")
    return p.parse_args()


def make_loops(model, mask, tau, n, K=2):
    """-> {decoder: {loop: prompts -> Generations}}: each decoder's reference loop on the engine,
    its step eager and compiled (switched per run), and its device loop, compiled whole."""
    step = switch_step(model, None)  # the compiled step loops' step, off for the eager ones
    steps = compiled_steps(torch.device("cpu"))
    kw = dict(block_size=4, max_new_tokens=n, mask_id=mask)

    def with_step(s, f):  # a reference loop on the engine, its step eager (None) or compiled
        def run(p):
            before = switch_step(model, s)
            try:
                return f(p)
            finally:
                switch_step(model, before)
        return run

    loops = {
        "AR": (lambda p: generate_ar(model, p, n),
               lambda p: generate_ar_device(model, p, n, (), 8, steps[ar_step])),
        f"tau={tau} window": (lambda p: generate(model, p, tau=tau, **kw),
                              lambda p: generate_window_device(model, p, 4, tau, n, mask, (), 8,
                                                               steps[window_step])),
        f"exact K={K}": (lambda p: generate_exact(model, p, drafts=K, **kw),
                         lambda p: generate_exact_device(model, p, K, n, mask, (), 8, steps[exact_step])),
    }
    return {name: {"eager step loop": with_step(None, ref), "compiled step loop": with_step(step, ref),
                   "device loop": dev} for name, (ref, dev) in loops.items()}


def alternated(runs, prompts, rounds):
    """A warm-up run of each loop (it compiles), then `rounds` rounds of one run each ->
    ({loop: its Generations}, {loop: the median seconds})."""
    for run in runs.values():
        run(prompts)
    times, out = {k: [] for k in runs}, {}
    for _ in range(rounds):
        for k, run in runs.items():
            t = time.perf_counter()
            out[k] = run(prompts)
            times[k].append(time.perf_counter() - t)
    return out, {k: statistics.median(v) for k, v in times.items()}


def report(batch, name, out, med):
    """Print one decoder's line -> the device loop's ms per forward."""
    a, b = out["compiled step loop"], out["device loop"]
    tokens = sum(len(g.ids) for g in a)
    per_row = tokens / sum(g.forwards for g in a)
    per_forward = med["device loop"] / max(g.forwards for g in b) * 1e3
    ids = {k: [g.ids for g in o] for k, o in out.items()}
    same = (f"device loop = compiled step loop: {ids['device loop'] == ids['compiled step loop']}, "
            f"= eager step loop: {ids['device loop'] == ids['eager step loop']}")
    dev, eager, comp = med["device loop"], med["eager step loop"], med["compiled step loop"]
    rates = ", ".join(f"{k} {tokens / t:.1f} tokens/s" for k, t in med.items())
    print(f"batch {batch}, {name}: {rates}"
          + f"; time: device loop / eager {dev / eager:.2f}x, device loop / compiled step loop "
          f"{dev / comp:.2f}x; {per_row:.2f} tokens/forward/row; device loop {per_forward:.1f} "
          f"ms/forward; same tokens: {same}")  # compiled bf16 may round apart from eager
    return per_forward


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine("cpu"))
    ck = load_checkpoint(args.ckpt, "cpu", getattr(torch, args.dtype))
    model = fast.make_fast(ck.model, compile=True)
    loops = make_loops(model, ck.mask_id, args.tau, args.new_tokens)
    enc = lambda q: ck.tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
    for batch in args.batch_sizes:
        prompts = [enc(q) for q in QUESTIONS[:batch]]
        per_forward = {name: report(batch, name, *alternated(runs, prompts, args.rounds))
                       for name, runs in loops.items()}
        print(f"batch {batch}, device loop ms/forward against AR's: "
              + ", ".join(f"{k} {v / per_forward['AR']:.2f}x" for k, v in per_forward.items() if k != "AR"))


if __name__ == "__main__":
    main()
