"""What a multi-token decoding step costs against an AR step (issue 22). Not a test.

On one checkpoint, in one run, for each batch size: the reference (float32, the plain model
of model.py, as `python generate.py` decodes) and, for each --dtype (comma-separated: float32
and bfloat16 side by side by default), the engine (fast.make_fast: weights packed for oneDNN,
row tiles in bf16, the block-maxima argmax; `generate.py --fast`), each running our AR decoder
(generate.ar_decode), the τ-gated loop with the window cache (generate.mars_decode, docs/spec.md
§5-§6) and exact mode for each K (exact.exact_steps), all greedy. The decoders run interleaved
step by step (one forward of each dtype's AR, τ, exact K=1, ..., then the next forward of each),
in rounds after one untimed warm-up round, on prompt r of the chat questions in round r, so a
machine that slows down or speeds up slows them alike; each number is the median over the
rounds of one round's value.

  ms/fwd     seconds per forward, the prefill excluded (the mean over a run's later steps)
  x AR       that, over the same round's AR value: what a step costs in AR steps
  tok/fwd    generated tokens per row and forward: all rows' tokens / (forwards x rows)
  limit      the speedup if a step cost an AR step: tok/fwd over AR's (= 1 per row)
  speedup    wall clock, AR's seconds per token over the decoder's (prefill included)
  x ref      (AR rows) the reference's AR ms/fwd over this AR's, same round: what the
             engine (and its dtype) buys an AR step

Every ratio but x ref is against the same engine's and dtype's AR. Exact mode must give that AR's
tokens (in bf16 too: fast/linear.py, fast/cache.py): each row says so, and the script exits with
status 1 if one does not. --profile adds, at batch 1, where one decoder's forward goes (profiler, one
run each): the linears, the LM head (the matmuls with V output columns), attention (sdpa),
the rest of the ops (norms, RoPE, masks, cache writes, the acceptance code), and what is
left of the wall time (Python and dispatch); host syncs = item() calls per forward.
--layouts times one forward's matmuls at 1-17 rows through F.linear (the weights as stored) and
from the weights packed for oneDNN (fast/linear.py; --unpacked drops the engine's packed copies,
so its decoders run on F.linear: the before / after).

  python -m scripts.bench_decode --ckpt out/smollm2 --threads 2 --batch-sizes 1,4,16
  python -m scripts.bench_decode --ckpt out/smollm2 --threads 2 --dtype float32 --profile --layouts
  python -m scripts.bench_decode --ckpt out/smollm2 --threads 2 --dtype auto --compile --drafts 2

--compile runs each engine decoder twice, eager and with its step compiled (fast.step.compile_step,
as `generate.py --compile`; the row "NAME compiled"): x eager is the compiled ms/fwd over the
eager one, =eager the share
of rows whose reply equals the eager reply (fusion may round differently), and a compiled
row's x AR and "== AR" are against the compiled AR. After each batch size: how many graphs
torch.compile built after the warm-up round (0: no recompile).
"""

import argparse
import contextlib
import statistics
import sys
import time

import torch

from exact import exact_steps
from fast.linear import FastLinear, pack
from fast.step import compile_step, switch_step
from generate import ar_decode, mars_decode
from scripts.common import QUESTIONS, add_model_args, dtype_list, ints, load_for_bench, machine, make_prompts
from util.precision import dtype_name


def decoders(args, model, mask_id, eos_ids):
    """name -> prompts -> a greedy step generator, AR first (the reference of every ratio);
    with --compile (engines only) each again as "NAME compiled", its steps through the compiled step."""
    n, B = args.new_tokens, args.block_size
    out = {"our AR": lambda p: ar_decode(model, p, n, eos_ids)}
    out[f"tau={args.tau} B={B} window"] = lambda p: mars_decode(
        model, p, block_size=B, tau=args.tau, max_new_tokens=n, mask_id=mask_id, eos_ids=eos_ids)
    if args.block_cache:
        out[f"tau={args.tau} B={B} block"] = lambda p: mars_decode(
            model, p, block_size=B, tau=args.tau, max_new_tokens=n, mask_id=mask_id, eos_ids=eos_ids,
            cache="block", block_cache_size=args.block_cache)
    for K in args.drafts:
        out[f"exact K={K} B={B}"] = lambda p, K=K: exact_steps(
            model, p, block_size=B, drafts=K, max_new_tokens=n, mask_id=mask_id, eos_ids=eos_ids)
    if args.compile and getattr(model, "compiled", False) is None:  # an engine, not yet compiled
        step = switch_step(compile_step(model), None)  # compiled, and off for the eager rows
        out.update({f"{name} compiled": each_step_in(lambda: compiled_step(model, step), dec)
                    for name, dec in list(out.items())})
    return out


def each_step_in(context, dec):
    """dec with each of its steps run inside a fresh context() (the decoders interleave step by
    step, each with its own setting)."""
    def run(prompts):
        steps = dec(prompts)
        while True:
            with context():
                s = next(steps, None)
            if s is None:
                return
            yield s
    return run


@contextlib.contextmanager
def compiled_step(model, step):
    """model's decoding step compiled while inside (the cache a decoder makes in its first step
    is then static), eager after."""
    before = switch_step(model, step)
    try:
        yield
    finally:
        switch_step(model, before)


def reference(name):
    """The decoder a row is measured against: its own kind's AR (compiled or eager)."""
    return "our AR compiled" if name.endswith(" compiled") else "our AR"


def run_interleaved(steps, n_rows):
    """Run step generators in lockstep, one step of each in turn until all end -> key -> what
    run_once returns: the time of each step is taken beside the others' same step."""
    runs = {key: dict(ids=[[] for _ in range(n_rows)], times=[], forwards=0) for key in steps}
    live = list(steps)
    while live:
        for key in list(live):
            t0 = time.perf_counter()
            step = next(steps[key], None)
            if step is None:
                live.remove(key)
                continue
            run = runs[key]
            run["times"].append(time.perf_counter() - t0)
            run["forwards"] = step.forwards
            for b, t in enumerate(step.tokens):
                run["ids"][b] += t
    return {key: dict(prefill=r["times"][0], steps=r["times"][1:], forwards=r["forwards"], ids=r["ids"],
                      total=sum(r["times"])) for key, r in runs.items()}


def run_once(steps, n_rows):
    """Run one step generator to the end -> dict: seconds of the prefill and of every later
    step, forwards, tokens and the generated ids per row."""
    return run_interleaved({0: steps}, n_rows)[0]


def summarise(run, ar, eager=None):
    """One run's numbers, and its ratios to the same round's AR run (and, for a compiled
    run, to its eager twin: the step's time, and how many rows say the same)."""
    fwd = statistics.mean(run["steps"]) if run["steps"] else float("nan")
    ar_fwd = statistics.mean(ar["steps"])
    n, n_ar = sum(map(len, run["ids"])), sum(map(len, ar["ids"]))
    tpf = n / run["forwards"] / len(run["ids"])
    out = dict(fwd=fwd, x_ar=fwd / ar_fwd, tpf=tpf, limit=tpf / (n_ar / ar["forwards"] / len(ar["ids"])),
               speedup=(ar["total"] / n_ar) / (run["total"] / n), same=run["ids"] == ar["ids"])
    if eager is not None:
        pairs = list(zip(run["ids"], eager["ids"]))
        out.update(x_eager=fwd / statistics.mean(eager["steps"]),
                   eq_eager=sum(a == b for a, b in pairs) / len(pairs),
                   first_diff=[next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                               for a, b in pairs if a != b])
    return out


def bench_batch(decs, tok, model, mask_id, batch, rounds):
    """Interleaved rounds (the first a warm-up) -> (dtype, name) -> list of per-round summaries.
    decs: engine -> name -> decoder; the first's (the reference's) AR is the reference of x ref."""
    out = {(dt, name): [] for dt in decs for name in decs[dt]}
    first = next(iter(decs))
    for r in range(rounds + 1):
        if r == 1:
            warm = graphs()  # every shape of this batch size was compiled in the warm-up round
        prompts = make_prompts(tok, model.config.vocab_size, mask_id, batch + r)[r:]  # rotate the prompts
        runs = {(dt, name): dec(prompts) for dt in decs for name, dec in decs[dt].items()}
        runs = run_interleaved(runs, batch)
        if r:
            for (dt, name), run in runs.items():
                twin = runs[dt, name.removesuffix(" compiled")] if name.endswith(" compiled") else None
                s = summarise(run, runs[dt, reference(name)], twin)
                s["x_first"] = statistics.mean(runs[first, "our AR"]["steps"]) / statistics.mean(run["steps"])
                out[dt, name].append(s)
    return out, graphs() - warm


def report(results, batch, rounds):
    """Print one batch size's table -> the number of exact decoders that differ from their AR."""
    print(f"batch {batch} (median of {rounds} rounds after a warm-up, decoders interleaved step by step)")
    print(f"  {'engine':<21} {'decoder':<33} {'ms/fwd':>7} {'x AR':>6} {'tok/fwd':>8} {'limit':>6} "
          f"{'speedup':>8} {'x ref':>7} {'x eager':>8} {'=eager':>7}")
    differ = 0
    for (dt, name), rs in results.items():
        keys = ("fwd", "x_ar", "tpf", "limit", "speedup", "x_first")
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        exact = name.startswith("exact")
        same = all(r["same"] for r in rs)
        check = (f"   == {reference(name)}" if same else "   DIFFERS FROM AR") if exact else ""
        differ += exact and not all(r["same"] for r in rs)
        x_first = f"{med['x_first']:6.2f}x" if name == "our AR" else ""
        eager = ""
        if "x_eager" in rs[0]:
            firsts = [i for r in rs for i in r["first_diff"]]
            eager = (f" {statistics.median(r['x_eager'] for r in rs):7.2f}x "
                     f"{sum(r['eq_eager'] for r in rs) / len(rs):6.0%}"
                     + (f" (first difference at token {min(firsts)}-{max(firsts)})" if firsts else ""))
        print(f"  {dt:<21} {name:<33} {1000 * med['fwd']:7.1f} {med['x_ar']:6.2f} {med['tpf']:8.2f} "
              f"{med['limit']:6.2f} {med['speedup']:7.2f}x {x_first:>7}{eager}{check}")
    return differ


def graphs():
    """Graphs torch.compile has built so far in this process (each compile of a new shape)."""
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def profile(decs, tok, model, mask_id):
    """Where each decoder's forward goes at batch 1 (one profiled run, ms per forward)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    V = model.config.vocab_size
    prompts = make_prompts(tok, V, mask_id, 1)
    print("profile, batch 1, ms per forward (prefill included), one run each")
    print(f"  {'decoder':<24} {'wall':>6} {'linears':>8} {'LM head':>8} {'attn':>6} {'other':>6} "
          f"{'python':>7} {'syncs':>6}")
    for name, dec in decs.items():
        run_once(dec(prompts), 1)  # warm
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            run = run_once(dec(prompts), 1)
        f = run["forwards"]
        cat = dict(linears=0.0, head=0.0, attn=0.0, other=0.0, syncs=0)
        for e in p.key_averages(group_by_input_shape=True):
            if e.key in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"):  # the head's has V columns
                head = any(V in shape for shape in e.input_shapes if shape)
                cat["head" if head else "linears"] += e.self_cpu_time_total
            elif "scaled_dot_product" in e.key:
                cat["attn"] += e.self_cpu_time_total
            else:
                cat["other"] += e.self_cpu_time_total
            if e.key == "aten::item":
                cat["syncs"] += e.count
        ms = {k: cat[k] / 1000 / f for k in ("linears", "head", "attn", "other")}
        wall = 1000 * run["total"] / f  # the profiler's own cost is in it: compare rows, not runs
        print(f"  {name:<24} {wall:6.1f} {ms['linears']:8.1f} {ms['head']:8.1f} {ms['attn']:6.1f} "
              f"{ms['other']:6.1f} {wall - sum(ms.values()):7.1f} {cat['syncs'] / f:6.1f}")


@torch.no_grad()
def layouts(model, rows=(1, 2, 4, 5, 9, 17), rounds=9):
    """The matmuls of one forward at M rows through F.linear on the stored weights and through
    the engine's packed path (fast.linear.FastLinear): every layer's linears, and the LM
    head, interleaved, median wall ms."""
    linears = [m for m in model.modules() if isinstance(m, FastLinear)]
    packed = {id(m): pack(m).packed for m in linears}  # a module packs like a model
    layers = [m for m in linears if m is not model.lm_head]
    print("matmuls of one forward, wall ms (median of interleaved rounds): layers' linears | LM head")
    half = f"{'F.linear':>9} {'packed':>7} {'ratio':>6}"
    print(f"  {'rows':>4} {half} | {half}")
    for M in rows:
        times = {(ws, way): [] for ws in ("layers", "head") for way in ("F.linear", "packed")}
        for _ in range(rounds):
            for ws, way in times:
                group = layers if ws == "layers" else [model.lm_head]
                for m in group:
                    m.packed = packed[id(m)] if way == "packed" else None
                xs = {m.in_features: torch.randn(M, m.in_features).to(m.weight.dtype) for m in group}
                t0 = time.perf_counter()
                for m in group:
                    m(xs[m.in_features])
                times[ws, way].append(1000 * (time.perf_counter() - t0))
        for m in linears:
            m.packed = packed[id(m)]
        t = {k: statistics.median(v) for k, v in times.items()}
        cells = [f"{t[ws, 'F.linear']:9.1f} {t[ws, 'packed']:7.1f} {t[ws, 'packed'] / t[ws, 'F.linear']:6.2f}"
                 for ws in ("layers", "head")]
        print(f"  {M:4d} {cells[0]} | {cells[1]}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="HF-layout checkpoint (default: a random tiny model)")
    p.add_argument("--batch-sizes", type=ints, default=[1, 4])
    p.add_argument("--drafts", type=ints, default=[1, 2], help="K of exact mode, comma-separated")
    p.add_argument("--block-size", type=int, default=4, help="B of the τ loop (and exact mode's bound)")
    p.add_argument("--tau", type=float, default=0.95)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds (after one warm-up)")
    p.add_argument("--profile", action="store_true", help="also profile each decoder at batch 1")
    p.add_argument("--layouts", action="store_true", help="also time one forward's matmuls at 1-17 "
                   "rows through F.linear and from the engine's packed weights (fast/linear.py)")
    p.add_argument("--compile", action="store_true", help="also run every engine decoder with its step "
                   "compiled (fast.step.compile_step), rows named 'NAME compiled'")
    p.add_argument("--block-cache", type=int, default=0, help="also the τ loop with the block cache of "
                   "this B_cache (0: not run)")
    p.add_argument("--unpacked", action="store_true", help="drop the engine's packed weights (F.linear on "
                   "the weights as stored): packing's before / after, in two runs")
    p.add_argument("--no-reference", action="store_true", help="leave out the reference (float32, plain)")
    add_model_args(p, several_dtypes=True)
    args = p.parse_args()
    models = open_models(args)
    ck = next(iter(models.values()))
    print(machine(args.device))
    print(f"checkpoint {args.ckpt}: {ck.model.num_params() / 1e6:.1f}M params; greedy, "
          f"{args.new_tokens} new tokens, prompts: {'the chat questions' if ck.tok else 'random ids'} "
          f"({len(QUESTIONS)}), rotated per round; matmuls "
          f"{'F.linear (unpacked)' if args.unpacked else 'packed (fast/linear.py)'} in the engine")
    decs = {dt: decoders(args, c.model, c.mask_id, c.eos_ids) for dt, c in models.items()}
    differ = 0
    for batch in args.batch_sizes:
        results, built = bench_batch(decs, ck.tok, ck.model, ck.mask_id, batch, args.rounds)
        differ += report(results, batch, args.rounds)
        if args.compile:
            print(f"recompiles after warm-up: {built}")
    if args.profile:
        profile(next(iter(decs.values())), ck.tok, ck.model, ck.mask_id)
    if args.layouts:
        layouts(models[list(models)[-1]].model)
    if differ:
        print(f"{differ} exact decoder(s) differ from AR", file=sys.stderr)
        return 1
    return 0


def open_models(args):
    """"reference" -> the checkpoint opened as the plain float32 model (unless --no-reference),
    then "engine DTYPE" for each of --dtype's names -> the checkpoint opened in it and made fast
    (packed, unless --unpacked); the first call makes the random tiny model when there is no
    --ckpt, the others open the same one."""
    models = {}
    if not args.no_reference:
        models["reference"] = load_for_bench(args, "bench_decode_", "float32", engine=False)
        args.ckpt = args.ckpt or models["reference"].path
    for name in dtype_list(args.dtype):
        ck = load_for_bench(args, "bench_decode_", name)  # made fast
        args.ckpt = args.ckpt or ck.path
        if args.unpacked:
            for m in ck.model.modules():
                if isinstance(m, FastLinear):
                    m.packed = None
        dtype = dtype_name(next(ck.model.parameters()).dtype)
        models["engine " + (dtype if name != "auto" else f"auto={dtype}")] = ck
    return models


if __name__ == "__main__":
    sys.exit(main())
