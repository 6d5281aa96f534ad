"""Training step cost of MARS against plain AR SFT (docs/spec.md §3, §7). Not a test.

A MARS step forwards [clean | noisy], 2l tokens per row of l (l + W with the engine's window,
fast/window.py: only the noisy blocks the loss reads), so its cost per step is about twice
AR SFT's: the projections and MLP double, attention over 2l is up to 4x but small at these
lengths, and the LM head runs on the loss targets only (twice: once per stream, once with
w_ar = 0). The paper reports about 2x the AR SFT time and about 1.5x
its peak memory (§7). Both modes run the same rows (the AR stage's first steps of
train.py), the same optimizer and code path (train.stage_losses in a train.StageLoss: the
engine's MARS loss by default, --fast_loss=false the textbook one); a step is forward +
backward + clip + AdamW, timed as the median of --steps steps after --warmup steps.
tokens/s counts the real tokens of the rows (padding excluded), as train.py logs.
--dtype (comma-separated, float32,bfloat16 by default) runs every mode in each compute dtype
(train.py's: autocast over fp32 weights, util/precision.py) on the same rows: x fp32 is the
first dtype's step time over this one's, same mode.

    python -m scripts.bench_train                                # the default tiny config, CPU
    python -m scripts.bench_train --n_layer=8 --n_embd=256 --block_size=8 --modes=ar,mars,mars-noar
    python -m scripts.bench_train --config configs/qwen2.5-0.5b-24gb.json --init_from=DIR --data_dir=DIR

Every train.py setting (`--key=value`, `--config FILE`) applies; its data set is used
(data/default is built if absent). Peak memory is reported on CUDA.
"""

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

import train
from data.batches import batch_rows, make_batch
from data.prepare import load_npz
from scripts.common import dtype_list, machine
from settings import Settings, parse_settings
from util.precision import autocast, compute_dtype, dtype_name

MODES = {  # name -> (train.py stage, setting overrides)
    "ar": ("ar", {}),
    "mars": ("mars", {}),
    "mars-noar": ("mars", {"w_ar": 0.0}),
    "bidir": ("mars", {"bidirectional": True}),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_mode(model0, S, stage, data, special, device, steps, warmup):
    """Median seconds per optimizer step, real tokens per step, CUDA peak bytes (or None)."""
    model = copy.deepcopy(model0).to(device)
    model.gradient_checkpointing = S.gradient_checkpointing
    ar_fn, mars_fn, layout = train.stage_losses(S, model, special, device)  # as train.py wires them
    net = train.StageLoss(model, ar_fn, mars_fn)
    net.stage = stage
    opt = train.make_optimizer(net, S, device)
    amp = autocast(device, compute_dtype(S.dtype, device))
    static = layout is not None  # as train.wrap: the static step compiled whole, one graph per shape
    runner = torch.compile(net, fullgraph=static, dynamic=False if static else None) if S.compile else net
    accum, mb = S.batch_size // S.micro_batch_size, S.micro_batch_size
    times, tokens = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(warmup + steps):
        rows = batch_rows(data, S, "ar", step)  # the same rows for every mode
        batches = [micro_batch(data, rows[m * mb:(m + 1) * mb], S, special, device, layout)
                   for m in range(accum)]
        sync(device)
        t0 = time.perf_counter()
        for batch, _ in batches:
            with amp:
                loss = runner(batch)[0]
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), S.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(sum(n for *_, n in batches))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, net, opt, runner
    return statistics.median(times), statistics.mean(tokens), peak


def micro_batch(data, part, S, special, device, layout):
    """Rows `part` -> (StageLoss's batch on `device`, real tokens), as train.step_batch makes it
    (without a teacher): made on the host and laid out by the engine's `layout` if it has one."""
    x, y, n_tok = make_batch(data, part, S, special, "cpu" if layout else device)
    batch = {"ids": x, "labels": y, "ar_teacher": None}
    return (layout(batch, device) if layout else batch), n_tok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Any other --key=value is a train.py setting (see settings.Settings).")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--modes", default="ar,mars", help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--dtype", default="float32,bfloat16", type=dtype_list,
                   help="compute dtypes, comma-separated, each timed on the same rows")
    a, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    modes = a.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {unknown}: choose from {list(MODES)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    S = parse_settings(rest)
    if not os.path.isfile(os.path.join(S.data_dir, "train.npz")):
        if S.data_dir != Settings.data_dir:
            raise SystemExit(f"{S.data_dir}: no train.npz (make it with data/prepare.py)")
        from data.synthetic import build_default

        print(f"building the default data set in {S.data_dir}")
        build_default(S.data_dir, S.seed)
    data = load_npz(os.path.join(S.data_dir, "train.npz"))
    tok, special = train.special_ids(S)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if S.device == "auto" else S.device)
    model0 = train.initial_model(S, tok, special)
    cfg = model0.config
    print(machine(str(device)))
    print(f"model: {model0.num_params() / 1e6:.2f}M params ({cfg.num_hidden_layers} layers, width "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}); data {S.data_dir}; batch {S.batch_size} rows "
          f"(micro {S.micro_batch_size}); B={S.block_size}; median of {a.steps} steps after {a.warmup}")
    print(f"  {'dtype':<9} {'mode':<10} {'ms/step':>9} {'x AR':>6} {'tokens/s':>10} {'us/token':>9} "
          f"{'x AR':>6} {'x fp32':>7}" + ("   peak GiB   x AR" if device.type == "cuda" else ""))
    first = {}
    for name in a.dtype:
        dtype = dtype_name(compute_dtype(name, device))
        base = None
        for m in modes:
            stage, over = MODES[m]
            dt, n_tok, peak = bench_mode(model0, replace(S, dtype=dtype, **over), stage, data, special,
                                         device, a.steps, a.warmup)
            base, ref = base or (dt, dt / n_tok, peak), first.setdefault(m, dt)
            mem = f"   {peak / 2**30:8.3f}  {peak / base[2]:5.2f}" if peak is not None else ""
            print(f"  {dtype:<9} {m:<10} {1000 * dt:9.1f} {dt / base[0]:6.2f} {n_tok / dt:10.0f} "
                  f"{1e6 * dt / n_tok:9.2f} {dt / n_tok / base[1]:6.2f} {ref / dt:6.2f}x{mem}", flush=True)
    print(f"  (x AR: against the first of --modes, {modes[0]}, same dtype; x fp32: the first dtype's "
          "step over this one's, same mode)")


if __name__ == "__main__":
    main()
