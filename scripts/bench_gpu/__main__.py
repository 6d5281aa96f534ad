"""The whole GPU picture in one command (issues 40, 49, 50): decoding, exactness, HF, a training
step and the main job on CUDA, written to results/GPU.md and results/gpu.json. Not a test.

Nothing is downloaded: the decoding model is a random Qwen2.5-0.5B-shaped model built here with
model.py (its mask predictions are noise, so τ and exact mode accept few drafts: the step
ratios, not the tokens per forward, are what it measures). Sections run in order of what
they answer, each only if the time budget (--minutes) still holds it, and the page is
rewritten after each, so a run cut short keeps what it measured:

  decode    our AR, the τ loop (window), exact K = 1, 2, 4 through the engine (fast.make_fast),
            eager and compiled (fast.step.compile_step: CUDA graphs); the device loops of
            fast/loop.py (AR, window, exact K = 2, 4: the whole step in one CUDA graph); HF
            generate (static cache: the anchor, and dynamic), at batch 1, 4, 16, bf16, 64 new
            tokens: tokens/s, ms per forward, steady-state ms per forward (after the prefill),
            x AR, % of the card's bandwidth, host syncs per token, kernels per forward, graphs
            built after warm-up; per batch, exact mode = AR (eager, compiled, device loop) and
            AR alone = AR in the batch
  main      python train.py --device=cuda (the toy main job): time and its accuracy lines
  toy       the main job's checkpoint decoding its test prompts: AR, τ = 0.9 window, exact
            K = 2, eager and compiled, at each batch: trained drafts, so tokens per forward
            show as tokens/s; exact = AR
  train     one optimizer step at the 0.5B shape, 512-token rows, gradient checkpointing,
            bf16: AR vs MARS, eager vs torch.compile; peak memory against util/memory.py's
            estimate for configs/qwen2.5-0.5b-24gb.json

On a machine without CUDA it says so in one line and exits 0. `--dry-run` runs every section on
the CPU instead, at a tiny shape (2 layers, width 64, a vocabulary of 1,024, matmuls in tiles of 16
rows; 32-token training rows; the main job for 2 + 2 steps without its evaluation, and its
checkpoint decoding), to
out/bench_gpu_dry_run.md: the script's own check before GPU time is spent on it
(tests/test_bench_gpu.py runs it). Its numbers measure nothing.

    python -m scripts.bench_gpu                  # ~8 min on one H200
    python -m scripts.bench_gpu --minutes 3 --batch-sizes 1,4
    python -m scripts.bench_gpu --dry-run        # the CPU, ~2 min

The package: common.py (the run's settings, the model, timing), decode.py, jobs.py (the main
job and the toy), training.py, page.py (the page and the time budget); main() here, in __main__.py
(the package's __init__ imports nothing, so its sections import common.py without a circle).
"""

import argparse
import json
import os
import tempfile
import time

import torch

from fast.linear import set_row_tile
from scripts.bench_gpu import common
from scripts.bench_gpu.decode import decode_section
from scripts.bench_gpu.jobs import main_job_section, toy_section
from scripts.bench_gpu.page import Budget, page
from scripts.bench_gpu.training import train_section
from scripts.common import ints, machine


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--minutes", type=float, default=8.0, help="time budget; sections that no longer fit are skipped"
    )
    p.add_argument("--batch-sizes", type=ints, default=None, help="default 1,4,16 (--dry-run 1,2)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (--dry-run 8)")
    p.add_argument("--out", default=None, help="writes OUT.md and OUT.json (default results/GPU; "
                   "out/bench_gpu_dry_run with --dry-run)")
    p.add_argument("--sections", default="decode,main,toy,train", help="in this order")
    p.add_argument("--dry-run", action="store_true", help="every section on the CPU at a tiny shape: "
                   "checks the script, measures nothing")
    args = p.parse_args(argv)
    common.use(common.DRY_RUN if args.dry_run else common.GPU_RUN)
    RUN = common.RUN
    args.batch_sizes = args.batch_sizes or RUN.batch_sizes
    args.new_tokens = args.new_tokens or RUN.new_tokens
    args.out = args.out or RUN.out
    unknown = set(args.sections.split(",")) - {"decode", "main", "toy", "train"}
    if unknown:
        print(f"--sections: unknown section(s) {', '.join(sorted(unknown))} (decode, main, toy, train)")
        return 2
    if RUN.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: scripts.bench_gpu measures a GPU, nothing to do "
              "(--dry-run checks the script on the CPU)")
        return 0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    budget = Budget(args.minutes, args.out)
    dry = " -- a dry run: these numbers measure nothing" if args.dry_run else ""
    out = dict(machine=machine(RUN.device) + dry, skipped=[])
    device = torch.device(RUN.device)
    tile = set_row_tile(device, RUN.row_tile) if RUN.row_tile else None
    try:
        with tempfile.TemporaryDirectory() as work:  # the main job's checkpoint, for the toy section
            run_sections(args, out, budget, work)
    finally:
        if tile is not None:  # the process's own tile again (tests run main in their process)
            set_row_tile(device, tile)
    print(page(json.loads(json.dumps(out, default=str))))
    return 0


def run_sections(args, out, budget, work):
    sections = dict(
        decode=lambda: decode_section(args, out, budget),
        main=lambda: main_job_section(out, budget, work),
        toy=lambda: toy_section(args, out, budget, work),
        train=lambda: train_section(out, budget),
    )
    for name in args.sections.split(","):
        if budget.left() < 60:
            out["skipped"].append(name)
            continue
        t0 = time.perf_counter()
        print(f"[{name}] {budget.left():.0f} s left", flush=True)
        try:
            sections[name]()
        except Exception as e:  # a section that fails is reported, the others still run
            out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[{name}] failed: {e}", flush=True)
        out.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        budget.save(out)


if __name__ == "__main__":
    import sys

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
