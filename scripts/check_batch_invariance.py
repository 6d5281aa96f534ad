"""Manual check (not a test): on a real checkpoint, is a reply the same alone and in a batch, and is
exact mode AR? (issue 39; the tests prove it on tiny models and 2-3 prompts of SmolLM2.)

Greedy, the general chat prompts (data/prompts.py CHAT), in the dtype asked, through the engine
(fast.make_fast: batch invariance in bf16 is its claim, not the reference's): AR on each prompt
alone, AR in batches of --batch, exact mode for each K in batches and alone; for each, how many
replies equal AR alone, and where the first difference falls. Exit status 1 if one differs.

    python -m scripts.check_batch_invariance --ckpt out/smollm2 --dtype bfloat16 --threads 2
"""

import argparse
import sys
import time

import torch

import fast
from checkpoint import load_checkpoint
from data.prompts import CHAT
from exact import generate_exact
from generate import generate_ar
from scripts.common import ints, machine
from util.files import USER_ERRORS, error_line
from util.precision import choose_dtype, dtype_name


def batches(prompts, n):
    return [prompts[i:i + n] for i in range(0, len(prompts), n)]


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--drafts", type=ints, default=[1, 2, 4])
    p.add_argument("--alone-drafts", type=ints, default=[2], help="K of exact mode also run prompt by prompt")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    try:
        dtype, why = choose_dtype(args.dtype, "cpu")
        ck = load_checkpoint(args.ckpt, "cpu", dtype)
    except USER_ERRORS as e:
        return error_line(e)
    fast.make_fast(ck.model)
    print(machine("cpu"))
    print(f"{args.ckpt} in {dtype_name(dtype)} ({why}); {args.prompts} general prompts, "
          f"{args.new_tokens} new tokens, greedy, batches of {args.batch}")
    prompts = [ck.tok.encode_chat([{"role": "user", "content": c}], add_generation_prompt=True)
               for c in CHAT[:args.prompts]]
    model, n, B, eos = ck.model, args.new_tokens, ck.block_size or 4, ck.eos_ids
    t0 = time.perf_counter()
    alone = [generate_ar(model, [q], n, eos)[0].ids for q in prompts]
    runs = {f"AR in batches of {args.batch}": lambda: [g.ids for b in batches(prompts, args.batch)
                                                       for g in generate_ar(model, b, n, eos)]}
    for K in args.drafts:
        kw = dict(block_size=max(B, K), drafts=K, max_new_tokens=n, mask_id=ck.mask_id, eos_ids=eos)
        runs[f"exact K={K} in batches of {args.batch}"] = lambda kw=kw: [
            g.ids for b in batches(prompts, args.batch) for g in generate_exact(model, b, **kw)]
        if K in args.alone_drafts:
            runs[f"exact K={K} alone"] = lambda kw=kw: [generate_exact(model, [q], **kw)[0].ids
                                                        for q in prompts]
    bad = 0
    for name, run in runs.items():  # each line as soon as it is known: a slow machine keeps what ran
        replies = run()
        same = sum(a == b for a, b in zip(replies, alone))
        firsts = [first_difference(a, b) for a, b in zip(replies, alone) if a != b]
        bad += same < len(prompts)
        where = f" (first difference at token {min(firsts)}-{max(firsts)})" if firsts else ""
        print(f"  {name:<28} = AR alone on {same}/{len(prompts)}{where}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
