"""The page of issue 61's run (task2.py): results.json from the run's saved pieces, RESULTS.md from
results.json alone (`--report`).

Every interval is clustered and paired (scripts/real_model/clustered.py): templates resampled, then
problems within each drawn template, the same draw for every arm and τ compared; the page states
each interval's half-width. Pooled over seeds, a problem's result is the mean of its seeds' (0, 0.5
or 1), so seeds are averaged before problems and templates are resampled. "Share of τ = 1 accuracy
kept" is accuracy at τ over accuracy at τ = 1 on the same problems, the paper's 7B GSM8K beside it
(PAPER_7B: the paper's τ sweep on Qwen2.5-7B, GSM8K, B = 4: accuracy and tokens per forward).

A run not yet finished gets a partial page (`--partial`): the same numbers from the pieces on disk,
each section where its pieces are, the page marked partial; the report stage's page replaces it.

What this module does not know: models, decoding (task2.py).
"""

import json
import os

import numpy as np

from scripts.common import machine
from scripts.real_model.clustered import paired_bootstrap
from scripts.real_model.task2 import ARMS, stage_losses, test_pieces
from scripts.real_model.task2_decode import load_piece, problems_of
from util.atomic import write_text

PAPER_7B = {"1": (73.2, 1.00), "0.95": (71.0, 1.79), "0.9": (70.3, 1.96), "0.8": (67.7, 2.19),
            "0.7": (63.8, 2.37), "0.6": (60.3, 2.55), "0.5": (56.0, 2.77)}  # §7: accuracy %, tokens/forward
PAPER_KEPT = {t: acc / PAPER_7B["1"][0] for t, (acc, _) in PAPER_7B.items()}  # share of τ = 1 accuracy kept
DRAWS = 2000


def table(run):
    """{(model, seed, kind, arg): {problem id: reply row}} of every test piece on disk."""
    return {(m, s, k, a): {r["problem"]: r for r in load_piece(run, "eval", n)["rows"]}
            for n, m, s, k, a in test_pieces(run) if os.path.isfile(run.path("eval", f"{n}.json"))}


def mean_pct(a):
    return 100 * a.mean()


def diff_pct(a, b):
    return 100 * (b.mean() - a.mean())


def ratio(num, den):
    return num.sum() / den.sum()


def kept(a1, a):
    return a.mean() / a1.mean() if a1.mean() else float("nan")


def summarise(t, ids, groups, seeds, frames=None):
    """results.json's numbers from the table t (table()) on the problems `ids`, clustered by `groups`
    (their templates); "pooled" over seeds: each problem's mean over its seeds' pieces."""
    def col(key, field="correct"):
        return np.array([float(t[key][i][field]) for i in ids])

    def boot(values, stat):  # the clustered, paired interval of stat over aligned arrays
        return paired_bootstrap(lambda idx: stat(*(v[idx] for v in values)), groups, DRAWS)

    def acc(keys):
        return np.mean([col(k) for k in keys], 0)

    def speed(keys):  # tokens per forward of the pieces together
        return boot([sum(col(k, "tokens") for k in keys), sum(col(k, "forwards") for k in keys)], ratio)

    def identical(keys):  # the share of replies equal, token for token, to the same seed's τ = 1 reply
        same = [t[k][i]["ids"] == t[("mars", k[1], "tau", 1.0)][i]["ids"] for k in keys for i in ids]
        return sum(same) / len(same)

    def runs(have):  # (label, seeds): each seed, then all of them where there are several
        return [(s, [s]) for s in have] + ([("pooled", have)] if len(have) > 1 else [])

    tau1 = lambda m, ss: [(m, s, "tau", 1.0) for s in ss]  # noqa: E731
    out = {"tau1": {}, "sweep": [], "exact": [], "base": None, "families": {}}
    seeds = [s for s in seeds if all(k in t for k in tau1("ar_sft", [s]) + tau1("mars", [s]))]  # on disk
    if not seeds:
        return out
    for label, ss in runs(seeds):
        a, m = acc(tau1("ar_sft", ss)), acc(tau1("mars", ss))
        out["tau1"][str(label)] = {"ar_sft": boot([a], mean_pct), "mars": boot([m], mean_pct),
                                   "mars_minus_ar_sft": boot([a, m], diff_pct)}
    if frames is not None:  # a sensitivity row: the pooled difference, frames resampled instead of templates
        a, m = acc(tau1("ar_sft", seeds)), acc(tau1("mars", seeds))
        by_frame = paired_bootstrap(lambda idx: diff_pct(a[idx], m[idx]), frames, DRAWS)
        out["tau1"]["pooled" if len(seeds) > 1 else str(seeds[0])]["by_frame"] = by_frame
    for kind in ("tau", "exact"):
        for arg in sorted({k[3] for k in t if k[0] == "mars" and k[2] == kind}, reverse=kind == "tau"):
            for label, ss in runs([s for s in seeds if ("mars", s, kind, arg) in t]):
                keys = [("mars", s, kind, arg) for s in ss]
                a1, a = acc(tau1("mars", ss)), acc(keys)
                row = {"seed": label, "accuracy": boot([a], mean_pct), "tokens_per_forward": speed(keys),
                       "identical_to_tau1": identical(keys), "n": len(ids)}
                if kind == "tau":
                    row.update(tau=arg, kept=boot([a1, a], kept), change=boot([a1, a], diff_pct),
                               finished=float(np.mean([col(k, "finished") for k in keys])),
                               paper_kept=PAPER_KEPT.get(f"{arg:g}"),
                               paper_tokens_per_forward=PAPER_7B.get(f"{arg:g}", (None, None))[1])
                else:
                    row.update(drafts=arg)
                out["sweep" if kind == "tau" else "exact"].append(row)
    have_base = ("base", None, "tau", 1.0) in t
    base = col(("base", None, "tau", 1.0)) if have_base else None
    out["base"] = boot([base], mean_pct) if have_base else None
    pooled = {m: acc(tau1(m, seeds)) for m in ARMS}
    fams = {}
    for i, p in enumerate(ids):
        fams.setdefault(t[("ar_sft", seeds[0], "tau", 1.0)][p]["family"], []).append(i)
    out["families"] = {f: {"n": len(ix), "base": float(100 * base[ix].mean()) if have_base else None,
                           **{m: float(100 * pooled[m][ix].mean()) for m in ARMS}}
                       for f, ix in sorted(fams.items())}
    return out


def last_val_l_ar(recs):
    return next((r["val_l_ar"] for r in reversed(recs or []) if r["val_l_ar"] is not None), None)


def targets(res):
    """The issue's targets, those whose numbers are there (a partial page has fewer):
    [{"target", "reached", "met"}]."""
    n, out = res["numbers"], []
    d = n["tau1"].get("pooled", {}).get("mars_minus_ar_sft")
    if d:
        out += [("MARS - AR SFT at tau = 1 (pooled seeds): half-width <= 3 points", f"{d['half_width']:.1f}",
                 d["half_width"] <= 3),
                ("MARS - AR SFT at tau = 1: point estimate >= -1 point", f"{d['estimate']:+.1f}",
                 d["estimate"] >= -1)]
    s1 = last_val_l_ar(res["val_losses"].get("sft", []))
    for name, recs in res["val_losses"].items():
        v = last_val_l_ar(recs)
        if name != "sft" and v is not None and s1 is not None:
            out.append((f"{name}: validation L_AR at its end <= stage 1's end ({s1:.4f})", f"{v:.4f}",
                        v <= s1))
    pooled = {f"{r['tau']:g}": r for r in n["sweep"] if r["seed"] == "pooled"}
    for tau, kept_min, tpf_min in (("0.95", 0.95, 1.5), ("0.8", 0.85, None)):
        if tau in pooled:
            k = pooled[tau]["kept"]["estimate"]
            out.append((f"tau = {tau}: share of tau = 1 accuracy kept >= {100 * kept_min:.0f} % (pooled)",
                        f"{100 * k:.1f} %", k >= kept_min))
            if tpf_min:
                v = pooled[tau]["tokens_per_forward"]["estimate"]
                out.append((f"tau = {tau}: tokens per forward >= {tpf_min}", f"{v:.3f}", v >= tpf_min))
    for e in n["exact"]:
        if e["drafts"] == 4:
            v = e["tokens_per_forward"]["estimate"]
            out.append((f"exact K = 4 (seed {e['seed']}): AR's replies on every problem",
                        f"{100 * e['identical_to_tau1']:.1f} %", e["identical_to_tau1"] == 1.0))
            out.append((f"exact K = 4 (seed {e['seed']}): tokens per forward >= 2.3", f"{v:.3f}", v >= 2.3))
    for name, v in (res["engine_check"] or {"decoders": {}})["decoders"].items():
        out.append((f"the engine = the reference ({res['engine_check']['dtype']}), {name}: every reply",
                    f"{100 * v['equal']:.0f} % of {v['n']}", v["equal"] == 1.0))
    if res["protocol"]:
        out.append(("the protocol's check: no violation", str(len(res["protocol"]["violations"])),
                    not res["protocol"]["violations"]))
    return [{"target": a, "reached": b, "met": bool(c)} for a, b, c in out]


def read(path):
    return json.load(open(path)) if os.path.isfile(path) else None


def results_of(run, partial=False):
    """results.json: the numbers (summarise), the targets, the selection, the check, the validation
    losses, the data's layout, the engine check, the settings and the machines; `partial`: from
    whatever is on disk, the pieces still missing named (else each must be there)."""
    problems = problems_of(run, "test", run.cfg["n_eval"])
    ids, groups = [p["id"] for p in problems], [p["template"] for p in problems]
    names = [n for n, *_ in test_pieces(run)] + ["engine_check"]
    missing = [n for n in names if not os.path.isfile(run.path("eval", f"{n}.json"))]
    if missing and not partial:
        raise SystemExit(f"{run.path('eval')}: pieces missing: {missing}")
    res = {"config": run.cfg, "train_settings": run.train_settings(),
           "partial": {"missing": missing, "of": len(names)} if partial else None,
           "stages": {k: v for k, v in run.manifest.items() if not v.get("unfinished")},
           "protocol": read(run.path("protocol.json")), "selection": read(run.path("select.json")),
           "val_losses": stage_losses(run),
           "data": {"test_problems": len(ids), "test_templates": len(set(groups)),
                    "test_frames": len({p["frame"] for p in problems}),
                    "layout": json.load(open(run.path("data", "templates.json")))},
           "numbers": summarise(table(run), ids, groups, run.cfg["seeds"],
                                [p["frame"] for p in problems]),
           "engine_check": None if "engine_check" in missing else load_piece(run, "eval", "engine_check"),
           "eval_machines": sorted({load_piece(run, "eval", n)["machine"] for n in names[:-1]
                                    if n not in missing}),
           "run": {"command": f"python -m scripts.real_model --config {run.cfg_path}" +
                   (" --smoke" if run.smoke else ""), "smoke": run.smoke,
                   "machine": machine(run.cfg["device"])}}
    res["targets"] = targets(res)
    return res


def ci(b, scale=1.0, digits=1):
    """'estimate [lo, hi] ±half' of a paired_bootstrap result, times `scale`."""
    f = lambda x: f"{x * scale:.{digits}f}"  # noqa: E731
    return f"{f(b['estimate'])} [{f(b['ci95'][0])}, {f(b['ci95'][1])}] ±{f(b['half_width'])}"


def intro(res):
    c, S, dat, part = res["config"], res["train_settings"], res["data"], res.get("partial")
    head = ["# MARS on SmolLM2-135M-Instruct, task set v2 (issue 61)", ""]
    if part:
        head += [f"**Partial: the run is not finished.** {part['of'] - len(part['missing'])} of {part['of']} "
                 f"pieces of the evaluation are on disk; missing: {', '.join(part['missing']) or 'none'}. "
                 "Written by `--partial` from them; the report stage's page replaces this one.", ""]
    return head + [
        f"`{res['run']['command']}` (scripts/real_model/task2.py; this page: task2_page.py from "
        f"results.json). Test: {dat['test_problems']} problems from {dat['test_templates']} templates of "
        f"{dat['test_frames']} story frames never trained on. Stage 1: AR SFT, {S['ar_steps']} steps x "
        f"{S['batch_size']} rows at lr {S['lr']:g}; from its weights stage 2 (MARS, the paper's loss, "
        f"B = {S['block_size']}) and the arm (AR SFT continued), each with its own lr and steps chosen "
        f"on validation, at seeds {c['seeds']}. Every interval: 95 %, paired, clustered by template "
        f"({DRAWS} two-stage resamples), ± its half-width.", "",
        "Decoded on: " + ("; ".join(res["eval_machines"]) or "nothing yet") + ".", ""]


def accuracy_tables(n):
    if not n["tau1"]:
        return []
    L = ["## MARS against AR SFT at tau = 1 (accuracy, %)", "",
         "| seed | AR SFT | MARS | MARS - AR SFT, points |", "|---|---|---|---|"]
    L += [f"| {s} | {ci(r['ar_sft'])} | {ci(r['mars'])} | {ci(r['mars_minus_ar_sft'])} |"
          for s, r in n["tau1"].items()]
    last = list(n["tau1"].values())[-1]
    if "by_frame" in last:
        L += ["", "With story frames resampled instead of templates (test has few frames; the templates of "
              f"a frame share its story): MARS - AR SFT {ci(last['by_frame'])} points."]
    if "pooled" in n["tau1"]:
        L += ["", "Pooled: each problem's result is the mean over the seeds, then templates and problems are "
              "resampled; the interval holds the test problems' variation, not the training seeds' (the "
              "seeds' rows show that)."]
    if n["base"]:
        L += ["", f"The base at tau = 1: {ci(n['base'])} %."]
    fmt = lambda x: "" if x is None else f"{x:.1f}"  # noqa: E731
    L += ["", "By family (the seeds pooled, %):", "", "| family | problems | base | AR SFT | MARS |",
          "|---|---|---|---|---|"]
    L += [f"| {f} | {v['n']} | {fmt(v['base'])} | {v['ar_sft']:.1f} | {v['mars']:.1f} |"
          for f, v in n["families"].items()]
    return L + [""]


def sweep_table(n):
    if not n["sweep"]:
        return []
    L = ["## The tau rule and exact mode (MARS)", "",
         "| seed | decoder | accuracy, % | tokens / forward | share of tau = 1 accuracy kept, % | paper 7B: "
         "kept (tokens / forward) | identical to tau = 1 |", "|---|---|---|---|---|---|---|"]
    for r in n["sweep"]:
        paper = (f"{100 * r['paper_kept']:.0f} % ({r['paper_tokens_per_forward']:.2f})"
                 if r["paper_kept"] else "")
        L.append(f"| {r['seed']} | tau = {r['tau']:g} | {ci(r['accuracy'])} | "
                 f"{ci(r['tokens_per_forward'], digits=3)} | {ci(r['kept'], 100)} | {paper} | "
                 f"{100 * r['identical_to_tau1']:.1f} % |")
    for e in n["exact"]:
        L.append(f"| {e['seed']} | exact K = {e['drafts']} | {ci(e['accuracy'])} | "
                 f"{ci(e['tokens_per_forward'], digits=3)} | | | {100 * e['identical_to_tau1']:.1f} % |")
    return L + [""]


def selection_table(sel):
    if not sel:
        return []
    g = f"{sel['gate']['tau']:g}"
    L = ["## Selection on validation", "",
         f"Rule (in the code before any test decode): {sel['rule']}. Gate: tau = {g}, at least "
         f"{sel['gate']['min_tokens_per_forward']} tokens per forward. {sel['n_val']} validation problems "
         f"(frames neither trained on nor tested), seed {sel['seed']}.", "",
         "| arm | candidate | accuracy tau = 1 | tokens / forward at the gate | val loss at the end (L_mask, "
         "L_AR) | chosen |", "|---|---|---|---|---|---|"]
    for arm, a in sel["arms"].items():
        for i, cand in enumerate(a["candidates"]):
            v, end = cand["val"], cand["val_loss"][-1]
            gate = f"{v[g]['tokens_per_forward']:.3f}" if g in v else ""
            mask = "-" if end["val_l_mask"] is None else f"{end['val_l_mask']:.4f}"
            L.append(f"| {arm} | `{json.dumps(cand['settings'])}` | {100 * v['1']['accuracy']:.1f} % "
                     f"({v['1']['correct']}/{v['1']['n']}) | {gate} | {end['val_loss']:.4f} ({mask}, "
                     f"{end['val_l_ar']:.4f}) | {'**yes**' if i == a['chosen'] else ''} |")
    return L + [""]


def write_page(res, d):
    """RESULTS.md from results.json alone."""
    L = intro(res) + ["## Targets", "", "| target | reached | met |", "|---|---|---|"]
    L += [f"| {t['target']} | {t['reached']} | {'yes' if t['met'] else '**no**'} |" for t in res["targets"]]
    n = res["numbers"]
    L += [""] + accuracy_tables(n) + sweep_table(n) + selection_table(res["selection"])
    L += ["## Validation L_AR (train.py's log: the first eval_rows validation rows)", "",
          "| run | first | end |", "|---|---|---|"]
    L += [f"| {name} | {recs[0]['val_l_ar']:.4f} (step {recs[0]['step']}) | {recs[-1]['val_l_ar']:.4f} "
          f"(step {recs[-1]['step']}) |" for name, recs in res["val_losses"].items() if recs]
    ec, p = res["engine_check"], res["protocol"]
    if ec:
        equal = ", ".join(f"{k} {100 * v['equal']:.0f} %" for k, v in ec["decoders"].items())
        L += ["", "## The engine = the reference", "",
              f"The evaluation's engine (fast.make_fast, batches of {ec['eval_batch']}) in "
              f"{ec['dtype']} against the reference decoders (plain model.py, one prompt at a time) on the "
              f"first {ec['n']} test problems (MARS, seed {res['config']['seeds'][0]}), replies equal: "
              f"{equal}."]
    if p:
        L += ["", f"The protocol's check: {len(p['violations'])} violations; the choice "
              f"`{json.dumps(p['choice'])}`."]
    L += ["", "Every reply: replies.jsonl (`seed`, `template`, `drafts` on each row).", "",
          res["run"]["machine"], ""]
    write_text(os.path.join(d, "RESULTS.md"), "\n".join(L))


def rewrite(d):
    write_page(json.load(open(os.path.join(d, "results.json"))), d)
    print(f"[report] {d}: RESULTS.md from results.json", flush=True)
