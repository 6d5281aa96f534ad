"""The page of issue 61's run (task2.py): results.json from the run's saved pieces, RESULTS.md from
results.json alone (`--report`).

Every interval is clustered and paired (scripts/real_model/clustered.py): templates resampled, then
problems within each drawn template, the same draw for every arm and τ compared; the page states
each interval's half-width. Pooled over seeds, a problem's result is the mean of its seeds' (0, 0.5
or 1), so seeds are averaged before problems and templates are resampled. "Share of τ = 1 accuracy
kept" is accuracy at τ over accuracy at τ = 1 on the same problems, the paper's 7B GSM8K beside it
(PAPER_KEPT: the paper's Table of τ on Qwen2.5-7B, 71.0 / 73.2 and 67.3 / 73.2).

What this module does not know: models, decoding (task2.py).
"""

import json
import os

import numpy as np

from scripts.common import machine
from scripts.real_model.clustered import paired_bootstrap
from scripts.real_model.task2 import ARMS, load_piece, problems_of, stage_losses, test_pieces
from util.atomic import write_text

PAPER_KEPT = {"0.95": 71.0 / 73.2, "0.8": 67.3 / 73.2}  # §7: the paper's 7B on GSM8K, share of τ = 1 kept
DRAWS = 2000


def table(run):
    """{(model, seed, kind, arg): rows by problem id} of every test piece."""
    return {(m, s, k, a): {r["problem"]: r for r in load_piece(run, "eval", n)["rows"]}
            for n, m, s, k, a in test_pieces(run)}


def clustered(values, groups, stat):
    """paired_bootstrap of stat(index array) over `values` (arrays aligned with groups)."""
    return paired_bootstrap(lambda idx: stat(*(v[idx] for v in values)), groups, DRAWS)


def mean_pct(a):
    return 100 * a.mean()


def diff_pct(a, b):
    return 100 * (b.mean() - a.mean())


def ratio(num, den):
    return num.sum() / den.sum()


def kept(a1, a):
    return a.mean() / a1.mean() if a1.mean() else float("nan")


def summarise(t, ids, groups, seeds):
    """results.json's numbers from the table t (table()), on problems `ids` grouped by template."""
    col = lambda m, s, k, a, f: np.array([f(t[(m, s, k, a)][i]) for i in ids], float)  # noqa: E731
    ok = lambda r: r["correct"]  # noqa: E731
    acc = {(m, s): col(m, s, "tau", 1.0, ok) for m in ARMS for s in seeds}
    pooled = {m: np.mean([acc[(m, s)] for s in seeds], 0) for m in ARMS}
    out = {"tau1": {}, "sweep": [], "exact": [], "pooled": {}}
    for s in seeds + ["pooled"]:
        a, m = (pooled["ar_sft"], pooled["mars"]) if s == "pooled" else (acc[("ar_sft", s)], acc[("mars", s)])
        out["tau1"][str(s)] = {"ar_sft": clustered([a], groups, mean_pct), "mars": clustered([m], groups, mean_pct),
                               "mars_minus_ar_sft": clustered([a, m], groups, diff_pct)}
    sweep_keys = sorted({(s, a) for (m, s, k, a) in t if m == "mars" and k == "tau"}, key=lambda x: (x[0], -x[1]))
    for s, tau in sweep_keys:
        a1, a = acc[("mars", s)], col("mars", s, "tau", tau, ok)
        tok, fwd = col("mars", s, "tau", tau, lambda r: r["tokens"]), col("mars", s, "tau", tau, lambda r: r["forwards"])
        same = col("mars", s, "tau", tau, lambda r: r["ids"] == t[("mars", s, "tau", 1.0)][r["problem"]]["ids"])
        out["sweep"].append({"seed": s, "tau": tau, "accuracy": clustered([a], groups, mean_pct),
                             "tokens_per_forward": clustered([tok, fwd], groups, ratio),
                             "kept": clustered([a1, a], groups, kept), "change": clustered([a1, a], groups, diff_pct),
                             "identical_to_tau1": float(same.mean()),
                             "finished": float(col("mars", s, "tau", tau, lambda r: r["finished"]).mean()),
                             "paper_kept": PAPER_KEPT.get(f"{tau:g}")})
    both = [tau for tau in {a for (_, a) in sweep_keys} if all((s, tau) in sweep_keys for s in seeds)]
    for tau in sorted(both, reverse=True):
        if tau == 1.0:
            continue
        a = np.mean([col("mars", s, "tau", tau, ok) for s in seeds], 0)
        tok = sum(col("mars", s, "tau", tau, lambda r: r["tokens"]) for s in seeds)
        fwd = sum(col("mars", s, "tau", tau, lambda r: r["forwards"]) for s in seeds)
        out["pooled"][f"{tau:g}"] = {"accuracy": clustered([a], groups, mean_pct),
                                     "tokens_per_forward": clustered([tok, fwd], groups, ratio),
                                     "kept": clustered([pooled["mars"], a], groups, kept),
                                     "paper_kept": PAPER_KEPT.get(f"{tau:g}")}
    for (m, s, k, K) in sorted(x for x in t if x[2] == "exact"):
        tok, fwd = col(m, s, k, K, lambda r: r["tokens"]), col(m, s, k, K, lambda r: r["forwards"])
        same = col(m, s, k, K, lambda r: r["ids"] == t[("mars", s, "tau", 1.0)][r["problem"]]["ids"])
        out["exact"].append({"seed": s, "drafts": K, "tokens_per_forward": clustered([tok, fwd], groups, ratio),
                             "identical_to_tau1": float(same.mean()), "n": len(ids),
                             "accuracy": clustered([col(m, s, k, K, ok)], groups, mean_pct)})
    out["base"] = clustered([col("base", None, "tau", 1.0, ok)], groups, mean_pct)
    fams = {}
    for i, p in enumerate(ids):
        fams.setdefault(t[("ar_sft", seeds[0], "tau", 1.0)][p]["family"], []).append(i)
    out["families"] = {f: {"n": len(ix), **{m: float(100 * pooled[m][ix].mean()) for m in ARMS},
                           "base": float(100 * col("base", None, "tau", 1.0, ok)[ix].mean())}
                       for f, ix in sorted(fams.items())}
    return out


def targets(res):
    """The issue's targets: [(what, reached, met)]."""
    d = res["numbers"]["tau1"]["pooled"]["mars_minus_ar_sft"]
    out = [("MARS - AR SFT at tau = 1 (pooled seeds): half-width <= 3 points",
            f"{d['half_width']:.1f}", d["half_width"] <= 3),
           ("MARS - AR SFT at tau = 1: point estimate >= -1 point", f"{d['estimate']:+.1f}", d["estimate"] >= -1)]
    losses = res["val_losses"]
    end = lambda recs: next((r["val_l_ar"] for r in reversed(recs) if r["val_l_ar"] is not None), None)  # noqa: E731
    s1 = end(losses["sft"])
    for name, recs in losses.items():
        if name != "sft":
            out.append((f"{name}: validation L_AR at its end <= stage 1's end ({s1:.4f})", f"{end(recs):.4f}",
                        end(recs) <= s1))
    pool = res["numbers"]["pooled"]
    for tau, kept_min, tpf_min in (("0.95", 0.95, 1.5), ("0.8", 0.85, None)):
        if tau in pool:
            k = pool[tau]["kept"]["estimate"]
            out.append((f"tau = {tau}: share of tau = 1 accuracy kept >= {100 * kept_min:.0f} % (pooled seeds)",
                        f"{100 * k:.1f} %", k >= kept_min))
            if tpf_min:
                v = pool[tau]["tokens_per_forward"]["estimate"]
                out.append((f"tau = {tau}: tokens per forward >= {tpf_min}", f"{v:.3f}", v >= tpf_min))
    for e in res["numbers"]["exact"]:
        if e["drafts"] == 4:
            v = e["tokens_per_forward"]["estimate"]
            out.append(("exact K = 4: AR's replies on every problem", f"{100 * e['identical_to_tau1']:.1f} %",
                        e["identical_to_tau1"] == 1.0))
            out.append(("exact K = 4: tokens per forward >= 2.3", f"{v:.3f}", v >= 2.3))
    return [{"target": a, "reached": b, "met": bool(c)} for a, b, c in out]


def results_of(run):
    """results.json: the numbers (summarise), the selection, the check, the validation losses, the
    data's layout, the engine check, the settings and the machine."""
    problems = problems_of(run, "test", run.cfg["n_eval"])
    ids, groups = [p["id"] for p in problems], [p["template"] for p in problems]
    res = {"config": run.cfg, "train_settings": run.train_settings(),
           "stages": {k: v for k, v in run.manifest.items() if not v.get("unfinished")},
           "protocol": json.load(open(run.path("protocol.json"))),
           "selection": json.load(open(run.path("select.json"))), "val_losses": stage_losses(run),
           "data": {"test_problems": len(ids), "test_templates": len(set(groups)),
                    "test_frames": len({p["frame"] for p in problems}),
                    "layout": json.load(open(run.path("data", "templates.json")))},
           "numbers": summarise(table(run), ids, groups, run.cfg["seeds"]),
           "engine_check": load_piece(run, "eval", "engine_check"),
           "eval_machines": sorted({load_piece(run, "eval", n)["machine"] for n, *_ in test_pieces(run)}),
           "run": {"command": f"python -m scripts.real_model --config {run.cfg_path}" +
                   (" --smoke" if run.smoke else ""), "smoke": run.smoke, "machine": machine(run.cfg["device"])}}
    res["targets"] = targets(res)
    return res


def ci(b, scale=1.0, fmt="{:.1f}"):
    """'estimate [lo, hi] ±half' of a paired_bootstrap result."""
    e, (lo, hi) = b["estimate"] * scale, b["ci95"]
    f = lambda x: fmt.format(x)  # noqa: E731
    return f"{f(e)} [{f(lo * scale)}, {f(hi * scale)}] ±{f(b['half_width'] * scale)}"


def write_page(res, d):
    """RESULTS.md from results.json alone."""
    n, c, S = res["numbers"], res["config"], res["train_settings"]
    sel, dat = res["selection"], res["data"]
    L = ["# MARS on SmolLM2-135M-Instruct, task set v2 (issue 61)", "",
         f"`{res['run']['command']}` (scripts/real_model/task2.py; this page: task2_page.py from results.json). "
         f"Test: {dat['test_problems']} problems from {dat['test_templates']} templates of {dat['test_frames']} "
         f"story frames never trained on. Stage 1 AR SFT {S['ar_steps']} steps x {S['batch_size']} rows at lr "
         f"{S['lr']:g}; stage 2 (MARS, the paper's loss, B = {S['block_size']}) and the AR SFT arm from stage 1's "
         f"weights, each with its own lr and steps chosen on validation, at seeds {c['seeds']}. Every interval: "
         f"95 %, paired, clustered by template ({DRAWS} two-stage resamples), ± its half-width.", "",
         "Decoded on: " + "; ".join(res["eval_machines"]) + ".", "", "## Targets", "",
         "| target | reached | met |", "|---|---|---|"]
    L += [f"| {t['target']} | {t['reached']} | {'yes' if t['met'] else '**no**'} |" for t in res["targets"]]
    L += ["", "## MARS against AR SFT at tau = 1 (accuracy, %)", "",
          "| seed | AR SFT | MARS | MARS - AR SFT, points |", "|---|---|---|---|"]
    for s, r in n["tau1"].items():
        L.append(f"| {s} | {ci(r['ar_sft'])} | {ci(r['mars'])} | {ci(r['mars_minus_ar_sft'])} |")
    L += ["", f"The base, tau = 1: {ci(n['base'])} %.", "", "By family (pooled seeds, %):", "",
          "| family | problems | base | AR SFT | MARS |", "|---|---|---|---|---|"]
    L += [f"| {f} | {v['n']} | {v['base']:.1f} | {v['ar_sft']:.1f} | {v['mars']:.1f} |" for f, v in n["families"].items()]
    L += ["", "## The tau rule and exact mode (MARS)", "",
          "| seed | decoder | accuracy, % | tokens / forward | share of tau = 1 accuracy kept | paper 7B kept | "
          "identical to tau = 1 |", "|---|---|---|---|---|---|---|"]
    for r in n["sweep"]:
        pk = f"{100 * r['paper_kept']:.0f} %" if r["paper_kept"] else ""
        L.append(f"| {r['seed']} | tau = {r['tau']:g} | {ci(r['accuracy'])} | "
                 f"{ci(r['tokens_per_forward'], fmt='{:.3f}')} | {ci(r['kept'], 100)} % | {pk} | "
                 f"{100 * r['identical_to_tau1']:.1f} % |")
    for e in n["exact"]:
        L.append(f"| {e['seed']} | exact K = {e['drafts']} | {ci(e['accuracy'])} | "
                 f"{ci(e['tokens_per_forward'], fmt='{:.3f}')} | | | {100 * e['identical_to_tau1']:.1f} % |")
    for tau, r in n["pooled"].items():
        pk = f"{100 * r['paper_kept']:.0f} %" if r["paper_kept"] else ""
        L.append(f"| pooled | tau = {tau} | {ci(r['accuracy'])} | {ci(r['tokens_per_forward'], fmt='{:.3f}')} | "
                 f"{ci(r['kept'], 100)} % | {pk} | |")
    L += ["", "## Selection on validation", "", f"Rule (written in the code before any test decode): {sel['rule']}. "
          f"Gate: tau = {sel['gate']['tau']:g}, at least {sel['gate']['min_tokens_per_forward']} tokens per "
          f"forward. {sel['n_val']} validation problems (frames neither trained on nor tested), seed {sel['seed']}.",
          "", "| arm | candidate | val accuracy tau = 1 | gate tokens / forward | val loss at the end (L_mask, L_AR) | "
          "chosen |", "|---|---|---|---|---|---|"]
    g = f"{sel['gate']['tau']:g}"
    for arm, a in sel["arms"].items():
        for i, cand in enumerate(a["candidates"]):
            v, last = cand["val"], cand["val_loss"][-1]
            gate = f"{v[g]['tokens_per_forward']:.3f}" if g in v else ""
            L.append(f"| {arm} | `{json.dumps(cand['settings'])}` | {100 * v['1']['accuracy']:.1f} % "
                     f"({v['1']['correct']}/{v['1']['n']}) | {gate} | {last['val_loss']:.4f} "
                     f"({last['val_l_mask'] if last['val_l_mask'] is None else round(last['val_l_mask'], 4)}, "
                     f"{last['val_l_ar']:.4f}) | {'**yes**' if i == a['chosen'] else ''} |")
    L += ["", "## Validation L_AR (train.py's log, first eval_rows validation rows)", "",
          "| run | first | end |", "|---|---|---|"]
    for name, recs in res["val_losses"].items():
        if recs:
            L.append(f"| {name} | {recs[0]['val_l_ar']:.4f} (step {recs[0]['step']}) | "
                     f"{recs[-1]['val_l_ar']:.4f} (step {recs[-1]['step']}) |")
    ec = res["engine_check"]
    L += ["", "## The engine = the reference", "",
          f"The evaluation's engine (fast.make_fast, batches of {ec['eval_batch']}) in {ec['dtype']} against the "
          f"reference decoders (plain model.py, one prompt at a time) on the first {ec['n']} test problems, MARS "
          "seed " + str(c["seeds"][0]) + ": " + ", ".join(f"{k} {100 * v['equal']:.0f} % equal"
                                                         for k, v in ec["decoders"].items()) + ".",
          "", f"The protocol's check: {len(res['protocol']['violations'])} violations; choice "
          f"`{json.dumps(res['protocol']['choice'])}`. Replies: replies.jsonl (every decode, `seed`, `template`, "
          "`drafts`).", "", res["run"]["machine"], ""]
    write_text(os.path.join(d, "RESULTS.md"), "\n".join(L))


def rewrite(d):
    write_page(json.load(open(os.path.join(d, "results.json"))), d)
    print(f"[report] {d}: RESULTS.md from results.json", flush=True)
