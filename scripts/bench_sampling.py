"""Wall-clock benchmark of sampling (issue 13): exact mode with speculative sampling and
τ-gated MARS sampling against our AR sampler. Not a test.

On the same weights and machine, in one run, medians of --repeats timed runs, for each
batch size and each temperature of --temperatures: our AR sampler (the baseline of that
temperature: speed is relative to it), exact mode for each K (speculative sampling: the AR
distribution at 1 + accepted drafts tokens per forward) and τ-gated MARS sampling at τ = --tau
(window cache; not the AR distribution). tokens/forward = generated tokens over model
forwards, both summed over rows. Each run draws from fresh per-row generators seeded
--seed + row, so every repeat decodes the same tokens. Greedy decoding (temperature 0, where
exact mode must equal AR token for token) is scripts/bench_generate.py's, with --drafts.

A random model drafts badly (nearly every draft is rejected: about 1 token per forward,
and each forward is larger than AR's), so without --ckpt the numbers only measure the
overhead; a trained MARS checkpoint is what can accept drafts.

  python -m scripts.bench_sampling --threads 1                 # random tiny model, CPU
  python -m scripts.bench_sampling --ckpt out/default/mars --data-dir data/default --threads 1
"""

import argparse
from functools import partial

from checkpoint import DEFAULT_BLOCK_SIZE
from exact import generate_exact
from generate import generate, generate_ar
from sampling import Sampling
from scripts.common import add_model_args, floats, ints, load_for_bench, machine, make_prompts, timed


def row(name, result, base=None):
    dt, n, forwards, _ = result
    speed = f"{base[0] / dt:5.2f}x" if base else "    -"
    print(f"  {name:<30} {n / dt:9.1f} tok/s {speed}   {n / forwards:5.2f} tok/forward   "
          f"({n} tokens, {forwards} forwards, {dt:.3f}s)")


def bench_batch(args, ck, B, prompts):
    """All rows of one batch size."""
    model, mask_id, reps, dev = ck.model, ck.mask_id, args.repeats, args.device
    common = dict(max_new_tokens=args.max_new_tokens, eos_ids=ck.eos_ids)
    exact = lambda K, s: partial(generate_exact, model, prompts, block_size=B, drafts=K, mask_id=mask_id,
                                 draft_threshold=args.draft_threshold, sampling=s, **common)
    for T in args.temperatures:
        s = Sampling(temperature=T, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        ar_s = timed(partial(generate_ar, model, prompts, sampling=s, **common), reps, dev)
        row(f"AR sampling T={T}", ar_s)
        for K in args.drafts:
            row(f"exact sampling T={T} K={K}", timed(exact(K, s), reps, dev), base=ar_s)
        mars = partial(generate, model, prompts, block_size=B, tau=args.tau, mask_id=mask_id, cache="window",
                       sampling=s, **common)
        row(f"MARS tau={args.tau} T={T} window", timed(mars, reps, dev), base=ar_s)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="HF-layout checkpoint (default: build a random tiny model)")
    p.add_argument("--data-dir", help="take the prompts from DIR/test.jsonl (synthetic test set)")
    p.add_argument("--block-size", type=int, help="B (default: the checkpoint's, else "
                   f"{DEFAULT_BLOCK_SIZE})")
    p.add_argument("--drafts", type=ints, default=[2, 4], help="K values of exact mode, comma-separated")
    p.add_argument("--batch-sizes", type=ints, default=[1, 4])
    p.add_argument("--temperatures", type=floats, default=[0.7, 1.0])
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tau", type=float, default=0.9, help="τ of the MARS sampling rows")
    p.add_argument("--draft-threshold", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    add_model_args(p)
    args = p.parse_args()
    ck = load_for_bench(args, "bench_sampling_")
    B = args.block_size or ck.block_size or DEFAULT_BLOCK_SIZE
    args.drafts = [K for K in args.drafts if K <= B]
    print(machine(args.device))
    print(f"checkpoint {args.ckpt or ck.path + ' (random)'}: {ck.model.num_params() / 1e6:.1f}M params, "
          f"{args.dtype}")
    print(f"B={B} K={args.drafts} max_new_tokens={args.max_new_tokens} eos={list(ck.eos_ids)} "
          f"top_k={args.top_k} top_p={args.top_p} seed={args.seed} tau={args.tau}; "
          f"median of {args.repeats} runs; speed is against the AR row of the same temperature")
    for bs in args.batch_sizes:
        prompts = make_prompts(ck.tok, ck.model.config.vocab_size, ck.mask_id, bs, data_dir=args.data_dir)
        print(f"batch {bs}")
        bench_batch(args, ck, B, prompts)


if __name__ == "__main__":
    main()
