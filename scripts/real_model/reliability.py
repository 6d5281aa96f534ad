"""Why the τ rule accepts so little: how reliable the mask candidates' confidences are, per mask
position j (docs/spec.md §5; issue 33).

In a MARS step (§5.1-2) the model forwards [prefix | B masks]; the output at the last prefix
token proposes c_0 (the AR prediction) and the output at mask j-1 proposes c_j, j = 1..B-1.
The τ rule (§5.3-4, generate.accept) keeps c_1, c_2, ... while p_j >= τ. If p_j were
calibrated, the candidates at p_j ≈ 0.95 would be right 95 % of the time; a reliability
diagram per j shows how far from that the masks are, and how many candidates a τ lets through.

At τ = 1 the decoder (generate.mars_decode, window cache) still forwards the masks but accepts
c_0 alone (§5.5), so its output is the greedy AR reply, and each mask candidate c_j of a step
can be scored against the token greedy AR emits j places later: "correct" means accepting it
would have kept the greedy reply there.

  mask_records(model, prompts, ...)   decode at τ = 1; one record per mask candidate with a target
  reliability(records, bins)          per j and metric: binned confidence against accuracy, ECE,
                                      the candidates each τ lets through
  tau_lossless(sweep, tol)            the most aggressive τ whose replies stay within tol of
                                      greedy's NLL under the base
  reliability_figure(by_model, path)  the diagram, one panel per j, one line per model (PNG)
  reliability_lines(by_model)         markdown tables per j for the results page

This module loads no model and chooses no prompts (the caller does); it writes only the figure.
"""

import numpy as np
import torch

from generate import mars_decode
from sampling import GREEDY, METRICS, confidence, confident, pick
from util.atomic import atomic_write

TAUS = (0.5, 0.7, 0.8, 0.9, 0.95)  # the τ values whose passing candidates reliability() counts
# entropy bins in nats, the same for every model; the last bin also holds anything above 16
# (log V <= 16 for any V below 8.9 million, so no entropy is above it in practice)
ENTROPY_EDGES = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
FIELDS = ("prompt", "position", "j", "candidate", "correct") + METRICS


# ---------------------------------------------------------------- the records (decoding at τ = 1)
def step_logits(model, prompts, **decode):
    """Run generate.mars_decode at τ = 1 (window cache) and yield, per step, (active, logits,
    step): the rows that decoded in the step, their logits (len(active), B, V) at [last real
    token, mask 0 .. B-2], and the `Step`. The logits are the decoder's own, caught by a
    forward hook on model.lm_head: window_steps applies the head once per step (logits_at) to
    every row and keeps `[active]`; a finished row's output there is padding and is dropped."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        done = [False] * len(prompts)
        for step in mars_decode(model, prompts, tau=1.0, cache="window", **decode):
            if len(seen) != 1:
                raise RuntimeError(f"expected one lm_head call per window step, saw {len(seen)}: "
                                   "generate.window_steps changed, update step_logits")
            logits, active = seen.pop(), [b for b, d in enumerate(done) if not d]
            if logits.shape[0] != len(active):  # the head ran on every row
                logits = logits[active]
            yield active, logits, step
            done = step.done
    finally:
        hook.remove()


@torch.no_grad()
def mask_records(model, prompts, *, block_size, mask_id, eos_ids, max_new_tokens, batch=16):
    """Decode `prompts` (lists of ids) at τ = 1, `batch` at a time, and score every mask
    candidate c_j (j = 1..B-1, §5.2) whose target exists in the greedy reply.

    -> (records, replies). replies[i]: the greedy reply to prompt i (EOS kept, §5.6).
    records: equal-length numpy columns, one entry per candidate: prompt (index), position
    (k + j, where k = tokens the row had before the step), j, candidate (c_j = the fp32
    argmax, as the decoder picks it), correct (c_j == replies[prompt][k + j]) and one column
    per sampling.METRICS: the confidence the τ rule would read (sampling.confidence, the raw
    fp32 softmax of the decoder's logits)."""
    cols, replies = {f: [] for f in FIELDS}, []
    decode = dict(block_size=block_size, mask_id=mask_id, eos_ids=eos_ids, max_new_tokens=max_new_tokens)
    for lo in range(0, len(prompts), batch):
        out, proposed = [[] for _ in prompts[lo: lo + batch]], []  # proposed: (row, k, c_1.., confs)
        for active, logits, step in step_logits(model, prompts[lo: lo + batch], **decode):
            masks = logits[:, 1:]  # (n_active, B-1, V): the outputs at masks 0 .. B-2
            cand = pick(masks, GREEDY)  # (n_active, B-1): c_1 .. c_{B-1}
            conf = {m: confidence(masks, cand, m).double().cpu().numpy() for m in METRICS}
            for i, b in enumerate(active):
                proposed.append((b, len(out[b]), cand[i].tolist(), {m: conf[m][i] for m in METRICS}))
            for b, toks in enumerate(step.tokens):
                out[b] += toks
        for b, k, cs, conf in proposed:  # the replies are complete: score against them
            for j in range(1, len(cs) + 1):
                if k + j < len(out[b]):
                    row = dict(prompt=lo + b, position=k + j, j=j, candidate=cs[j - 1],
                               correct=cs[j - 1] == out[b][k + j], **{m: conf[m][j - 1] for m in METRICS})
                    for f in FIELDS:
                        cols[f].append(row[f])
        replies += out
    types = dict(prompt=np.int64, position=np.int64, j=np.int64, candidate=np.int64, correct=bool)
    return {f: np.asarray(cols[f], dtype=types.get(f, np.float64)) for f in FIELDS}, replies


# ---------------------------------------------------------------- the summary
def edges_of(metric, bins):
    """Bin edges: probability and margin in `bins` equal bins on [0, 1], edge i = i / bins
    (correctly rounded: 0.9 is the edge 9 / 10 itself); entropy ENTROPY_EDGES."""
    return np.asarray(ENTROPY_EDGES) if metric == "entropy" else np.arange(bins + 1) / bins


def bin_stats(values, correct, edges):
    """Bin i holds edges[i] <= value < edges[i+1]; the last bin also holds its upper edge and
    anything above. -> per bin {lo, hi, count, mean (value), accuracy}; None where empty."""
    idx = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(edges) - 2)
    out = []
    for i in range(len(edges) - 1):
        sel = idx == i
        n = int(sel.sum())
        out.append({"lo": float(edges[i]), "hi": float(edges[i + 1]), "count": n,
                    "mean": float(values[sel].mean()) if n else None,
                    "accuracy": float(correct[sel].mean()) if n else None})
    return out


def position_summary(j, cols, bins):
    """One mask position's summary (see reliability)."""
    p, ok, n = cols["probability"], cols["correct"], len(cols["j"])
    by_metric = {m: bin_stats(cols[m], ok, edges_of(m, bins)) for m in METRICS}
    ece = sum(b["count"] / n * abs(b["accuracy"] - b["mean"]) for b in by_metric["probability"] if b["count"])
    taus = []
    for tau in TAUS:
        passed = confident(p, tau)  # the τ rule's comparison, p_j >= τ (§5.4)
        k = int(passed.sum())
        taus.append({"tau": tau, "count": k, "share": k / n,
                     "accuracy": float(ok[passed].mean()) if k else None})
    return {"j": j, "n": n, "accuracy": float(ok.mean()), "mean_probability": float(p.mean()),
            "ece": float(ece), "bins": by_metric, "tau": taus}


def reliability(records, bins=10):
    """The reliability of the mask candidates, per mask position j (JSON-able).

    records: mask_records' columns (lists or arrays). -> {"edges": {metric: bin edges},
    "positions": [one dict per j present, ascending]}; a position's dict holds j; n; accuracy
    (share of candidates equal to greedy AR's token); mean_probability; ece, the expected
    calibration error of probability, sum over its bins of count / n * |accuracy - mean|;
    bins: {metric: [{lo, hi, count, mean, accuracy}]} (bin_stats: probability and margin in
    `bins` equal bins on [0, 1], entropy in nats on ENTROPY_EDGES); and tau: for each τ of
    TAUS, the candidates whose probability passes it (§5.4, p_j >= τ): count, share of n, and
    their accuracy. These are per position: the rule also needs c_1 .. c_{j-1} to pass."""
    cols = {f: np.asarray(records[f]) for f in ("j", "correct") + METRICS}
    positions = [position_summary(int(j), {f: c[cols["j"] == j] for f, c in cols.items()}, bins)
                 for j in np.unique(cols["j"])]
    return {"edges": {m: edges_of(m, bins).tolist() for m in METRICS}, "positions": positions}


def tau_lossless(sweep, tol=0.03):
    """The most aggressive lossless τ of a sweep (entries {"tau", "tokens_per_forward",
    "nll_under_base", ...}, as evaluation.eval_taus writes them; τ = 1 included).

    Rule: among the entries whose replies' NLL under the base is at most (1 + tol) times the
    τ = 1 (greedy, §5.5) entry's, return the one with the most tokens per forward (a tie goes
    to the larger τ). The τ = 1 entry always qualifies, so there is always an answer."""
    greedy = [e for e in sweep if e["tau"] == 1.0]
    if not greedy:
        raise ValueError(f"the tau sweep has no tau = 1 entry (taus: {[e['tau'] for e in sweep]}): "
                         "the NLL bound is relative to greedy's")
    bound = (1 + tol) * greedy[0]["nll_under_base"]
    ok = [e for e in sweep if e["nll_under_base"] <= bound]
    return max(ok, key=lambda e: (e["tokens_per_forward"], e["tau"]))


# ---------------------------------------------------------------- the figure and the tables
def reliability_figure(by_model, path):
    """by_model: {model name: reliability(...)} -> a PNG at `path` (written atomically): one
    panel per mask position j; per model the accuracy against the mean probability of each
    non-empty probability bin, marker area growing with the bin's count; the diagonal is
    perfect calibration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    js = sorted({p["j"] for r in by_model.values() for p in r["positions"]})
    fig, axes = plt.subplots(1, len(js), figsize=(4 * len(js), 4), squeeze=False)
    for ax, j in zip(axes[0], js):
        ax.plot([0, 1], [0, 1], ":", color="gray", label="calibrated")
        for name, r in by_model.items():
            pos = next((p for p in r["positions"] if p["j"] == j), None)
            pts = [b for b in pos["bins"]["probability"] if b["count"]] if pos else []
            if not pts:
                continue
            line, = ax.plot([b["mean"] for b in pts], [b["accuracy"] for b in pts], "-", label=name)
            ax.scatter([b["mean"] for b in pts], [b["accuracy"] for b in pts], color=line.get_color(),
                       s=[10 + 200 * b["count"] / pos["n"] for b in pts], alpha=0.7)
        ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel=f"probability of c_{j} (bin mean)",
               ylabel="accuracy (c_j = greedy AR's token)", title=f"mask position j = {j}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Reliability of the mask candidates\n(marker area: share of the candidates)")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def cell(v):
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def reliability_lines(by_model, tau=0.9):
    """Markdown lines: per mask position j, a table with a row per model: n, accuracy, mean
    probability, ECE, and the share and accuracy of the candidates passing `tau`."""
    if tau not in TAUS:
        raise ValueError(f"tau must be one of reliability.TAUS {TAUS}, got {tau}")
    lines = []
    for j in sorted({p["j"] for r in by_model.values() for p in r["positions"]}):
        lines += [f"Mask position j = {j} (c_{j}, read at mask {j - 1}):", "",
                  f"| model | n | accuracy | mean probability | ECE | share with p >= {tau:g} "
                  f"| their accuracy |", "|---|---|---|---|---|---|---|"]
        for name, r in by_model.items():
            pos = next((p for p in r["positions"] if p["j"] == j), None)
            if pos is None:
                continue
            t = next(t for t in pos["tau"] if t["tau"] == tau)
            vals = [pos["n"], pos["accuracy"], pos["mean_probability"], pos["ece"], t["share"], t["accuracy"]]
            lines.append(f"| {name} | " + " | ".join(map(cell, vals)) + " |")
        lines.append("")
    return lines
