"""Reproduce the paper in miniature, from scratch, on a CPU, at several seeds: one command
(MARS_SPEC §4, §5, §7).

Trains every variant the paper compares on the default tiny setup (configs/default.json: the
model, data and schedule of `python train.py`, a tiny Qwen2 on the synthetic tasks of
data/synthetic.py), each at every training seed of --seeds (init and row order; the data set is
the same), evaluates each, runs the benchmarks and writes results/: RESULTS.md (tables shaped
like the paper's, with its numbers beside ours, every cell the mean and min–max over the seeds,
and the comparisons the seeds do and do not support), one JSON per variant and seed in runs/,
tau_sweep.png, mask.png. With A = ar_steps and M = mars_steps of the config (times --steps-scale):

  ar_stage      AR SFT, A steps: the start of every MARS run of its seed           (τ = 1)
  ar_sft        AR SFT for A + M steps: the paper's fair baseline                  (τ = 1)
  mars_bB       MARS, B = 4 (the default B), 8, 16: M steps from ar_stage          (τ sweep)
  noar_bB       the same without L_AR (w_ar = 0)                                   (τ sweep)
  noar_invt_b4  w/o L_AR as the authors released it: each row's L_mask x 1/t        (τ sweep)
  bidir_b4      Block-Diffusion style: bidirectional inside a block, B = 4         (τ sweep)

Each variant is scored on the test split (accuracy at each τ, and the reference replies' NLL in
one-token mode, `evaluate.py --nll`: a measure that does not saturate at 100 %) and on the hard
split at τ = 1 (problems longer than training shows). mars_b4 at seed 0 is what `python
train.py` does (its MARS stage starts from the AR stage's weights with a fresh optimizer either
way; tests/test_reproduce.py). Resumable: a variant whose checkpoint and results JSON exist is
skipped, a killed training run continues from its last checkpoint. Variants train --jobs at a
time (default: CPUs / --threads, at most 4), each with its output in <its out_dir>/output.txt;
a MARS variant waits for its seed's AR stage. Checkpoints go to
out/reproduce/<A>+<M>-<hash>/s<seed>/, the hash covering the config and the training, data and
tokenizer sources, so a changed setting or source never reuses stale weights.

    python -m scripts.reproduce             # 10 variants x seeds 0, 1, 2 (A = 4000, M = 1000): 76 min
    python -m scripts.reproduce --seeds 0   # one seed, a third of the time
    python -m scripts.reproduce --quick     # A, M / 4, 100 test problems, seed 0
    python -m scripts.reproduce --quick --steps-scale 0.02 --limit 20 --results /tmp/r   # smoke test
"""

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from data.synthetic import FAMILIES, read_jsonl
from settings import Settings, parse_settings
from util.atomic import write_json, write_text

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)  # the paper's sweep (§5)
TRAIN_SOURCES = ("train.py", "settings.py", "checkpoint.py", "mars.py", "model.py", "tokenizer.py",
                 "chat_template.py", "data/synthetic.py", "data/bpe.py", "data/prepare.py", "data/batches.py",
                 "util/atomic.py", "util/precision.py", "util/runlog.py", "util/memory.py")
EVAL_SOURCES = ("evaluate.py", "generate.py", "decoding.py", "sampling.py", "exact.py", "chat.py",
                "kvcache.py")
FAMILY_COLS = FAMILIES  # data/synthetic.py
# MARS_SPEC §7. 0.5B and 7B are six-benchmark averages; the τ sweep is 7B on GSM8K.
PAPER_ONE_TOKEN = {"ar_sft": "28.7 / 56.6", "mars_b4": "30.4 / 58.1"}
PAPER_B = {4: ("30.4", "28.4"), 8: ("29.7", "26.4"), 16: ("29.7", "22.2")}
PAPER_MULTI = {"mars_b4": "0.5B: −1.4 at 1.46; 7B: −1.3 at 1.68", "mars_b8": "7B: 1.82 tok/fwd",
               "mars_b16": "7B: 1.87 tok/fwd"}
PAPER_SWEEP = {1.0: (73.2, 1.00), 0.95: (71.0, 1.79), 0.9: (70.3, 1.96), 0.8: (67.7, 2.19),
               0.7: (63.8, 2.37), 0.6: (60.3, 2.55), 0.5: (56.0, 2.77)}
PAPER_BD = {"mars_b4": "30.4", "bidir_b4": "22.8 (BBH 7.5)"}
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
    return f"--{k}={str(v).lower() if isinstance(v, bool) else v}"


def typed(cmd):
    """The command as a reader types it: `python script.py ...` (not this interpreter's path)."""
    return " ".join(["python", *cmd[1:]])


def shown(cmd):
    """The command as RESULTS.md shows it: `$ python script.py ...`."""
    return "$ " + typed(cmd)


def run(cmd, env, log=None, out=None):
    """Run a command in the repo, its output shown (and copied to `log`), or with `out` sent to
    that file only (parallel jobs would interleave on the terminal); False on failure."""
    print("$ " + " ".join(cmd) + (f"   (output: {out})" if out else ""), flush=True)
    if out is not None:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "a") as f:
            return subprocess.run(cmd, cwd=HERE, env=env, stdout=f, stderr=subprocess.STDOUT).returncode == 0
    if log is None:
        return subprocess.run(cmd, cwd=HERE, env=env).returncode == 0
    p = subprocess.run(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, text=True)
    print(p.stdout, end="", flush=True)
    with open(log, "w") as f:
        f.write(shown(cmd) + "\n" + p.stdout)
    return p.returncode == 0


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def first_line(path):
    try:
        with open(path) as f:
            return f.readline().rstrip("\n")
    except OSError:
        return None


save_json = lambda obj, path: write_json(path, obj)


# ----------------------------------------------------------------------------- RESULTS.md
def fmt(x, spec=".1f"):
    """A number, or the values of several seeds as "mean (min–max)"; "–" for none."""
    if x is None or x == []:
        return "–"
    if not isinstance(x, list):
        return format(x, spec)
    if len(x) == 1:
        return format(x[0], spec)
    return f"{format(sum(x) / len(x), spec)} ({format(min(x), spec)}–{format(max(x), spec)})"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


class Lookup:
    """What the tables read from the eval records ({variant: {seed: record}}): each metric as the
    list of its values over the seeds that ran (empty, shown "–", for a variant or τ that did not)."""

    def __init__(self, results):
        self.results = results

    def over_seeds(self, n, get):
        vals = [get(r) for _, r in sorted(self.results.get(n, {}).items())]
        return [v for v in vals if v is not None]

    def rec(self, r, t):
        return r["results"].get(str(float(t))) or {}

    def acc(self, n, t=1.0):
        return self.over_seeds(n, lambda r: self.rec(r, t).get("accuracy"))

    def tpf(self, n, t):
        return self.over_seeds(n, lambda r: self.rec(r, t).get("tokens_per_forward"))

    def fam(self, n, f):
        return self.over_seeds(n, lambda r: self.rec(r, 1.0).get("per_family", {}).get(f))

    def nll(self, n):
        return self.over_seeds(n, lambda r: self.rec(r, 1.0).get("reply_nll"))

    def hard(self, n):
        return self.over_seeds(n, lambda r: (r.get("hard") or {}).get("accuracy"))

    def label(self, n):
        return next(iter(self.results[n].values()))["label"] if self.results.get(n) else n

    def steps(self, n):
        return next(iter(self.results[n].values()))["steps"] if self.results.get(n) else "–"

    def seeds(self, n):
        return sorted(self.results.get(n, {}))


def compare(a, b):
    """The verdict on two lists of per-seed values: "higher" or "lower" when their min–max
    ranges do not overlap (the difference exceeds the spread), else "within the spread"; no
    verdict from a single seed (it has no spread to exceed)."""
    if not a or not b:
        return "–"
    if min(len(a), len(b)) < 2:
        return "one seed: no verdict"
    if min(a) > max(b):
        return "higher"
    if max(a) < min(b):
        return "lower"
    return "within the spread"


def results_header(meta):
    """RESULTS.md's title and what was run (command, machine, model and data, A and M, seeds)."""
    return [f"# MARS in miniature: results ({meta['mode']})", "",
            f"Written by `python -m scripts.reproduce{meta['argv']}` on {meta['date']}, {meta['machine']}; "
            f"training and evaluation took {meta['variant_minutes']:.0f} min of process time over all "
            f"variants and seeds (table at the end), this call {meta['minutes']:.0f} min. Model and data: "
            f"`{meta['config']}` (a tiny Qwen2 trained from scratch on the synthetic tasks of "
            f"data/synthetic.py), A = {meta['A']} AR steps, M = {meta['M']} MARS steps, training seeds "
            f"{', '.join(map(str, meta['seeds']))} (init and row order; one data set). Accuracy in % on "
            f"{meta['n_test']} held-out test problems, greedy; \"NLL\" is the mean NLL of the test "
            "problems' reference replies in one-token mode (nats per reply token, `evaluate.py --nll`), "
            f"which keeps separating models once accuracy sits at 100 %; \"hard\" is the accuracy on the "
            f"{meta['n_hard']} longer problems of the hard split at τ = 1. **Every cell with several seeds "
            "is the mean (min–max) over them.** The paper's numbers are Qwen2.5-0.5B / 7B on real "
            "benchmarks (MARS_SPEC §7): compare directions and shapes, not magnitudes.", "",
            f"Checkpoints, training logs and loss curves: `{meta['root']}/s<seed>/<variant>/` (log.jsonl, "
            "loss.png)."]


def paper_tables(q, taus):
    """The tables shaped like the paper's (MARS_SPEC §7), its numbers beside ours: one-token
    mode, block size with / without L_AR, multi-token at τ = 0.95, the τ sweep, Block Diffusion."""
    L = ["", "## One-token mode (τ = 1): does MARS keep AR quality?", ""]
    L += table(["model", "steps", "accuracy", *FAMILY_COLS, "NLL", "hard", "paper avg 0.5B / 7B"],
               [[q.label(n), q.steps(n), fmt(q.acc(n)), *(fmt(q.fam(n, f), ".0f") for f in FAMILY_COLS),
                 fmt(q.nll(n), ".4f"), fmt(q.hard(n)), PAPER_ONE_TOKEN.get(n, "–")]
                for n in ("ar_stage", "ar_sft", "mars_b4")])
    L += ["", "## Block size, with and without L_AR (τ = 1)", ""]
    L += table(["B", "with L_AR", "w/o L_AR", "NLL with", "NLL w/o", "paper with (0.5B)", "paper w/o (0.5B)"],
               [[B, fmt(q.acc(f"mars_b{B}")), fmt(q.acc(f"noar_b{B}")), fmt(q.nll(f"mars_b{B}"), ".4f"),
                 fmt(q.nll(f"noar_b{B}"), ".4f"), *PAPER_B[B]] for B in (4, 8, 16)])
    L += ["", "## w/o L_AR, two ways (B = 4): every row's noisy loss weighted 1 (w_ar = 0) or 1/t as "
          "released (t ~ U[1e-3, 1), §4)", ""]
    L += table(["variant", "acc τ=1", "NLL", "hard", "acc τ=0.95", "tokens/forward τ=0.95"],
               [[q.label(n), fmt(q.acc(n)), fmt(q.nll(n), ".4f"), fmt(q.hard(n)), fmt(q.acc(n, 0.95)),
                 fmt(q.tpf(n, 0.95), ".2f")] for n in ("mars_b4", "noar_b4", "noar_invt_b4")])
    L += ["", "## Multi-token mode, τ = 0.95", ""]
    rows = []
    for n in ("mars_b4", "mars_b8", "mars_b16", "noar_b4", "noar_b8", "noar_b16", "noar_invt_b4", "bidir_b4"):
        a1, a95 = q.acc(n), q.acc(n, 0.95)
        d = [y - x for x, y in zip(a1, a95)] if len(a1) == len(a95) else []
        rows.append([q.label(n), fmt(a1), fmt(a95), fmt(d, "+.1f"), fmt(q.tpf(n, 0.95), ".2f"),
                     PAPER_MULTI.get(n, "–")])
    L += table(["variant", "acc τ=1", "acc τ=0.95", "Δ", "tokens/forward", "paper Δ at tokens/forward"], rows)
    L += ["", "## τ sweep: accuracy / tokens per forward (means over the seeds)", ""]
    sweep = ("mars_b4", "mars_b8", "mars_b16")
    mean = lambda x, spec: fmt([sum(x) / len(x)] if x else None, spec)
    L += table(["τ", *(q.label(n) for n in sweep), "paper 7B GSM8K B=4"],
               [[t, *(f"{mean(q.acc(n, t), '.1f')} / {mean(q.tpf(n, t), '.2f')}" for n in sweep),
                 "{} / {:.2f}".format(*PAPER_SWEEP[t]) if t in PAPER_SWEEP else "–"] for t in taus])
    L += ["", "![accuracy against tokens per forward](tau_sweep.png)", "",
          "## Block-Diffusion style (bidirectional in a block) against MARS, B = 4", ""]
    L += table(["variant", "acc τ=1", *FAMILY_COLS, "NLL", "acc τ=0.95", "tokens/forward τ=0.95",
                "paper avg 0.5B"],
               [[q.label(n), fmt(q.acc(n)), *(fmt(q.fam(n, f), ".0f") for f in FAMILY_COLS),
                 fmt(q.nll(n), ".4f"), fmt(q.acc(n, 0.95)), fmt(q.tpf(n, 0.95), ".2f"), PAPER_BD[n]]
                for n in ("mars_b4", "bidir_b4")])
    return L


METRICS = {  # name: (Lookup getter, format)
    "accuracy τ=1": (lambda q, n: q.acc(n), ".1f"),
    "NLL": (lambda q, n: q.nll(n), ".4f"),
    "hard": (lambda q, n: q.hard(n), ".1f"),
    "accuracy τ=0.95": (lambda q, n: q.acc(n, 0.95), ".1f"),
    "tokens/forward τ=0.95": (lambda q, n: q.tpf(n, 0.95), ".2f"),
}
CLAIMS = [  # (claim, variant A, variant B, metrics)
    ("MARS keeps AR quality", "mars_b4", "ar_sft", ("accuracy τ=1", "NLL", "hard")),
    *[(f"L_AR matters, B = {B}", f"mars_b{B}", f"noar_b{B}", ("accuracy τ=1", "NLL")) for B in (4, 8, 16)],
    ("1/t vs weight 1, w/o L_AR", "noar_invt_b4", "noar_b4",
     ("accuracy τ=1", "NLL", "tokens/forward τ=0.95")),
    ("bidirectional hurts", "bidir_b4", "mars_b4",
     ("accuracy τ=1", "NLL", "accuracy τ=0.95", "tokens/forward τ=0.95")),
    ("larger B, more tokens", "mars_b8", "mars_b4", ("tokens/forward τ=0.95",)),
    ("larger B, more tokens", "mars_b16", "mars_b8", ("tokens/forward τ=0.95",)),
]


def claims_table(q):
    """Each comparison the paper makes, with the seeds behind it and the verdict of `compare`."""
    L = ["", "## What the seeds support", "",
         "Each comparison as mean (min–max) over the seeds of both variants. A is called higher or "
         "lower than B only when the two min–max ranges do not overlap; otherwise the difference is "
         "within the seed-to-seed spread and no claim is made. For NLL, lower is better.", ""]
    rows = []
    for claim, a, b, metrics in CLAIMS:
        for metric in metrics:
            get, spec = METRICS[metric]
            va, vb = get(q, a), get(q, b)
            if not va and not vb:
                continue
            seeds = sorted(set(q.seeds(a)) & set(q.seeds(b)))
            rows.append([claim, metric, f"{q.label(a)}: {fmt(va, spec)}", f"{q.label(b)}: {fmt(vb, spec)}",
                         ", ".join(map(str, seeds)) or "–", compare(va, vb)])
    return L + table(["claim", "metric", "A", "B", "seeds", "A vs B"], rows)


def phase_table(q, n_test):
    """Wrong acceptances by the phase of the prefix (evaluate.py --by-phase), where it ran (the
    first seed)."""
    def ph(n):
        recs = [r for _, r in sorted(q.results.get(n, {}).items())]
        return next((x for r in recs if (x := (r["results"].get(str(PHASE[1])) or {}).get(
            "wrong_steps_by_phase"))), None)
    if not (have := [n for n in PHASE[0] if ph(n)]):
        return []
    L = ["", f"## Where the τ rule goes wrong: by the phase of the prefix (τ = {PHASE[1]}, first seed)", "",
         f"One step of §5 from every prefix of the {n_test} reference replies (`evaluate.py "
         "--by-phase`): the share of steps, among those whose c_0 is right, that also accept a wrong "
         "token. Training forms its noisy blocks at multiples of B from index 0, so only phase 0 "
         "(prefix length a multiple of B) is a case training showed as such; a decoder that accepts "
         "1..B tokens per step meets every phase. The data's four system turns (data/synthetic.py) "
         "vary each row's phase mod 4, so that at B = 4 every reply token is trained at every "
         "lookahead.", ""]
    return L + table(["variant", *(f"phase {r}" for r in ph(have[0]))],  # {phase: [steps, wrong]}
                     [[q.label(n), *(f"{100 * w / max(k, 1):.2f}% of {k}" for k, w in ph(n).values())]
                      for n in have])


def bench_sections(R):
    """The benchmarks' logs that ran (bench_*.txt in R), each with the paper's number beside it."""
    benches = [("Training cost (scripts/bench_train.py)", "bench_train.txt",
                "Paper: about 2x the AR SFT time and about 1.5x its peak memory."),
               ("Decoding speed (scripts/bench_generate.py)", "bench_generate.txt",
                "Paper (7B, GSM8K, τ = 0.95, vs AR with KV cache): no cache 0.90x/0.49x/0.23x at batch "
                "4/8/16; block cache best 1.71x (B_cache 32, batch 4), 1.60x (batch 8), 1.34x (B_cache 16, "
                "batch 16). On a CPU and a 1M-parameter model a forward is cheap and overheads dominate."),
               ("Exact mode (scripts/bench_exact.py)", "bench_exact.txt",
                "Exact mode's output equals AR greedy decoding token for token (exact.py).")]
    L = []
    for title, name, note in benches:
        if os.path.isfile(os.path.join(R, name)):
            with open(os.path.join(R, name)) as f:
                L += ["", f"## {title}", "", note, "", "```", f.read().rstrip(), "```"]
    return L


def write_results(R, results, meta, cmds):
    """R/RESULTS.md: the header, the paper's tables, the claims, the phase table, the benchmarks,
    the masks, the commands that ran and the time per variant."""
    q = Lookup(results)
    L = results_header(meta) + paper_tables(q, meta["taus"]) + claims_table(q)
    L += phase_table(q, meta["n_test"])
    L += bench_sections(R)
    L += ["", "## The attention masks", "", "![MARS attention masks](mask.png)", "", "## Commands", "",
          f"Everything above: `python -m scripts.reproduce{meta['argv']}`. It ran (first seed shown; the "
          "others add `--seed=S` and their own s<S>/ directories):", "", "```"]
    L += cmds + ["```", "", "## Time per variant (seconds summed over the seeds, this machine)", ""]
    total = lambda n, k: sum(r.get(k) or 0 for r in results[n].values())
    L += table(["variant", "seeds", "train", "evaluate"],
               [[q.label(n), len(results[n]), f"{total(n, 'train_s'):.0f}", f"{total(n, 'eval_s'):.0f}"]
                for n in results if results[n]])
    write_text(os.path.join(R, "RESULTS.md"), "\n".join(L) + "\n")


def plot_sweep(R, results):
    """Accuracy against tokens per forward over the τ sweep, the mean over the seeds with the
    min–max of the accuracy as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = Lookup(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {4: "tab:blue", 8: "tab:orange", 16: "tab:green"}
    for n in (n for n in results if results[n]):
        taus = sorted({float(t) for r in results[n].values() for t in r["results"]}, reverse=True)
        pts = [(q.tpf(n, t), q.acc(n, t), t) for t in taus]
        x = [sum(a) / len(a) for a, _, _ in pts]
        y = [sum(b) / len(b) for _, b, _ in pts]
        err = [[m - min(b) for m, (_, b, _) in zip(y, pts)], [max(b) - m for m, (_, b, _) in zip(y, pts)]]
        if n.startswith(("mars", "noar", "bidir")):
            B = int(n.rsplit("_b", 1)[1])
            kind = "mars" if n.startswith("mars") else "bidir" if n.startswith("bidir") else \
                "invt" if "invt" in n else "noar"
            style = {"mars": "-", "bidir": ":", "invt": "-.", "noar": "--"}[kind]
            colour = {"bidir": "tab:purple", "invt": "tab:red"}.get(kind, colours[B])
            ax.errorbar(x, y, yerr=err, fmt=style, marker="o", ms=3, capsize=2, label=q.label(n),
                        color=colour)
            if n == "mars_b4":
                for xi, yi, (_, _, t) in zip(x, y, pts):
                    ax.annotate(f"τ={t}", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
        else:
            ax.errorbar(x[:1], y[:1], yerr=[e[:1] for e in err], fmt="*", ms=10, capsize=2,
                        color="k" if n == "ar_sft" else "0.6", label=q.label(n))
    ax.set(xlabel="tokens per forward", ylabel="accuracy (%)",
           title="τ sweep: accuracy against speed-up (mean, min–max over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(R, "tau_sweep.png"), dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the run
def run_variant(v, P, env, old):
    """Train (unless its checkpoint exists) and evaluate one variant at one seed -> its results
    record. With parallel jobs the output goes to <out_dir>/output.txt instead of the terminal."""
    key, ckpt, t0 = v["key"], v["ckpt"], time.time()
    out = f"{v['out_dir']}/output.txt" if P["jobs"] > 1 else None
    train_s = old.get("train_s") if old and old.get("ckpt") == ckpt else None
    if not os.path.isfile(f"{ckpt}/model.safetensors"):  # train.py resumes a killed run itself
        if not run(v["train_cmd"], env, out=out):
            raise SystemExit(f"{key}: training failed{f' (see {out})' if out else ''}; fix it and re-run "
                             "(finished variants are kept)")
        train_s = time.time() - t0
    t1, evs = time.time(), []
    for i, cmd in enumerate(v["eval_cmds"]):
        tmp = f"{P['R']}/runs/{key}.eval{i}.tmp"
        if not run(cmd + [f"--json={tmp}"], env, out=out):
            raise SystemExit(f"{key}: evaluation failed{f' (see {out})' if out else ''}; fix it and re-run "
                             "(finished variants are kept)")
        evs.append(load_json(tmp))
        os.remove(tmp)
    return {"name": v["name"], "seed": v["seed"], "label": v["label"], "steps": v["steps"], "ckpt": ckpt,
            "eval_key": P["eval_key"], "train_command": " ".join(v["train_cmd"][1:]),
            "eval_commands": [" ".join(c[1:]) for c in v["eval_cmds"]], "limit": P["limit"],
            "train_s": train_s, "eval_s": time.time() - t1,
            "results": {str(float(t)): r for t, r in evs[0].items()}, "hard": evs[1]["1.0"]}


def progress(vs, running, stop, since, every=60):
    """Every `every` seconds, the last step line of each running variant's output file."""
    seen = {}
    while not stop.wait(every):
        for v in [v for v in vs if v["key"] in running]:
            try:
                with open(f"{v['out_dir']}/output.txt") as f:
                    line = next((x for x in reversed(f.readlines()) if " step " in x and "/" in x), "")
            except OSError:
                continue
            if line and seen.get(v["key"]) != line:
                seen[v["key"]] = line
                print(f"[progress] {v['key']}: {line.strip()}  ({since()})", flush=True)


def bench_commands(P, ckpt, quick):
    """The benchmark commands: training cost, decoding speed, exact mode."""
    py, q, d = sys.executable, quick, f"--data_dir={P['data_dir']}"
    return {
        "bench_train": [py, "-m", "scripts.bench_train", f"--config={P['config']}", d,
                        f"--steps={5 if q else 10}", "--modes=ar,mars,mars-noar,bidir"],
        "bench_generate": [py, "-m", "scripts.bench_generate", f"--ckpt={ckpt}", d.replace("_", "-", 1),
                           f"--taus={'0.95' if q else '0.95,0.9'}",
                           f"--block-cache-sizes={'4,16,64' if q else '4,8,16,32,64'}",
                           f"--batch-sizes={'4,16' if q else '4,8,16'}", "--max-new-tokens=96",
                           f"--repeats={2 if q else 5}"],
        "bench_exact": [py, "-m", "scripts.bench_exact", f"--ckpt={ckpt}", d.replace("_", "-", 1),
                        "--block-sizes=4", "--drafts=2,3",
                        "--batch-sizes=1,4", "--tau=0.95", "--max-new-tokens=96",
                        f"--repeats={2 if q else 3}"],
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n")[-1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="steps x 0.25, 100 test problems, small benchmarks, seed 0 unless --seeds")
    p.add_argument("--steps-scale", type=float, help="multiply the config's ar_steps, mars_steps (default 1)")
    p.add_argument("--seeds", help="comma-separated training seeds (default 0,1,2; 0 with --quick)")
    p.add_argument("--limit", type=int, help="test problems per evaluation (default all)")
    p.add_argument("--taus", default=",".join(map(str, TAUS)))
    p.add_argument("--config", default="configs/default.json")
    p.add_argument("--out", default="out/reproduce", help="checkpoints go to OUT/<A>+<M>-<hash>/s<seed>/")
    p.add_argument("--results", default="results", help="paths are relative to the repository root")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process (a 1M-parameter model gains little from more, and "
                        "threads contend badly on a shared machine)")
    p.add_argument("--jobs", type=int, help="variants trained at once, each in its own process "
                   "(default: CPUs / threads, at most 4); on 2 cores two 1-thread jobs finish far "
                   "sooner than one 2-thread job")
    p.add_argument("--only", help="comma-separated variants to run (the AR stage is always run)")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p.parse_args(argv)


def parse_seeds(text):
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
        raise SystemExit(f"{a.config}: epochs={S.epochs:g}; reproduce.py scales ar_steps and mars_steps, "
                         "so use a config with epochs=0")
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


def pending(a, P, vs, cmds):
    """-> (results of the runs done before, {variant: {seed: record}}; the runs still to run);
    adds the first seed's commands to `cmds`."""
    results, todo = {}, []
    for i, v in enumerate(vs):
        key = v["key"]
        if v["seed"] == P["seeds"][0]:
            cmds += [typed(v["train_cmd"])] + [typed(c) for c in v["eval_cmds"]]
        old = load_json(f"{a.results}/runs/{key}.json")
        done = (os.path.isfile(f"{v['ckpt']}/model.safetensors") and old is not None
                and old.get("ckpt") == v["ckpt"] and old.get("eval_key") == P["eval_key"])
        skip = " (done, skipped)" if done else ""
        print(f"[{i + 1}/{len(vs)}] {key}: {v['label']}, seed {v['seed']}, {v['steps']} steps{skip}",
              flush=True)
        if a.dry_run:
            print("\n".join("$ " + " ".join(c) for c in (v["train_cmd"], *v["eval_cmds"])))
        elif done:
            results.setdefault(v["name"], {})[v["seed"]] = old
        else:
            todo.append(v)
    return results, todo


def train_all(a, P, todo, since):
    """Train and evaluate the runs still to run -> {key: record}, `jobs` at a time: every seed's
    AR stage first (its MARS variants start from it and wait for it), then the rest in order."""
    running, jobs = set(), P["jobs"]  # keys of the runs being trained or evaluated now
    futures, halt, failures = {}, threading.Event(), []  # halt: a run failed, start no other

    def one(v):
        if halt.is_set():
            raise SystemExit(f"{v['key']}: not started (an earlier run failed)")
        dep = futures.get(f"ar_stage.s{v['seed']}")
        if v["name"] != "ar_stage" and v.get("stage") != "ar" and dep is not None:
            dep.result()  # submitted before this one, so already running or done: raises its failure
        print(f"\n[start] {v['key']}; {since()}", flush=True)
        running.add(v["key"])
        try:
            r = run_variant(v, P, P["env"], load_json(f"{a.results}/runs/{v['key']}.json"))
        except BaseException as e:
            failures.append(e)
            halt.set()
            print(f"\n[failed] {v['key']}: {e}; {since()}", flush=True)
            raise
        finally:
            running.discard(v["key"])
        save_json(r, f"{a.results}/runs/{v['key']}.json")
        print(f"\n[done] {v['key']}: accuracy at τ=1 {r['results'].get('1.0', {}).get('accuracy')}%, "
              f"NLL {r['results'].get('1.0', {}).get('reply_nll')}; {since()}", flush=True)
        return r

    order = [v for v in todo if v["name"] == "ar_stage"] + [v for v in todo if v["name"] != "ar_stage"]
    stop = threading.Event()
    if jobs > 1:  # their output goes to files: show each running training's latest progress line
        threading.Thread(target=progress, args=(todo, running, stop, since), daemon=True).start()
    pool = ThreadPoolExecutor(jobs)
    try:
        for v in order:
            futures[v["key"]] = pool.submit(one, v)
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)  # all done, or a failure
        if any(f.exception() is not None for f in done):
            raise failures[0] if failures else next(f.exception() for f in done if f.exception())
        return {k: f.result() for k, f in futures.items()}
    finally:  # on a failure or Ctrl-C nothing new starts; the runs under way finish
        pool.shutdown(wait=True, cancel_futures=True)
        stop.set()


def benchmarks(a, P, results, cmds, since):
    """Run the benchmarks on the first seed's mars_b4 (each skipped if its log shows it ran before)."""
    first = (results.get("mars_b4") or {}).get(P["seeds"][0])
    for name, cmd in bench_commands(P, (first or {}).get("ckpt"), a.quick).items():
        log = f"{a.results}/{name}.txt"
        if a.skip_bench or first is None:
            continue
        cmds.append(typed(cmd) + f" > {log}")
        if first_line(log) == shown(cmd):  # this very benchmark ran before
            print(f"\n[bench] {name}: done, skipped ({log})", flush=True)
            continue
        print(f"\n[bench] {name}; {since()}", flush=True)
        if not run(cmd, P["env"], log=log):
            print(f"{name} failed (its output is in {a.results}/{name}.txt); going on", flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    os.chdir(HERE)  # every path is relative to the repository
    t_start = time.time()
    since = lambda: f"{(time.time() - t_start) / 60:.1f} min so far"
    P, vs = plan(a)
    print(f"reproduce: {len(vs)} runs (seeds {P['seeds']}), A={P['A']} AR + M={P['M']} MARS steps, eval on "
          f"{P['limit'] or 'all'} test problems at τ in {P['taus']}; {P['jobs']} job(s) of {a.threads} "
          f"thread(s); checkpoints in {P['root']}, results in {a.results}", flush=True)
    if not a.dry_run:
        os.makedirs(f"{a.results}/runs", exist_ok=True)
    cmds, data_dir = [], P["data_dir"]
    if data_dir != P["S"].data_dir:  # the default data set, built from the sources hashed into root
        dcmd = [sys.executable, "data/synthetic.py", f"--out={data_dir}", f"--seed={P['S'].seed}"]
        cmds.append(typed(dcmd))
        if not os.path.isfile(f"{data_dir}/val.npz") and not a.dry_run and not run(dcmd, P["env"]):
            raise SystemExit("building the data set failed")
    results, todo = pending(a, P, vs, cmds)
    if a.dry_run:
        return
    for r in train_all(a, P, todo, since).values():
        results.setdefault(r["name"], {})[r["seed"]] = r
    names = list(dict.fromkeys(v["name"] for v in vs))  # run order
    results = {n: dict(sorted(results.get(n, {}).items())) for n in names}
    benchmarks(a, P, results, cmds, since)
    run([sys.executable, "-m", "scripts.plot_mask", f"--out={a.results}/mask.png"], P["env"])
    plot_sweep(a.results, results)
    limit = P["limit"]
    n_of = lambda split: min(limit or 10**9, len(read_jsonl(f"{data_dir}/{split}.jsonl")))
    meta = {"mode": "quick" if a.quick else "full" if P["scale"] == 1 and limit is None else "custom",
            "argv": "".join(" " + x for x in argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "config": a.config, "A": P["A"], "M": P["M"], "root": P["root"], "taus": P["taus"],
            "seeds": P["seeds"], "minutes": (time.time() - t_start) / 60,
            "variant_minutes": sum((r.get("train_s") or 0) + r["eval_s"]
                                   for rs in results.values() for r in rs.values()) / 60,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{a.threads} thread(s) per process, {P['jobs']} job(s) at once",
            "n_test": n_of("test"), "n_hard": n_of("hard")}
    write_results(a.results, results, meta, cmds)
    print(f"\nwrote {a.results}/RESULTS.md, runs/, tau_sweep.png, mask.png; {since()}", flush=True)


if __name__ == "__main__":
    main()
