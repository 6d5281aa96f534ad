"""results/RESULTS.md and tau_sweep.png from the saved records alone (docs/spec.md §7): tables
shaped like the paper's, its numbers beside ours, every cell the mean and min–max over the
seeds, the comparisons the seeds do and do not support, and the benchmarks' logs.

The records are what training.py saved ({variant: {seed: record}}, read from
<results>/runs/*.json); this module loads no model and runs nothing. `meta` (the command,
date, machine, times, data sizes) and the command list come from the caller.
"""

import glob
import json
import os

from data.synthetic import FAMILIES
from scripts.reproduce.runs import PHASE, variants
from util.atomic import write_text

FAMILY_COLS = FAMILIES  # data/synthetic.py
# docs/spec.md §7. 0.5B and 7B are six-benchmark averages; the τ sweep is 7B on GSM8K.
PAPER_ONE_TOKEN = {"ar_sft": "28.7 / 56.6", "mars_b4": "30.4 / 58.1"}
PAPER_B = {4: ("30.4", "28.4"), 8: ("29.7", "26.4"), 16: ("29.7", "22.2")}
PAPER_MULTI = {"mars_b4": "0.5B: −1.4 at 1.46; 7B: −1.3 at 1.68", "mars_b8": "7B: 1.82 tok/fwd",
               "mars_b16": "7B: 1.87 tok/fwd"}
PAPER_SWEEP = {1.0: (73.2, 1.00), 0.95: (71.0, 1.79), 0.9: (70.3, 1.96), 0.8: (67.7, 2.19),
               0.7: (63.8, 2.37), 0.6: (60.3, 2.55), 0.5: (56.0, 2.77)}
PAPER_BD = {"mars_b4": "30.4", "bidir_b4": "22.8 (BBH 7.5)"}


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
            "benchmarks (docs/spec.md §7): compare directions and shapes, not magnitudes.", "",
            f"Checkpoints, training logs and loss curves: `{meta['root']}/s<seed>/<variant>/` (log.jsonl, "
            "loss.png)."]


def paper_tables(q, taus):
    """The tables shaped like the paper's (docs/spec.md §7), its numbers beside ours: one-token
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
                "batch 16). On a CPU and a 1M-parameter model a forward is cheap and overheads dominate. "
                "Exact mode's output (the `exact K=` rows, exact.py) equals AR greedy decoding token for "
                "token; the benchmark fails if a row does not.")]
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


def saved_records(R):
    """{variant: {seed: record}} from R/runs/*.json alone, variants in run order, seeds sorted:
    what tau_sweep.png is drawn from (`python -m scripts.reproduce --replot`)."""
    found = {}
    for path in glob.glob(os.path.join(R, "runs", "*.json")):
        with open(path) as f:
            r = json.load(f)
        found.setdefault(r["name"], {})[r["seed"]] = r
    order = [v["name"] for v in variants(1, 1, "")]
    return {n: dict(sorted(found[n].items())) for n in order if n in found}


ZOOM = (3.52, 3.82, 93.5, 101.0)  # x0, x1, y0, y1: the B = 4 runs' multi-token points, side by side


def plot_sweep(R, results):
    """Accuracy against tokens per forward over the τ sweep, the mean over the seeds with the
    min–max of the accuracy as error bars: every variant on the left, the B = 4 runs' τ < 1
    points (which sit within 0.2 tokens per forward of each other) enlarged on the right, with
    their τ; the legend below both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    q = Lookup(results)
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 5.6), gridspec_kw={"width_ratios": [2.1, 1]})
    colours = {4: "tab:blue", 8: "tab:orange", 16: "tab:green"}
    for n in (n for n in results if results[n]):
        taus = sorted({float(t) for r in results[n].values() for t in r["results"]}, reverse=True)
        pts = [(q.tpf(n, t), q.acc(n, t), t) for t in taus]
        x = [sum(a) / len(a) for a, _, _ in pts]
        y = [sum(b) / len(b) for _, b, _ in pts]
        err = [[m - min(b) for m, (_, b, _) in zip(y, pts)], [max(b) - m for m, (_, b, _) in zip(y, pts)]]
        for a in (ax, zoom) if n.endswith("_b4") else (ax,):  # the enlargement: the B = 4 runs only
            if n.startswith(("mars", "noar", "bidir")):
                B = int(n.rsplit("_b", 1)[1])
                kind = "mars" if n.startswith("mars") else "bidir" if n.startswith("bidir") else \
                    "invt" if "invt" in n else "noar"
                style = {"mars": "-", "bidir": ":", "invt": "-.", "noar": "--"}[kind]
                colour = {"bidir": "tab:purple", "invt": "tab:red"}.get(kind, colours[B])
                a.errorbar(x, y, yerr=err, fmt=style, marker="o", ms=3, capsize=2, label=q.label(n),
                           color=colour)
            else:
                a.errorbar(x[:1], y[:1], yerr=[e[:1] for e in err], fmt="*", ms=10, capsize=2,
                           color="k" if n == "ar_sft" else "0.6", label=q.label(n))
        if n == "mars_b4":  # τ = 1 on the left; the rest on the right, the steep part's in a column
            ax.annotate("τ=1.0", (x[0], y[0]), fontsize=7, xytext=(4, 5), textcoords="offset points")
            for xi, yi, (_, _, t) in list(zip(x, y, pts))[1:]:
                if t >= 0.8:
                    zoom.annotate(f"τ={t}", (xi, yi), fontsize=7, xytext=(5, 4), textcoords="offset points")
                else:
                    zoom.annotate(f"τ={t}", (xi, yi), fontsize=7, xytext=(ZOOM[1] - 0.03, yi), va="center",
                                  arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.4"})
    x0, x1, y0, y1 = ZOOM
    ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, lw=0.8, ls="--", color="0.3"))
    ax.annotate("enlarged on the right", (x1, y0), fontsize=7, xytext=(4, -12), textcoords="offset points")
    ax.set(xlabel="tokens per forward", ylabel="accuracy (%)", title="every variant")
    zoom.set(xlim=(x0, x1), ylim=(y0, y1), xlabel="tokens per forward",
             title="B = 4, τ < 1, enlarged")
    for a in (ax, zoom):
        a.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("τ sweep: accuracy against tokens per forward (mean, min–max over seeds)")
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(os.path.join(R, "tau_sweep.png"), dpi=110)
    plt.close(fig)
