"""Where a step's time goes: a MARS training step against an AR one, and one AR decoding
step against its forward and its kernels (docs/spec.md §3, §6). Not a test.

Both parts interleave what they compare (one AR step, one MARS step, one AR step, ...), so
a busy machine slows every mode alike and the ratios stay honest; each number is a
median. Wall time and process CPU time are both printed: on a shared machine the CPU
time (1 thread) is the steadier of the two.

  train   forward + backward + clip + AdamW of train.py's default batches (the AR stage's
          first rows), each loss from train.stage_losses in a train.StageLoss: ar, mars (as
          train.py runs it by default: fast/window.py's two-stream attention over only the
          noisy blocks the loss reads), mars-untrimmed (the same with the whole noisy stream:
          trim=False), mars-full (the textbook forward, mars.mars_loss: one (2l, 2l) mask
          tensor, as --fast_loss=false runs it).
  decode  generate.ar_decode (greedy AR with the KV cache, batch N): the time of a step;
          of its forward alone (model.hidden of one token per row against the cache +
          the LM head: what ar_decode runs per token, without the loop's bookkeeping);
          and of the forward's matmul / attention kernels (profiler self time of mm,
          addmm and sdpa). step - forward = the loop's overhead (generate.py);
          forward - kernels = the forward's own (masks, RoPE, cache writes, views).

    python -m scripts.bench_step train --threads=1
    python -m scripts.bench_step decode --threads=1 [--ckpt DIR] [--batch 1]
"""

import argparse
import copy
import os
import platform
import statistics
import time
from dataclasses import replace
from functools import partial

import torch

import train
from data.batches import make_batch, step_rows
from generate import ar_decode
from model import Qwen2
from settings import parse_settings

KERNELS = ("aten::mm", "aten::addmm", "aten::bmm")  # + every op whose name holds "scaled_dot_product"


def clocks():
    return time.perf_counter(), time.process_time()


def since(t0):
    t1 = clocks()
    return t1[0] - t0[0], t1[1] - t0[1]


def med(xs, i):
    return 1000 * statistics.median(x[i] for x in xs)


def default_model():
    S = parse_settings([])
    tok, ids = train.special_ids(S)
    return S, ids, train.initial_model(S, tok, ids)


# ----------------------------------------------------------------------------- training steps
def bench_train(steps, warmup):
    S, ids, model0 = default_model()
    if not os.path.isfile(os.path.join(S.data_dir, "train.npz")):
        from data.synthetic import build_default

        build_default(S.data_dir, S.seed)
    from data.prepare import load_npz

    data = load_npz(os.path.join(S.data_dir, "train.npz"))
    modes = {"ar": "ar", "mars": "mars", "mars-untrimmed": "mars", "mars-full": "mars"}
    nets, opts = {}, {}
    for m, stage in modes.items():
        model = copy.deepcopy(model0)
        ar_fn, mars_fn, layout = train.stage_losses(replace(S, fast_loss=m != "mars-full"), model, ids,
                                                    torch.device("cpu"))
        assert layout is None, "the eager losses only: compile=false"
        if m == "mars-untrimmed":  # mars_fn is fast.window.mars_loss_windowed with the run's settings
            mars_fn = partial(mars_fn, trim=False)
        net = train.StageLoss(model, ar_fn, mars_fn)
        net.stage = stage
        nets[m], opts[m] = net, train.make_optimizer(net, S, torch.device("cpu"))
    times = {m: [] for m in modes}
    n_train = len(data["offsets"]) - 1
    for step in range(warmup + steps):
        rows = step_rows(n_train, S.batch_size, S.seed, "ar", step)
        x, y, _ = make_batch(data, rows, S, ids, "cpu")
        for m, net in nets.items():
            t0 = clocks()
            net({"ids": x, "labels": y, "ar_teacher": None})[0].backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), S.grad_clip)
            opts[m].step()
            opts[m].zero_grad(set_to_none=True)
            if step >= warmup:
                times[m].append(since(t0))
    print(f"train: default model and batches ({S.batch_size} rows, B={S.block_size}), median of {steps} "
          f"interleaved steps after {warmup}")
    print(f"  {'mode':<14} {'wall ms':>8} {'x AR':>6} {'cpu ms':>8} {'x AR':>6} {'min cpu':>8} {'x AR':>6}")
    lo = {m: 1000 * min(t[1] for t in times[m]) for m in modes}
    for m in modes:
        print(f"  {m:<14} {med(times[m], 0):8.1f} {med(times[m], 0) / med(times['ar'], 0):6.2f} "
              f"{med(times[m], 1):8.1f} {med(times[m], 1) / med(times['ar'], 1):6.2f} "
              f"{lo[m]:8.1f} {lo[m] / lo['ar']:6.2f}")


# ----------------------------------------------------------------------------- decoding steps
def decode_step_times(model, prompts, n):
    """Seconds between successive tokens of generate.ar_decode (prefill excluded)."""
    it, out = ar_decode(model, prompts, n), []
    next(it)  # prefill + first token
    for _ in range(n - 1):
        t0 = clocks()
        next(it)
        out.append(since(t0))
    return out


@torch.no_grad()
def forward_times(model, prompts, n, profile=False):
    """What ar_decode runs per token, without its bookkeeping: one token per row against the
    cache, commit, LM head at that token. -> per-token seconds, or with profile=True the
    kernels' self time per token (profiler)."""
    N, L = len(prompts), max(map(len, prompts))
    cache = model.new_cache(N, L + n)  # as ar_decode makes it
    padded = torch.tensor([p + [0] * (L - len(p)) for p in prompts])
    model.hidden(padded, cache=cache)
    cache.commit(torch.tensor([len(p) for p in prompts]))
    tok = torch.zeros(N, 1, dtype=torch.long)

    def one():
        h = model.hidden(tok, cache=cache)  # (N, 1, C)
        cache.commit(1)
        return model.lm_head(h[:, -1])

    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(n):
                one()
        us = sum(e.self_cpu_time_total for e in p.key_averages()
                 if e.key in KERNELS or "scaled_dot_product" in e.key)
        return us / 1e6 / n
    out = []
    for _ in range(n):
        t0 = clocks()
        one()
        out.append(since(t0))
    return out


def bench_decode(ckpt, batch, n, repeats):
    model = (Qwen2.from_pretrained(ckpt) if ckpt else default_model()[2]).eval()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size - 2, (int(L),), generator=g).tolist()
               for L in torch.randint(32, 49, (batch,), generator=g)]
    step, fwd, kern = [], [], []
    for _ in range(repeats):  # interleaved: a busy machine slows all three alike
        step += decode_step_times(model, prompts, n)
        fwd += forward_times(model, prompts, n)
        kern.append(forward_times(model, prompts, n, profile=True))
    k = 1000 * statistics.median(kern)
    print(f"decode: {ckpt or 'random default-size model'} ({model.num_params() / 1e6:.2f}M params, "
          f"{cfg.num_hidden_layers} layers, width {cfg.hidden_size}, vocab {cfg.vocab_size}), batch {batch}, "
          f"prompts 32-48 tokens, {n} new tokens, medians over {repeats} runs")
    print(f"  step (generate.ar_decode)          {med(step, 0):7.3f} ms wall  {med(step, 1):7.3f} ms cpu")
    print(f"  forward (hidden + LM head)        {med(fwd, 0):7.3f} ms wall  {med(fwd, 1):7.3f} ms cpu")
    print(f"  kernels (mm, addmm, sdpa)         {k:7.3f} ms cpu (profiler self time)")
    print(f"  loop overhead    = step - forward   {med(step, 1) - med(fwd, 1):7.3f} ms cpu")
    print(f"  forward overhead = forward - kernels {med(fwd, 1) - k:6.3f} ms cpu")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("train", "decode"))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--steps", type=int, default=12, help="train: timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="train: untimed steps first")
    p.add_argument("--ckpt", help="decode: an HF-layout checkpoint (default: a random default-size model)")
    p.add_argument("--batch", type=int, default=1, help="decode: rows")
    p.add_argument("--new-tokens", type=int, default=64, help="decode: tokens per run")
    p.add_argument("--repeats", type=int, default=5, help="decode: interleaved runs")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"machine: cpu ({platform.machine()}, {os.cpu_count()} CPUs), torch {torch.__version__} with "
          f"{torch.get_num_threads()} thread(s); timings drift about ±15% on a shared machine")
    if a.what == "train":
        bench_train(a.steps, a.warmup)
    else:
        bench_decode(a.ckpt, a.batch, a.new_tokens, a.repeats)


if __name__ == "__main__":
    main()
