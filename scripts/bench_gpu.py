"""The whole GPU picture in one command (issue 40): decoding, exactness, HF, a training step and
the main job on CUDA, written to results/GPU.md and results/gpu.json. Not a test.

Nothing is downloaded: the decoding model is a random Qwen2.5-0.5B-shaped model built here with
model.py (its mask predictions are noise, so τ and exact mode accept few drafts: the step
ratios, not the tokens per forward, are what it measures). Sections run in order of what
they answer, each only if the time budget (--minutes) still holds it, and the page is
rewritten after each, so a run cut short keeps what it measured:

  decode    our AR, the τ loop (window), exact K = 1, 2, 4 through the engine (fast.make_fast),
            eager and compiled (fast.step.compile_step: CUDA graphs), and HF generate (dynamic and
            static cache)
            at batch 1, 4, 16, bf16, 64 new tokens: tokens/s, ms per step, x AR, GB/s of
            weights read against the card's bandwidth; graphs built after warm-up
            and, per batch, exact mode = AR (eager and compiled) and AR alone = AR in the batch
  main      python train.py --device=cuda (the toy main job): time and its accuracy lines
  toy       the main job's checkpoint decoding its test prompts: AR, τ = 0.9 window, exact
            K = 2, eager and compiled, at each batch: trained drafts, so tokens per forward
            show as tokens/s; exact = AR
  train     one optimizer step at the 0.5B shape, 512-token rows, gradient checkpointing,
            bf16: AR vs MARS, eager vs torch.compile; peak memory against util/memory.py's
            estimate for configs/qwen2.5-0.5b-24gb.json

On a machine without CUDA it says so in one line and exits 0. `--dry-run` runs every section on
the CPU instead, at a tiny shape (2 layers, width 64, Qwen2.5's vocabulary; 64-token training
rows; the main job for 2 + 2 steps without its evaluation, and its checkpoint decoding), to
out/bench_gpu_dry_run.md: the script's own check before GPU time is spent on it
(tests/test_bench_gpu.py runs it). Its numbers measure nothing.

    python -m scripts.bench_gpu                  # ~8 min on one H200
    python -m scripts.bench_gpu --minutes 3 --batch-sizes 1,4
    python -m scripts.bench_gpu --dry-run        # the CPU, ~2 min
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

import fast
from decoding import Generation
from exact import generate_exact
from fast.loop import ar_step, generate_ar_device, generate_window_device, window_step
from fast.step import compile_step
from generate import generate, generate_ar
from model import Qwen2, Qwen2Config, init_weights
from scripts.common import ints, machine
from util.atomic import atomic_write

BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, the vendors' figures
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM), the vendors' figures
MASK = 151665  # Qwen2.5's <|mask|> (docs/spec.md §2)


@dataclass(frozen=True)
class Run:
    """Everything a dry run changes, in one place; main() sets RUN."""

    device: str
    model: str  # the decode section's model, in words
    shape: dict  # Qwen2Config fields over its defaults (Qwen2.5-0.5B's shape)
    batch_sizes: list  # defaults of --batch-sizes, --new-tokens, --out
    new_tokens: int
    out: str
    row_tokens: int  # the training step's rows
    timed_steps: int  # the training step: the fastest of these, after a warm-up
    main_flags: list  # train.py's flags beyond --device and --out_dir
    toy_tokens: int | None  # the toy's replies end at EOS or here (None: --new-tokens)


GPU_RUN = Run(device="cuda", model="random Qwen2.5-0.5B shape", shape={}, batch_sizes=[1, 4, 16],
              new_tokens=64, out="results/GPU", row_tokens=512, timed_steps=3, main_flags=[], toy_tokens=96)
DRY_RUN = Run(device="cpu", model="tiny random model (dry run)",
              shape=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2),
              batch_sizes=[1, 2], new_tokens=8, out="out/bench_gpu_dry_run", row_tokens=64, timed_steps=1,
              main_flags=["--ar_steps=2", "--mars_steps=2", "--eval_rows=8", "--eval_at_end=False"],
              toy_tokens=None)  # an untrained toy reaches no EOS: --new-tokens
RUN = GPU_RUN


def bandwidth():
    if RUN.device == "cpu":
        return None, "the CPU (dry run)"
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None), name


def random_05b(seed=0):
    """A random model of RUN's shape in bf16 on RUN's device, the reference (decode_section makes
    it the engine)."""
    return init_weights(Qwen2(Qwen2Config(**RUN.shape)), seed=seed).to(RUN.device, torch.bfloat16).eval()


def engine(model):
    """The engine over `model`, eager (fast.make_fast), and its compiled decoding step, set on
    the model per decoder by run_ours: a decoder's cache is static iff `model.compiled` is set
    when the decoder makes it -> (model, step)."""
    step = compile_step(fast.make_fast(model)).compiled
    model.compiled = None
    return model, step


def sync():
    if RUN.device == "cuda":
        torch.cuda.synchronize()


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 150000, (int(L),), generator=g).tolist()
        for L in torch.randint(32, 49, (n,), generator=g)
    ]


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


# ----------------------------------------------------------------------------- decode
def our_decoders(model, new):
    B = 4
    out = {
        "AR": lambda p: generate_ar(model, p, new),
        "tau=0.95 window": lambda p: generate(
            model, p, block_size=B, tau=0.95, max_new_tokens=new, mask_id=MASK
        ),
    }
    for K in (1, 2, 4):
        out[f"exact K={K}"] = lambda p, K=K: generate_exact(
            model, p, block_size=B, drafts=K, max_new_tokens=new, mask_id=MASK
        )
    return out


def run_ours(model, step, name, dec, p, res):
    """Warm up (and compile) one decoder on one batch of prompts p, then time it (twice,
    compiled) -> its row, appended to res. model: a fast.FastQwen2; step: its compiled step
    (engine), or None: eager."""
    model.compiled = step
    graphs0 = graph_count()
    dec(p)  # warm-up: compiles this shape when compiled
    warm = graph_count()
    times, gens = [], None
    for _ in range(2 if step else 1):
        dt, gens = timed(lambda: dec(p))
        times.append(dt)
    model.compiled = None
    tokens, forwards = sum(len(g.ids) for g in gens), max(g.forwards for g in gens)
    dt = min(times)
    row = dict(
        decoder=name + (" compiled" if step else ""),
        batch=len(p),
        tokens_per_s=tokens / dt,
        ms_per_forward=1000 * dt / forwards,
        tokens_per_forward=tokens / forwards / len(p),
        graphs_at_warmup=warm - graphs0,
        recompiles_after_warmup=graph_count() - warm,
        ids=[g.ids for g in gens],
    )
    res.append(row)
    return row


def graph_count():
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def hf_rows(model, batches, new, res, budget):
    """HF generate on the same weights: dynamic cache, and static cache (compiled by HF)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        try:
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16)
        hf = hf.to(RUN.device).eval()
    for impl in ("dynamic", "static"):
        for batch in batches:
            if budget.left() > 60 and (impl == "dynamic" or batch <= 4):
                res.append(hf_one(hf, impl, batch, new))


@torch.no_grad()
def hf_one(hf, impl, batch, new):
    p = prompts(batch, seed=batch)
    L = max(map(len, p))
    ids = torch.tensor([[0] * (L - len(x)) + x for x in p], device=RUN.device)  # left-padded, as HF wants
    att = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in p], device=RUN.device)
    kw = dict(attention_mask=att, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if impl == "static":
        kw["cache_implementation"] = "static"
    hf.generate(ids, **kw)  # warm-up (static: HF compiles its forward)
    dt, _ = timed(lambda: hf.generate(ids, **kw))
    return dict(
        decoder=f"HF generate ({impl} cache)",
        batch=batch,
        tokens_per_s=batch * new / dt,
        ms_per_forward=1000 * dt / new,
        tokens_per_forward=1.0,
    )


def decode_section(args, out, budget):
    model = random_05b()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw, name = bandwidth()
    out["decode"] = dict(
        model=RUN.model + ", bf16",
        params=model.num_params(),
        weight_bytes=nbytes,
        card=name,
        bandwidth=bw,
        new_tokens=args.new_tokens,
        rows=[],
    )
    rows = out["decode"]["rows"]
    model, step = engine(model)
    decs = our_decoders(model, args.new_tokens)
    for batch in args.batch_sizes:  # eager: no compile, a few seconds each
        for name, dec in decs.items():
            if budget.left() > 30:
                run_ours(model, None, name, dec, prompts(batch, seed=batch), rows)
    budget.save(out)
    # compiled, what the targets read first: AR and exact K = 2 at every batch, then the others
    order = [(n, b) for n in ("AR", "exact K=2") for b in args.batch_sizes]
    order += [(n, args.batch_sizes[0]) for n in ("tau=0.95 window", "exact K=1", "exact K=4")]
    order += [(n, b) for n in ("tau=0.95 window", "exact K=1", "exact K=4") for b in args.batch_sizes[1:]]
    for name, batch in order:
        if budget.left() > 150:
            run_ours(model, step, name, decs[name], prompts(batch, seed=batch), rows)
            budget.save(out)
    alone_rows(model, step, args, out, budget)
    budget.save(out)
    if budget.left() > 150:
        hf_rows(model, args.batch_sizes, args.new_tokens, rows, budget)
    loop_rows(model, args, rows, budget)  # last: new, and it must not cost the rows above
    out["exact"] = exact_checks(rows)
    del model
    empty_cache()


def loop_rows(model, args, rows, budget):
    """AR with the whole step on the device (fast/loop.py: head, argmax, EOS/budget cut and cache
    update in one compiled graph, CUDA graphs on a GPU; one host read per 8 tokens), at each
    batch size: "AR device loop compiled" rows, beside the compiled AR (compared by the page's ratios)."""
    mode = "reduce-overhead" if RUN.device == "cuda" else "default"
    ar = torch.compile(ar_step, fullgraph=True, dynamic=False, mode=mode)
    window = torch.compile(window_step, fullgraph=True, dynamic=False, mode=mode)
    new = args.new_tokens
    decs = {  # forwards are not counted on the device: a row's tokens stand in (tokens/forward 1)
        "AR device loop compiled": lambda p: generate_ar_device(model, p, new, (), 8, ar),
        "tau=0.95 window device loop compiled": lambda p: generate_window_device(model, p, 4, 0.95, new, MASK,
                                                                                  (), 8, window),
    }
    for name, dec in decs.items():
        for batch in args.batch_sizes:
            if budget.left() > 150:
                run = lambda p, dec=dec: [Generation(ids, len(ids)) for ids in dec(p)]
                run_ours(model, None, name, run, prompts(batch, seed=batch), rows)


def empty_cache():
    if RUN.device == "cuda":
        torch.cuda.empty_cache()


def alone_rows(model, step, args, out, budget):
    """AR alone = AR in the batch (eager, and compiled where the batch was compiled): each
    prompt of the batch decoded alone against the batch's timed run."""
    by = {(r["decoder"], r["batch"]): r["ids"] for r in out["decode"]["rows"]}
    out["alone"] = []
    for compiled in (None, step):
        name = "AR compiled" if compiled else "AR"
        for batch in args.batch_sizes[1:]:
            if (name, batch) in by and budget.left() > 60:
                model.compiled = compiled
                alone = [generate_ar(model, [x], args.new_tokens)[0].ids for x in prompts(batch, seed=batch)]
                model.compiled = None
                out["alone"].append(dict(check=f"{name} alone = {name} in the batch", batch=batch, rows=batch,
                                         rows_equal=sum(a == b for a, b in zip(alone, by[name, batch]))))


def ar_of(rows):
    """-> a function: a row -> the AR row of its batch and kind (eager or compiled), or None."""
    def key(r):
        return r["batch"], r["decoder"].endswith("compiled")

    ar = {key(r): r for r in rows if r["decoder"] in ("AR", "AR compiled")}
    return lambda r: ar.get(key(r))


def exact_checks(rows):
    """Exact = AR at each batch: eager against eager AR, compiled against compiled AR."""
    ar = ar_of(rows)
    return [
        dict(check=f"{r['decoder']} = {a['decoder']}", batch=r["batch"], rows=len(r["ids"]),
             rows_equal=sum(x == y for x, y in zip(r["ids"], a["ids"])))
        for r in rows
        if r["decoder"].startswith("exact") and (a := ar(r)) is not None
    ]


# ----------------------------------------------------------------------------- the trained toy
def toy_section(args, out, budget, work):
    """The main job's MARS checkpoint (the toy, trained a minute ago by section main) decoding
    the toy's test prompts, bf16, to EOS or 96 tokens: AR, the τ = 0.9 window and exact K = 2,
    eager and compiled, at each batch size. Here the drafts are trained, so tokens per forward
    show as tokens per second (the random 0.5B model's drafts are noise)."""
    from checkpoint import load_checkpoint
    from data.synthetic import read_jsonl

    path = os.path.join(work, "out", "mars")
    if not os.path.isdir(path):
        raise RuntimeError(f"no checkpoint at {path}: the toy section needs section main before it")
    ck = load_checkpoint(path, RUN.device, torch.bfloat16)
    (model, step), B = engine(ck.model), ck.block_size
    new = RUN.toy_tokens or args.new_tokens
    problems = read_jsonl(os.path.join("data", "default", "test.jsonl"))[: 2 * max(args.batch_sizes)]
    chats = [ck.tok.encode_chat(x["messages"][:-1], add_generation_prompt=True) for x in problems]
    kw = dict(block_size=B, max_new_tokens=new, mask_id=ck.mask_id, eos_ids=ck.eos_ids)
    decs = {
        "AR": lambda p: generate_ar(model, p, new, ck.eos_ids),
        "tau=0.9 window": lambda p: generate(model, p, tau=0.9, **kw),
        "exact K=2": lambda p: generate_exact(model, p, drafts=2, **kw),
    }
    out["toy"] = dict(model=f"the main job's MARS checkpoint (B = {B}), bf16", params=model.num_params(),
                      new_tokens=new, rows=[])
    rows = out["toy"]["rows"]
    for compiled in (None, step):
        for batch in args.batch_sizes:
            for name, dec in decs.items():
                if budget.left() > (90 if compiled else 30):
                    p = chats[batch : 2 * batch]  # the prompts after the first `batch`: a new batch
                    run_ours(model, compiled, name, dec, p, rows)
        budget.save(out)
    out["toy"]["exact"] = exact_checks(rows)


# ----------------------------------------------------------------------------- train
def train_section(out, budget):
    from settings import parse_settings
    from util.memory import estimate_memory

    S = parse_settings(["--config", "configs/qwen2.5-0.5b-24gb.json"])
    cfg = Qwen2Config(**RUN.shape)
    res = dict(
        config="configs/qwen2.5-0.5b-24gb.json",
        shape=RUN.model,
        micro_batch=S.micro_batch_size,
        row_tokens=RUN.row_tokens,
        estimate_GiB=estimate_memory(Qwen2Config(), S) / 2**30,
        rows=[],
    )
    # the static step compiled (fast/train.py, what train.py --compile=true runs) first: the
    # compiled rows are the ones that did not fit the budget before
    for kind, compiled in (("MARS static", True), ("AR static", True), ("AR", False), ("MARS", False),
                           ("AR", True), ("MARS", True)):
        if budget.left() > (150 if compiled else 45):
            res["rows"].append(train_one(cfg, S, kind, compiled))
            empty_cache()
    out["train"] = res


def peak_flops():
    """The GPU's dense bf16 peak (FLOP/s) by its name, or None (a CPU, an unknown card)."""
    if RUN.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def train_one(cfg, S, kind, compiled):
    """Warm-up step, then the fastest of RUN.timed_steps steps, their peak memory (on CUDA), the
    step's model FLOPs (util/flops.py: the reference's work, whichever step runs) and MFU. kind:
    AR or MARS (the reference losses, mars.py) or "AR static" / "MARS static" (fast/train.py)."""
    from fast.train import ar_loss_static, mars_loss_static, static_batch
    from mars import IGNORE, ar_loss, mars_loss, noisy_window
    from util.flops import ar_step_flops, mars_step_flops

    model = init_weights(Qwen2(cfg), seed=0).to(RUN.device)
    model.gradient_checkpointing = True
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(0)
    T = RUN.row_tokens
    ids = torch.randint(0, 150000, (S.micro_batch_size, T), generator=g).to(RUN.device)
    labels = ids.clone()
    labels[:, : T // 4] = IGNORE  # a prompt of a quarter of the row (128 of 512 tokens), then the answer
    N, targets, W = ids.shape[0], int((labels[:, 1:] != IGNORE).sum()), noisy_window(labels.cpu(), 4)[1]
    flops = ar_step_flops(cfg, N, T, targets) if kind.startswith("AR") else \
        mars_step_flops(cfg, N, T, W, targets)
    x, y, window = static_batch(ids.cpu(), labels.cpu(), 0, 4, 128)
    x, y, window = x.to(RUN.device), y.to(RUN.device), (window[0].to(RUN.device), window[1])

    def loss_of(ids, labels):
        if kind == "AR static":
            return ar_loss_static(model, x, y)
        if kind == "MARS static":
            return mars_loss_static(model, x, y, window, MASK, 4)[0]
        return ar_loss(model, ids, labels) if kind == "AR" else mars_loss(model, ids, labels, MASK, 4,
                                                                         trim_noisy=True)[0]

    loss_fn = torch.compile(loss_of, fullgraph=kind.endswith("static")) if compiled else loss_of

    def one_step():
        with torch.autocast(RUN.device, dtype=torch.bfloat16):
            loss = loss_fn(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # warm-up (compiles)
    cuda = RUN.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [timed(one_step)[0] for _ in range(RUN.timed_steps)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    peak_fl = peak_flops()
    return dict(loss=kind, compiled=compiled, ms=1000 * min(times), peak_GiB=peak, tflops=flops / 1e12,
                mfu=None if peak_fl is None else flops / min(times) / peak_fl)


def main_job_section(out, budget, d):
    """python train.py into d/out (the toy section decodes its checkpoint)."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "train.py", f"--device={RUN.device}", f"--out_dir={d}/out"] + RUN.main_flags,
        capture_output=True,
        text=True,
        timeout=max(60, budget.left()),
    )
    out["main"] = dict(
        command=" ".join(["python"] + r.args[1:]).replace(d, "TMP"),
        seconds=time.perf_counter() - t0,
        returncode=r.returncode,
        last_lines=r.stdout.strip().splitlines()[-4:] + r.stderr.strip().splitlines()[-2:],
    )


# ----------------------------------------------------------------------------- page
class Budget:
    def __init__(self, minutes, path):
        self.end, self.path = time.perf_counter() + 60 * minutes, path

    def left(self):
        return self.end - time.perf_counter()

    def save(self, out):
        slim = json.loads(json.dumps(out, default=str))
        for r in slim.get("decode", {}).get("rows", []):
            r.pop("ids", None)
        atomic_write(self.path + ".json", lambda f: json.dump(slim, f, indent=1))
        atomic_write(self.path + ".md", lambda f: f.write(page(slim)))


def page(out):
    lines = ["# GPU results (scripts/bench_gpu.py)", "", out.get("machine", ""), ""]
    d = out.get("decode")
    if d:
        bw = d["bandwidth"]
        lines += [
            f"## Decoding: {d['model']}, {d['params'] / 1e6:.0f}M params ({d['weight_bytes'] / 1e9:.2f} GB), "
            f"{d['new_tokens']} new tokens, greedy",
            "",
            "| batch | decoder | tokens/s | ms/forward | x AR | tokens/forward | weights GB/s "
            "| % of bandwidth "
            "| recompiles after warm-up |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        ar = ar_of(d["rows"])
        for r in sorted(d["rows"], key=lambda r: r["batch"]):
            ref = ar(r)["ms_per_forward"] if ar(r) else None
            gbs = d["weight_bytes"] / (r["ms_per_forward"] / 1000) / 1e9
            lines.append(
                f"| {r['batch']} | {r['decoder']} | {r['tokens_per_s']:.1f} | {r['ms_per_forward']:.2f} | "
                f"{r['ms_per_forward'] / ref:.2f} | {r['tokens_per_forward']:.2f} | "
                if ref
                else f"| {r['batch']} | {r['decoder']} | {r['tokens_per_s']:.1f} | "
                f"{r['ms_per_forward']:.2f} | - | "
                f"{r['tokens_per_forward']:.2f} | "
            )
            lines[-1] += (
                f"{gbs:.0f} | {100 * gbs * 1e9 / bw:.1f} % | {r.get('recompiles_after_warmup', '-')} |"
                if bw
                else f"{gbs:.0f} | - | {r.get('recompiles_after_warmup', '-')} |"
            )
        lines.append("")
    lines += check_lines(out.get("exact", []) + out.get("alone", []))
    t = out.get("train")
    if t:
        lines += [
            "",
            f"## Training step: {t.get('shape', '0.5B shape')}, {t['micro_batch']} rows x "
            f"{t['row_tokens']} tokens, bf16, "
            f"gradient checkpointing (estimate for {t['config']}: {t['estimate_GiB']:.1f} GiB)",
            "",
            "| loss | compiled | ms/step | model TFLOP | MFU | x AR (same kind) | peak GiB |",
            "|---|---|---|---|---|---|---|",
        ]
        ar = {(r["loss"], r["compiled"]): r["ms"] for r in t["rows"] if r["loss"].startswith("AR")}
        lines += [
            f"| {r['loss']} | {r['compiled']} | {r['ms']:.0f} | {r.get('tflops', float('nan')):.2f} | "
            + (f"{100 * r['mfu']:.1f} % | " if r.get("mfu") is not None else "- | ")
            + (f"{r['ms'] / ar[r['loss'].replace('MARS', 'AR'), r['compiled']]:.2f} | "
               if (r["loss"].replace("MARS", "AR"), r["compiled"]) in ar else "- | ")
            + (f"{r['peak_GiB']:.2f} |" if r["peak_GiB"] is not None else "- |")
            for r in t["rows"]
        ]
    m = out.get("main")
    if m:
        lines += (
            [
                "",
                f"## Main job: {m.get('command', 'python train.py --device=cuda')}: "
                f"{m['seconds'] / 60:.1f} min, "
                f"exit {m['returncode']}",
                "",
                "```",
            ]
            + m["last_lines"]
            + ["```"]
        )
    lines += toy_page(out.get("toy"))
    lines += [f"- section {k} failed: {v}" for k, v in out.get("errors", {}).items()]
    lines += [
        "",
        f"Sections not reached in the time budget: {', '.join(out.get('skipped', [])) or 'none'}",
        "",
    ]
    return "\n".join(lines)


def toy_page(t):
    if not t:
        return []
    lines = [
        "",
        f"## Decoding the trained toy: {t['model']}, {t['params'] / 1e6:.1f}M params, the test prompts "
        f"to EOS or {t['new_tokens']} tokens, greedy",
        "",
        "| batch | decoder | tokens/s | x AR tokens/s | ms/forward | x AR ms/forward | tokens/forward "
        "| recompiles after warm-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ar = ar_of(t["rows"])
    for r in sorted(t["rows"], key=lambda r: r["batch"]):
        a = ar(r)
        x_tok = f"{r['tokens_per_s'] / a['tokens_per_s']:.2f}" if a else "-"
        x_ms = f"{r['ms_per_forward'] / a['ms_per_forward']:.2f}" if a else "-"
        lines.append(f"| {r['batch']} | {r['decoder']} | {r['tokens_per_s']:.0f} | {x_tok} | "
                     f"{r['ms_per_forward']:.2f} | {x_ms} | {r['tokens_per_forward']:.2f} | "
                     f"{r.get('recompiles_after_warmup', '-')} |")
    lines.append("")
    return lines + check_lines(t.get("exact", []))


def check_lines(checks):
    return [f"- {c['check']}, batch {c['batch']}: {c['rows_equal']}/{c['rows']} rows identical"
            for c in checks]


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
    global RUN
    RUN = DRY_RUN if args.dry_run else GPU_RUN
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
    with tempfile.TemporaryDirectory() as work:  # the main job's checkpoint, for the toy section
        run_sections(args, out, budget, work)
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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
