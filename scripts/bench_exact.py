"""Wall-clock benchmark of exact mode (exact.py) against AR decoding and MARS τ-gating. Not a test.

On the same weights and machine, in one run, medians of --repeats timed runs, for each
batch size: our AR decoder (generate.generate_ar, KV cache: the baseline), MARS at
τ = --tau (generate.generate, window cache) for each B, and exact mode for each K <= B.
Exact mode forwards groups of K masks whatever B is (B only bounds K), so its rows for
the same K differ across B by timing noise only. tokens/forward = generated tokens over
model forwards, both summed over rows. Exact mode's output must equal AR's token for
token: each row says so, and the script exits with status 1 if one does not.

A random model drafts badly (nearly every draft is rejected: about 1 token per forward,
and each forward is larger than AR's), so without --ckpt the numbers only measure the
overhead; a trained MARS checkpoint is what can accept drafts.

  python -m scripts.bench_exact                               # random tiny model, CPU
  python -m scripts.bench_exact --ckpt out/default/mars --device cuda --dtype bfloat16
"""

import argparse
import sys
from functools import partial

from exact import generate_exact
from generate import generate, generate_ar
from scripts.common import add_model_args, ints, load_for_bench, machine, make_prompts, timed


def row(name, result, base=None, same=None):
    dt, n, forwards, _ = result
    speed = f"{base[0] / dt:5.2f}x" if base else "    -"
    check = "" if same is None else ("   == AR" if same else "   DIFFERS FROM AR")
    print(f"  {name:<26} {n / dt:9.1f} tok/s {speed}   {n / forwards:5.2f} tok/forward   "
          f"({n} tokens, {forwards} forwards, {dt:.3f}s){check}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="HF-layout checkpoint (default: build a random tiny model)")
    p.add_argument("--data-dir", help="take the prompts from DIR/test.jsonl (synthetic test set)")
    p.add_argument("--drafts", type=ints, default=[2, 4], help="K values, comma-separated")
    p.add_argument("--block-sizes", type=ints, default=[4, 8], help="B values, comma-separated")
    p.add_argument("--batch-sizes", type=ints, default=[1, 4])
    p.add_argument("--tau", type=float, default=0.95, help="τ of the MARS rows")
    p.add_argument("--draft-threshold", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    add_model_args(p)
    args = p.parse_args()
    ck = load_for_bench(args, "bench_exact_")
    ckpt, model, tok, mask_id, eos_ids = ck.path, ck.model, ck.tok, ck.mask_id, ck.eos_ids
    n_new, reps, dev = args.max_new_tokens, args.repeats, args.device
    print(machine(dev))
    print(f"checkpoint {args.ckpt or ckpt + ' (random)'}: {model.num_params() / 1e6:.1f}M params, "
          f"{args.dtype}")
    print(f"max_new_tokens={n_new} eos={list(eos_ids)} K={args.drafts} B={args.block_sizes} "
          f"tau={args.tau} draft_threshold={args.draft_threshold}; median of {reps} runs")
    differ = 0
    for bs in args.batch_sizes:
        prompts = make_prompts(tok, model.config.vocab_size, mask_id, bs, data_dir=args.data_dir)
        print(f"batch {bs}")
        common = dict(max_new_tokens=n_new, eos_ids=eos_ids)
        ar = timed(partial(generate_ar, model, prompts, **common), reps, dev)
        row("our AR (KV cache)", ar)
        for B in args.block_sizes:
            mars = partial(generate, model, prompts, block_size=B, tau=args.tau, mask_id=mask_id,
                           cache="window", **common)
            row(f"MARS tau={args.tau} B={B} window", timed(mars, reps, dev), base=ar)
            for K in (k for k in args.drafts if k <= B):
                ex = timed(partial(generate_exact, model, prompts, block_size=B, drafts=K, mask_id=mask_id,
                                   draft_threshold=args.draft_threshold, **common), reps, dev)
                row(f"exact K={K} B={B}", ex, base=ar, same=ex[3] == ar[3])
                differ += ex[3] != ar[3]
    if differ:
        print(f"{differ} exact run(s) differ from AR", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
