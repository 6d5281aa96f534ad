"""Wall-clock benchmark of MARS decoding against AR decoding (MARS_SPEC §6-7). Not a test.

On the same weights and machine, in one run, medians of --repeats timed runs:
  1. batch 1: our AR decoder (KV cache) vs transformers' `generate` (greedy, its cache);
  2. batch 1: MARS, sliding-window cache, vs our AR decoder;
  3. batch 4/8/16: MARS, block cache, (and window cache) vs our AR decoder, batched.
tokens/s counts generated tokens of all rows; tokens/forward is generated tokens over
model forwards (summed over rows). The paper reports 1.34-1.71x for the block cache at
batch 4-16 on a 7B model and a GPU; a random model is rarely confident, so without
--ckpt (a random, deliberately peaked tiny model is built) the numbers only measure
the machinery's overhead.

  python bench_generate.py                       # random model, CPU
  python bench_generate.py --ckpt out/mars --device cuda --dtype bfloat16
"""

import argparse
import statistics
import tempfile
import time
from functools import partial

import torch

from generate import checkpoint_eos_ids, generate, generate_ar, load_tokenizer
from model import Qwen2, Qwen2Config, init_weights

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
]


def random_checkpoint(path, seed=0):
    """A small random Qwen2 saved in HF layout. A large init std makes the output peaked,
    so that some mask predictions pass τ and the multi-token path is exercised."""
    cfg = Qwen2Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True)
    init_weights(Qwen2(cfg), std=0.5, seed=seed).save_pretrained(path)
    return path


def make_prompts(tok, vocab_size, mask_id, n, seed=0):
    """n prompts: chat-templated questions with a tokenizer, else random ids (32-48 tokens)."""
    if tok is not None:
        return [tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 49, (n,), generator=g).tolist()
    return [[t for t in torch.randint(0, vocab_size, (L,), generator=g).tolist() if t != mask_id] or [1]
            for L in lengths]


def timed(fn, repeats, device):
    """fn() -> list of Generation. Warm up once, then the median over `repeats` runs
    -> (seconds, generated tokens, forwards summed over rows)."""
    def once():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    once()
    runs = [once() for _ in range(repeats)]
    dt = statistics.median(t for t, _ in runs)
    out = runs[0][1]
    return dt, sum(len(g.ids) for g in out), sum(g.forwards for g in out)


def hf_runner(ckpt, dtype, device, prompts, max_new, eos_ids):
    """transformers' greedy generate on the same weights (the reference baseline)."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from generate import Generation
    hf = Qwen2ForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, pad_token_id=0,
                          eos_token_id=list(eos_ids) or None)
    ids = torch.tensor(prompts, device=device)

    @torch.no_grad()
    def run():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        gen = out[0, ids.shape[1]:].tolist()
        gen = gen[: next((i + 1 for i, t in enumerate(gen) if t in eos_ids), len(gen))]
        return [Generation(gen, len(gen))]  # HF: one forward per token
    return run


def row(name, dt, n, forwards, base=None):
    speed = f"{(n / dt) / base:6.2f}x" if base else "      -"
    print(f"  {name:<34} {n / dt:10.1f} tok/s {speed}   {n / forwards:5.2f} tok/forward   "
          f"({n} tokens, {dt:.3f}s)")
    return n / dt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="HF-layout checkpoint (default: build a random tiny model)")
    p.add_argument("--tau", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--block-cache-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mask-id", type=int, help="default: the tokenizer's <|mask|>, else vocab_size-1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = args.ckpt or random_checkpoint(tempfile.mkdtemp(prefix="bench_mars_"))
    dtype = getattr(torch, args.dtype)
    model = Qwen2.from_pretrained(ckpt, dtype, args.device).eval()
    tok = load_tokenizer(ckpt)
    mask_id = args.mask_id if args.mask_id is not None else (
        tok.mask_id if tok is not None else model.config.vocab_size - 1)
    eos_ids = checkpoint_eos_ids(ckpt, tok)
    n_new, B, tau, reps = args.max_new_tokens, args.block_size, args.tau, args.repeats
    mars = lambda ps, cache: lambda: generate(
        model, ps, block_size=B, tau=tau, max_new_tokens=n_new, mask_id=mask_id, eos_ids=eos_ids,
        cache=cache, block_cache_size=args.block_cache_size)
    print(f"checkpoint {args.ckpt or ckpt + ' (random)'}: {model.num_params() / 1e6:.1f}M params, "
          f"{args.device} {args.dtype}, threads {torch.get_num_threads()}; tau={tau} B={B} "
          f"B_cache={args.block_cache_size} max_new_tokens={n_new} eos={list(eos_ids)} "
          f"median of {reps}")

    one = make_prompts(tok, model.config.vocab_size, mask_id, 1)
    print("batch 1")
    ar = row("our AR (KV cache)", *timed(partial(generate_ar, model, one, n_new, eos_ids), reps, args.device))
    row("HF generate (greedy)", *timed(hf_runner(ckpt, dtype, args.device, one, n_new, eos_ids), reps,
                                       args.device), base=ar)
    row(f"MARS window tau={tau}", *timed(mars(one, "window"), reps, args.device), base=ar)
    for bs in map(int, args.batch_sizes.split(",")):
        prompts = make_prompts(tok, model.config.vocab_size, mask_id, bs)
        print(f"batch {bs}")
        ar = row("our AR (KV cache)", *timed(partial(generate_ar, model, prompts, n_new, eos_ids), reps,
                                              args.device))
        row(f"MARS block tau={tau} B_cache={args.block_cache_size}",
            *timed(mars(prompts, "block"), reps, args.device), base=ar)
        row(f"MARS window tau={tau}", *timed(mars(prompts, "window"), reps, args.device), base=ar)


if __name__ == "__main__":
    main()
