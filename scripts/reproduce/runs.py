"""What the reproduction runs: every variant at every seed, with its train and eval commands,
and the benchmark commands (docs/spec.md §4, §5, §7; the variants are listed in the package
docstring, scripts/reproduce/__init__.py).

A variant is a set of train.py settings; `plan` turns the command-line options into the run's
parameters P and one entry per variant and seed. The checkpoint root's hash covers the config
and the training sources, and the eval key the evaluation sources, so a changed setting or
source never reuses stale weights or results. Running the commands is training.py's job, the
page report.py's; this module starts no process.
"""

import hashlib
import json
import os
import sys

from settings import Settings, parse_settings

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)  # the paper's sweep (§5)
TRAIN_SOURCES = ("train.py", "settings.py", "checkpoint.py", "mars.py", "model.py", "tokenizer.py",
                 "chat_template.py", "data/synthetic.py", "data/bpe.py", "data/prepare.py", "data/batches.py",
                 "util/atomic.py", "util/precision.py", "util/runlog.py", "util/memory.py")
EVAL_SOURCES = ("evaluate.py", "generate.py", "decoding.py", "sampling.py", "exact.py", "chat.py",
                "kvcache.py")
PHASE = ("mars_b4", "bidir_b4"), 0.95  # evaluate.py --by-phase: these variants, at this τ


def digest(paths, extra=""):
    """A short hash of `extra` and the content of those of `paths` that exist."""
    h = hashlib.sha256(extra.encode())
    for p in (p for p in paths if os.path.isfile(os.path.join(HERE, p))):
        with open(os.path.join(HERE, p), "rb") as f:
            h.update(p.encode() + f.read())
    return h.hexdigest()[:8]


def variants(A, M, root):
    """[{name, label, steps, train: settings, ckpt, taus}] in run order."""
    from_ar = {"init_from": f"{root}/ar_stage/ar", "ar_steps": 0, "mars_steps": M}
    vs = [{"name": "ar_stage", "label": "AR stage alone", "steps": f"{A}",
           "train": {"ar_steps": A, "mars_steps": 0}, "stage": "ar", "taus": (1.0,)}]
    for B in (4, 8, 16):
        vs.append({"name": f"mars_b{B}", "label": f"MARS B={B}", "train": {**from_ar, "block_size": B}})
        if B == 4:
            vs.append({"name": "ar_sft", "label": "AR SFT (same total steps)", "steps": f"{A + M}",
                       "train": {"ar_steps": A + M, "mars_steps": 0}, "stage": "ar", "taus": (1.0,)})
    vs += [{"name": f"noar_b{B}", "label": f"MARS B={B} w/o L_AR",
            "train": {**from_ar, "block_size": B, "w_ar": 0.0}} for B in (4, 8, 16)]
    vs.append({"name": "noar_invt_b4", "label": "MARS B=4 w/o L_AR, 1/t (as released)",
               "train": {**from_ar, "block_size": 4, "w_ar": 0.0, "inv_t_weight": True}})
    vs.append({"name": "bidir_b4", "label": "Block-Diffusion style B=4",
               "train": {**from_ar, "block_size": 4, "bidirectional": True}})
    for v in vs:
        v.setdefault("steps", f"{A}+{M}")
        v["ckpt"] = f"{root}/{v['name']}/{v.get('stage', 'mars')}"
    return vs


def arg(k, v):
    """One train.py option as typed: `--k=v`, a boolean in lower case (`--bidirectional=true`)."""
    return f"--{k}={str(v).lower() if isinstance(v, bool) else v}"


def bench_commands(P, ckpt, quick):
    """The benchmark commands: training cost; decoding speed, with exact mode's rows (each checked
    equal to AR: the command fails if one is not)."""
    py, q, d = sys.executable, quick, f"--data_dir={P['data_dir']}"
    return {
        "bench_train": [py, "-m", "scripts.bench_train", f"--config={P['config']}", d,
                        f"--steps={5 if q else 10}", "--modes=ar,mars,mars-noar,bidir"],
        "bench_generate": [py, "-m", "scripts.bench_generate", f"--ckpt={ckpt}", d.replace("_", "-", 1),
                           f"--taus={'0.95' if q else '0.95,0.9'}",
                           f"--block-cache-sizes={'4,16,64' if q else '4,8,16,32,64'}",
                           f"--batch-sizes={'4,16' if q else '4,8,16'}", "--drafts=2,3",
                           "--max-new-tokens=96", f"--repeats={2 if q else 5}"],
    }


def parse_seeds(text):
    """--seeds "0,1,2" -> [0, 1, 2]; refuses anything but distinct integers >= 0."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds {text!r}: not a comma-separated list of integers") from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise SystemExit(f"--seeds {text!r}: seeds must be distinct and >= 0")
    return seeds


def plan(a):
    """The run's parameters P (paths, steps, τs, seeds, jobs, eval key, environment) and its
    variants, one entry per variant and seed, each with its train and eval commands."""
    scale = a.steps_scale if a.steps_scale is not None else 0.25 if a.quick else 1.0
    limit = a.limit if a.limit is not None else 100 if a.quick else None
    taus = [float(t) for t in a.taus.split(",")]
    if 1.0 not in taus:
        raise SystemExit(f"--taus {a.taus}: must include 1 (one-token mode: the AR variants' only τ, "
                         "and where the NLL is stored)")
    seeds = parse_seeds(a.seeds or ("0" if a.quick else "0,1,2"))
    S = parse_settings([f"--config={a.config}"])
    if S.epochs > 0:
        raise SystemExit(f"{a.config}: epochs={S.epochs:g}; scripts.reproduce scales ar_steps and "
                         "mars_steps, so use a config with epochs=0")
    A, M = max(1, round(S.ar_steps * scale)), max(1, round(S.mars_steps * scale))
    with open(a.config) as f:
        root = f"{a.out}/{A}+{M}-{digest(TRAIN_SOURCES, f.read())}"
    data_dir = f"{root}/data" if S.data_dir == Settings.data_dir else S.data_dir  # fresh default data
    jobs = a.jobs if a.jobs is not None else max(1, min(4, (os.cpu_count() or 1) // max(1, a.threads)))
    if jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {jobs}")
    P = {"R": a.results, "limit": limit, "config": a.config, "data_dir": data_dir, "jobs": jobs, "A": A,
         "M": M, "root": root, "taus": taus, "scale": scale, "S": S, "seeds": seeds,
         "eval_key": digest(EVAL_SOURCES, json.dumps([limit, taus, "nll", "hard"])),
         "env": {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}}
    names = [v["name"] for v in variants(A, M, root)]
    keep = {"ar_stage", *a.only.split(",")} if a.only else set(names)
    if unknown := keep - set(names):
        raise SystemExit(f"--only: unknown variant(s) {sorted(unknown)}")
    py, vs = sys.executable, []
    for seed in seeds:
        for v in variants(A, M, f"{root}/s{seed}"):
            if v["name"] not in keep:
                continue
            v.update(seed=seed, key=f"{v['name']}.s{seed}", out_dir=f"{root}/s{seed}/{v['name']}")
            v["train_cmd"] = [py, "train.py", f"--config={a.config}",
                              *(arg(k, x) for k, x in v["train"].items()), f"--seed={seed}",
                              f"--data_dir={data_dir}", f"--out_dir={v['out_dir']}", "--eval_at_end=false"]
            vt = [t for t in taus if t in v.get("taus", taus)]
            phase = v["name"] in PHASE[0] and PHASE[1] in vt and seed == seeds[0]
            ev = [py, "evaluate.py", f"--ckpt={v['ckpt']}", f"--data-dir={data_dir}"]
            v["eval_cmds"] = [ev + [f"--taus={','.join(map(str, vt))}", "--nll",
                                    *([f"--limit={limit}"] if limit else []),
                                    *([f"--by-phase={PHASE[1]}"] if phase else [])],
                              ev + ["--split=hard", "--taus=1.0", "--nll",
                                    *([f"--limit={limit}"] if limit else [])]]
            vs.append(v)
    return P, vs
