"""Wall-clock benchmark of MARS decoding and exact mode against AR decoding (docs/spec.md §6-7). Not a test.

On the same weights and machine, in one run, medians of --repeats timed runs:
  1. batch 1: our AR decoder (KV cache) vs transformers' `generate` (greedy, its cache) and
     transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`, a draft-free
     speculative decoder: the peer MARS competes with), then MARS without a cache and with
     the sliding-window cache;
  2. each batch size: transformers' `generate` (left-padded batch), MARS without a cache,
     with the block cache for each B_cache, and with the window cache, vs our AR decoder;
  3. with --drafts, at batch 1 and each batch size: exact mode (exact.py) for each K <= B.
     Its output must equal our AR's token for token: each row says so, and the script exits
     with status 1 if one does not. Exact mode forwards groups of K masks whatever B is (B
     only bounds K).
Each MARS row is repeated for every τ of --taus. tokens/s counts generated tokens of all
rows; tokens/forward is generated tokens over model forwards (summed over rows; for
transformers, its forward calls, counted by a hook). The paper reports 1.34-1.71x for the
block cache at batch 4-16 on a 7B model and a GPU (§7). A random model is rarely confident
and drafts badly, so without --ckpt (a random, deliberately peaked tiny model is built) the
numbers only measure the machinery's overhead; --data-dir takes the prompts from the
synthetic test set.

  python -m scripts.bench_generate                       # random model, CPU
  python -m scripts.bench_generate --ckpt out/default/mars --data-dir data/default --taus 1,0.95,0.9,0.7 \\
      --block-cache-sizes 4,8,16,32,64 --batch-sizes 4,8,16 --drafts 2,3
  python -m scripts.bench_generate --ckpt out/mars --device cuda --dtype bfloat16
"""

import argparse
import sys
from functools import partial

import torch

from decoding import Generation
from exact import generate_exact
from generate import generate, generate_ar
from scripts.common import add_model_args, floats, ints, load_for_bench, machine, make_prompts, timed


def hf_runner(ckpt, dtype, device, prompts, max_new, eos_ids, lookup=0):
    """transformers' greedy generate on the same weights (the reference baseline), the prompts
    left-padded into one batch; lookup > 0: its prompt-lookup decoding with that many draft
    tokens per step (batch 1 only). A row's forwards: the batch's forward calls (counted by a
    hook) at batch 1; at batch > 1 its generated tokens (greedy emits one per forward while the
    row is still generating, the count our decoders report)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    calls = [0]
    hf.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, pad_token_id=0,
                          eos_token_id=list(eos_ids) or None, **extra)
    if lookup and len(prompts) > 1:
        raise ValueError("prompt-lookup decoding runs at batch 1 only")
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)

    @torch.no_grad()
    def run():
        calls[0] = 0
        out = hf.generate(input_ids=ids, attention_mask=attn, generation_config=gc)
        gens = []
        for row in out[:, L:].tolist():
            gen = row[: next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))]
            gens.append(Generation(gen, calls[0] if len(prompts) == 1 else len(gen)))
        return gens
    return run


def row(name, dt, n, forwards, ids=None, base=None, same_as=None):
    """Print one result line -> tokens/s. same_as: our AR's ids, to show whether they match."""
    speed = f"{(n / dt) / base:6.2f}x" if base else "      -"
    check = "" if same_as is None else "   == our AR" if ids == same_as else "   differs from our AR"
    print(f"  {name:<36} {n / dt:10.1f} tok/s {speed}   {n / max(forwards, 1):5.2f} tok/forward   "
          f"({n} tokens, {dt:.3f}s){check}", flush=True)
    return n / dt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="HF-layout checkpoint (default: build a random tiny model)")
    p.add_argument("--data-dir", help="take the prompts from DIR/test.jsonl (synthetic test set)")
    p.add_argument("--taus", "--tau", type=floats, default=[0.9], help="τ values, comma-separated")
    p.add_argument("--block-size", type=int, default=None, help="B (default: the checkpoint's, else 4)")
    p.add_argument("--block-cache-sizes", "--block-cache-size", type=ints, default=[32],
                   help="B_cache values of the block cache, comma-separated (e.g. 4,8,16,32,64)")
    p.add_argument("--drafts", type=ints, default=[],
                   help="K values of exact mode, comma-separated, each <= B (default: no exact rows)")
    p.add_argument("--draft-threshold", type=float, default=0.0, help="exact mode's draft threshold")
    p.add_argument("--prompt-lookup", type=int, default=10,
                   help="draft tokens of transformers' prompt-lookup decoding (0 = skip it)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=ints, default=[4, 8, 16])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median), after a warm-up")
    p.add_argument("--no-window", action="store_true", help="skip the batched window-cache rows")
    add_model_args(p)
    return p.parse_args(argv)


def bench_batch(args, ck, B, prompts, first):
    """Every row of one batch (first: the batch-1 section, with prompt lookup and no block
    cache) -> the number of exact-mode rows whose tokens differ from our AR's."""
    model, n_new, reps, dev = ck.model, args.max_new_tokens, args.repeats, args.device
    kw = dict(max_new_tokens=n_new, mask_id=ck.mask_id, eos_ids=ck.eos_ids)
    mars = lambda tau, cache, bc=None: partial(generate, model, prompts, block_size=B, tau=tau, cache=cache,
                                               block_cache_size=bc, **kw)
    hf = lambda k=0: hf_runner(ck.path, getattr(torch, args.dtype), dev, prompts, n_new, ck.eos_ids, lookup=k)
    print(f"batch {len(prompts)}")
    t = timed(partial(generate_ar, model, prompts, n_new, ck.eos_ids), reps, dev)
    ar, ar_ids = row("our AR (KV cache)", *t), t[3]
    row("HF generate (greedy)" if first else "HF generate (greedy, left-padded)", *timed(hf(), reps, dev),
        base=ar, same_as=ar_ids)
    if first and args.prompt_lookup:
        row(f"HF prompt lookup ({args.prompt_lookup} drafts)", *timed(hf(args.prompt_lookup), reps, dev),
            base=ar, same_as=ar_ids)
    for tau in args.taus:
        row(f"MARS no cache tau={tau}", *timed(mars(tau, "none"), reps, dev), base=ar)
        for bc in [] if first else args.block_cache_sizes:
            row(f"MARS block tau={tau} B_cache={bc}", *timed(mars(tau, "block", bc), reps, dev), base=ar)
        if first or not args.no_window:
            row(f"MARS window tau={tau}", *timed(mars(tau, "window"), reps, dev), base=ar)
    differ = 0
    for K in args.drafts:
        t = timed(partial(generate_exact, model, prompts, block_size=B, drafts=K,
                          draft_threshold=args.draft_threshold, **kw), reps, dev)
        row(f"exact K={K}", *t, base=ar, same_as=ar_ids)
        differ += t[3] != ar_ids
    return differ


def main(argv=None):
    """Batch 1, then each --batch-sizes; exit status 1 if an exact-mode row differs from our AR."""
    args = parse_args(argv)
    ck = load_for_bench(args, "bench_mars_")
    B = args.block_size or ck.block_size or 4
    if not all(1 <= K <= B for K in args.drafts):
        raise SystemExit(f"--drafts {args.drafts}: each K must be 1..B (B={B})")
    prompts_of = lambda n: make_prompts(ck.tok, ck.model.config.vocab_size, ck.mask_id, n,
                                        data_dir=args.data_dir)
    exact = f" K={args.drafts} draft_threshold={args.draft_threshold}" if args.drafts else ""
    print(machine(args.device))
    print(f"checkpoint {args.ckpt or ck.path + ' (random)'}: {ck.model.num_params() / 1e6:.2f}M params, "
          f"{args.dtype}; prompts {'from ' + args.data_dir if args.data_dir else 'built in'}; B={B} "
          f"taus={args.taus} B_cache={args.block_cache_sizes}{exact} max_new_tokens={args.max_new_tokens} "
          f"eos={list(ck.eos_ids)}; median of {args.repeats} runs")
    differ = bench_batch(args, ck, B, prompts_of(1), first=True)
    for bs in args.batch_sizes:
        differ += bench_batch(args, ck, B, prompts_of(bs), first=False)
    if differ:
        print(f"{differ} exact-mode run(s) differ from our AR", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
