"""The decode section: our decoders (the reference loops through the engine, eager and compiled,
and the device loops of fast/loop.py) and HF generate on one random 0.5B-shaped model, bf16.

Every row is timed twice over: the whole request (prefill included: tokens/s, ms/forward) and
a request of one new token (the prefill alone), so the steady state is apart: ms/step after the
prefill = (whole - prefill) / (forwards - 1). For the device loops and the compiled AR and exact
K = 2 step loops, one more run each under observation (untimed): the host syncs per token (CUDA's
sync debug mode counts them) and the kernels per forward (torch.profiler; on the CPU of a dry
run, the operators).

Order: the eager rows (seconds), then the device loops (what issue 49's targets read), HF's
static cache (their anchor), then the compiled step loops, each only while the budget holds it.
"""

import re
import tempfile
import warnings

import torch

from exact import generate_exact
from fast.linear import set_row_tile
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
from scripts.bench_gpu import common
from scripts.bench_gpu.common import empty_cache, engine, graph_count, prompts, random_05b, sync, timed

B = 4  # the mask block of the τ window and exact mode (the random model's is noise anyway)


def our_decoders(model):
    """name -> decode(prompts, new tokens) -> Generations: the reference loops (generate.py,
    exact.py) on the engine."""
    out = {
        "AR": lambda p, n: generate_ar(model, p, n),
        "tau=0.95 window": lambda p, n: generate(model, p, block_size=B, tau=0.95, max_new_tokens=n,
                                                 mask_id=common.RUN.mask_id),
    }
    for K in (1, 2, 4):
        out[f"exact K={K}"] = lambda p, n, K=K: generate_exact(model, p, block_size=B, drafts=K,
                                                               max_new_tokens=n, mask_id=common.RUN.mask_id)
    return out


def device_loops(model):
    """name -> decode(prompts, new tokens): fast/loop.py's loops, each step compiled whole
    (CUDA graphs on a GPU), one host read per 8 steps."""
    step = compiled_steps(torch.device(common.RUN.device))
    out = {
        "AR device loop compiled": lambda p, n: generate_ar_device(model, p, n, (), 8, step[ar_step]),
        "tau=0.95 window device loop compiled": lambda p, n: generate_window_device(
            model, p, B, 0.95, n, common.RUN.mask_id, (), 8, step[window_step]),
    }
    for K in (2, 4):
        out[f"exact K={K} device loop compiled"] = lambda p, n, K=K: generate_exact_device(
            model, p, K, n, common.RUN.mask_id, (), 8, step[exact_step])
    return out


def run_ours(model, step, name, dec, p, new, res, observe=False):
    """Warm up (and compile) one decoder on one batch of prompts p, then time it (twice,
    compiled) and its prefill alone -> its row, appended to res. model: a fast.FastQwen2; step:
    its compiled step (engine), or None: eager; dec(p, n) -> Generations. observe: also count
    its syncs per token and kernels per forward (one more run each, profiled: seconds)."""
    switch_step(model, step)
    graphs0 = graph_count()
    dec(p, new), dec(p, 1)  # warm-up: compiles this shape when compiled
    warm = graph_count()
    times, gens = [], None
    for _ in range(2 if step or name.endswith("compiled") else 1):  # compiled: the best of two
        dt, gens = timed(lambda: dec(p, new))
        times.append(dt)
    prefill = min(timed(lambda: dec(p, 1))[0] for _ in range(2))
    tokens, forwards = sum(len(g.ids) for g in gens), max(g.forwards for g in gens)
    dt = min(times)
    row = dict(
        decoder=name + (" compiled" if step else ""),
        batch=len(p),
        tokens_per_s=tokens / dt,
        ms_per_forward=1000 * dt / forwards,
        steady_ms_per_forward=1000 * (dt - prefill) / max(forwards - 1, 1),
        tokens_per_forward=tokens / sum(g.forwards for g in gens),
        graphs_at_warmup=warm - graphs0,
        ids=[g.ids for g in gens],
    )
    if observe:
        row["syncs_per_token"] = per(syncs(lambda: dec(p, new)), tokens / len(p))
        row["kernels_per_forward"] = per(kernels(lambda: dec(p, new)), forwards)
    row["recompiles_after_warmup"] = graph_count() - warm
    switch_step(model, None)
    res.append(row)
    return row


def per(count, n):
    return None if count is None else count / n


def syncs(fn):
    """Host syncs of one run of fn (CUDA's sync debug mode warns at each), or None on the CPU."""
    if common.RUN.device != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def kernels(fn):
    """GPU kernels launched by one run of fn (torch.profiler; copies and memsets not counted);
    on the CPU the operators run (a dry run's stand-in)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = common.RUN.device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    if not cuda:
        return len(prof.events())
    return sum(e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
               for e in prof.events())


def hf_rows(model, batches, new, res, budget, impls=("static", "dynamic")):
    """HF generate on the same weights: static cache (compiled by HF: the anchor), dynamic."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        try:
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16)
        hf = hf.to(common.RUN.device).eval()
    for impl in impls:
        for batch in batches:
            if budget.left() > 60:
                res.append(hf_one(hf, impl, batch, new))


@torch.no_grad()
def hf_one(hf, impl, batch, new):
    p = prompts(batch, seed=batch)
    L = max(map(len, p))
    device = common.RUN.device
    ids = torch.tensor([[0] * (L - len(x)) + x for x in p], device=device)  # left-padded, as HF wants
    att = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in p], device=device)

    def run(n):
        kw = dict(attention_mask=att, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if impl == "static":
            kw["cache_implementation"] = "static"
        return hf.generate(ids, **kw)

    run(new), run(1)  # warm-up (static: HF compiles its forward)
    dt = min(timed(lambda: run(new))[0] for _ in range(2))
    prefill = min(timed(lambda: run(1))[0] for _ in range(2))
    return dict(
        decoder=f"HF generate ({impl} cache)",
        batch=batch,
        tokens_per_s=batch * new / dt,
        ms_per_forward=1000 * dt / new,
        steady_ms_per_forward=1000 * (dt - prefill) / (new - 1),
        tokens_per_forward=1.0,
        syncs_per_token=per(syncs(lambda: run(new)), new),
    )


def decode_section(args, out, budget):
    model = random_05b()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw, name = common.bandwidth()
    out["decode"] = dict(model=common.RUN.model + ", bf16", params=model.num_params(), weight_bytes=nbytes,
                         card=name, bandwidth=bw, new_tokens=args.new_tokens, rows=[])
    rows, new, batches = out["decode"]["rows"], args.new_tokens, args.batch_sizes
    model, step = engine(model)
    decs = our_decoders(model)
    for batch in batches:  # eager: no compile, a few seconds each
        for name, dec in decs.items():
            if budget.left() > 30:
                run_ours(model, None, name, dec, prompts(batch, seed=batch), new, rows)
    budget.save(out)
    loops = device_loops(model)  # the targets' rows first: AR and exact K = 2 at every batch
    order = [(n, b) for n in ("AR device loop compiled", "exact K=2 device loop compiled") for b in batches]
    order += [(n, b) for n in ("tau=0.95 window device loop compiled", "exact K=4 device loop compiled")
              for b in batches]
    for name, batch in order:
        if budget.left() > 120:
            run_ours(model, None, name, loops[name], prompts(batch, seed=batch), new, rows, observe=True)
            budget.save(out)
    if budget.left() > 120:  # the anchor: HF's static cache, then its dynamic one
        hf_rows(model, batches, new, rows, budget)
        budget.save(out)
    order = [(n, b) for n in ("AR", "exact K=2") for b in batches]  # the compiled step loops
    order += [(n, b) for n in ("tau=0.95 window", "exact K=1", "exact K=4") for b in batches]
    for name, batch in order:
        if budget.left() > 150:  # the targets' step loops observed too: their syncs and kernels
            run_ours(model, step, name, decs[name], prompts(batch, seed=batch), new, rows,
                     observe=name in ("AR", "exact K=2"))
            budget.save(out)
    alone_rows(model, step, args, out, budget)
    tile_rows(model, loops, new, out, budget)
    out["exact"] = exact_checks(rows)
    del model
    empty_cache()


def tile_rows(model, loops, new, out, budget):
    """The device loops' AR and exact K = 2 at batch 1 with smaller row tiles than the GPU's 128
    (fast/linear.py: every matmul call has exactly that many rows; each tile is as row-invariant
    as another, so exact = AR must hold at each): "AR device loop compiled, tile 16" etc. The
    dry run tries a CPU tile of 4."""
    device, rows = model.lm_head.weight.device, out["decode"]["rows"]
    for tile in (16, 32, 64) if device.type == "cuda" else (4,):
        for name in ("AR device loop compiled", "exact K=2 device loop compiled"):
            if budget.left() > 120:
                old = set_row_tile(device, tile)
                try:
                    run_ours(model, None, name, loops[name], prompts(1, seed=1), new, rows)
                finally:
                    set_row_tile(device, old)
                rows[-1]["decoder"] += f", tile {tile}"
        budget.save(out)


def alone_rows(model, step, args, out, budget):
    """AR alone = AR in the batch (eager, and compiled where the batch was compiled): each
    prompt of the batch decoded alone against the batch's timed run."""
    by = {(r["decoder"], r["batch"]): r["ids"] for r in out["decode"]["rows"] if "ids" in r}  # not HF's
    out["alone"] = []
    for compiled in (None, step):
        name = "AR compiled" if compiled else "AR"
        for batch in args.batch_sizes[1:]:
            if (name, batch) in by and budget.left() > 60:
                switch_step(model, compiled)
                alone = [generate_ar(model, [x], args.new_tokens)[0].ids for x in prompts(batch, seed=batch)]
                switch_step(model, None)
                out["alone"].append(dict(check=f"{name} alone = {name} in the batch", batch=batch, rows=batch,
                                         rows_equal=sum(a == b for a, b in zip(alone, by[name, batch]))))


def ar_of(rows):
    """-> a function: a row -> the AR row of its batch and kind (what its name says after the
    decoder: "", " compiled", " device loop compiled", " device loop compiled, tile 16"), or None."""
    def kind(r):
        return r["batch"], re.sub(r"^(AR|exact K=\d+|tau=[\d.]+ window)", "", r["decoder"])

    ar = {kind(r): r for r in rows if r["decoder"].startswith("AR")}
    return lambda r: ar.get(kind(r))


def exact_checks(rows):
    """Exact = AR at each batch: eager against eager AR, compiled against compiled AR, the device
    loop against the AR device loop."""
    ar = ar_of(rows)
    return [
        dict(check=f"{r['decoder']} = {a['decoder']}", batch=r["batch"], rows=len(r["ids"]),
             rows_equal=sum(x == y for x, y in zip(r["ids"], a["ids"])))
        for r in rows
        if r["decoder"].startswith("exact") and (a := ar(r)) is not None
    ]
