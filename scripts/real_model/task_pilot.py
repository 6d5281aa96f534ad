"""The task protocol's pilot on validation (issue 54: "steps and lr chosen on validation"): which
training settings the run on test uses, chosen before test is read.

    python -m scripts.real_model --config task --pilot

For each candidate of the config's "pilot" (train.py settings, every candidate naming the same ones,
e.g. {"lr": 3e-05, "ar_steps": 64}; the paper uses one lr for both stages, so a candidate's lr holds
for stage 1 and stage 2 alike): protocol.py's tasks, sft and mars stages in the candidate's run dir
(protocol.run_name: the first candidate, the config's proposal, in the main run's; another in
name-KEYVALUE), so the run on test that follows, with the config's settings set to the choice, runs
in the chosen candidate's dir and reuses its stages 1 and 2. Then MARS decodes the first n_eval
*validation* problems (templates neither trained on nor tested) at τ = 1 and at the pilot's τ, each
a piece under eval_val/ (task_eval.py, resumable as the evaluation is). The AR arm is not trained
here: it would cost a stage 2 per candidate, and the rule does not read it.

The rule, fixed before the pilot ran, is RULE (`choose`). The choice is written to
results_dir/pilot.json with every candidate's numbers, and PILOT.md from it; the config's top-level
settings are then set to it by hand (tests/test_task_protocol.py checks that the committed config
runs what the committed pilot chose).

Stage 2's steps are not a candidate here: stage 2 and the arm must train on the same rows equally
often (protocol.violations), so their steps are whole epochs, and on the 2-core CPU a second epoch
(about 60 min more for stage 2 and the arm) would take the run past the issue's 2.5 hours; a
candidate with "mars_steps": 224 is how a larger budget adds it. Stage 1's steps are free: 64 (0.57
of an epoch) or 112 (one, as stage 2).
"""

import json
import os

from scripts.common import machine
from scripts.real_model import protocol
from scripts.real_model.run import Run, digest, train_settings
from scripts.real_model.stages import stage_convert
from scripts.real_model.task_eval import decode_name, decode_summary, evaluate, load_piece, piece_path
from scripts.real_model.task_page import pct, points, tpf
from util.atomic import write_json, write_text

RULE = ("among the candidates whose tokens per forward at the pilot's tau reach min_tokens_per_forward "
        "(the issue's 1.5 at tau = 0.95), the one with the highest validation accuracy at that tau (the "
        "issue's headline: the tau rule's accuracy); ties broken by the accuracy at tau = 1, then by the "
        "order of the list (the config's own first); if none reaches it, the same order over all")


def candidate_run(name, cfg, path, full, smoke, cand):
    """A Run of the candidate: the config with the candidate's train.py settings, evaluated on val."""
    p = cfg["pilot"]
    rcfg = {**cfg, "train_overrides": {**cfg.get("train_overrides", {}), **cand}, "eval_split": "val",
            "taus": [1.0, p["tau"]], "n_eval": p["n_eval"]}
    return Run(protocol.run_name(name, cfg, train_settings(full, rcfg)), rcfg, path, full, smoke)


def stage_pilot_eval(run):
    """MARS's validation replies at τ = 1 and the pilot's τ (the evaluation's decode pieces, keyed as
    they are, under eval_val/)."""
    names = [decode_name("mars", t) for t in run.cfg["taus"]]
    keys = {n: k for n, k in protocol.eval_keys(run).items() if n in names}
    run.stage("pilot_eval", digest(sorted(keys.items())), [piece_path(run, n) for n in keys],
              lambda: evaluate(run, protocol.model_dirs(run), keys))


def candidate_numbers(run):
    """A candidate's validation numbers (decode_summary of its two pieces) and its stages' records."""
    tau = run.cfg["taus"][1]
    ref = load_piece(run, decode_name("mars", 1.0))
    at = {1.0: decode_summary(ref), tau: decode_summary(load_piece(run, decode_name("mars", tau)), ref)}
    keep = ("n", "correct", "accuracy", "ci95", "tokens_per_forward", "tpf_ci95", "families", "vs_tau1",
            "identical_to_tau1")
    return {"run_dir": run.dir, "stages": {s: run.manifest[s] for s in ("sft", "mars")},
            "problems": [r["problem"] for r in ref["rows"]],
            "val": {f"{t:g}": {k: v for k, v in s.items() if k in keep} for t, s in at.items()}}


def choose(candidates, tau, min_tpf):
    """The index of the candidate RULE chooses, from each one's "val" numbers."""
    t = f"{tau:g}"
    ok = [i for i, c in enumerate(candidates) if c["val"][t]["tokens_per_forward"] >= min_tpf]
    pool = ok or range(len(candidates))
    val = [c["val"] for c in candidates]
    return max(pool, key=lambda i: (val[i][t]["accuracy"], val[i]["1"]["accuracy"], -i))


def run_pilot(name, path, full, cfg, smoke, results):
    """Every candidate's stages and validation pieces, then the rule -> results/pilot.json, PILOT.md."""
    p, rows = cfg["pilot"], []
    for cand in p["candidates"]:
        run = candidate_run(name, cfg, path, full, smoke, cand)
        print(f"[pilot] candidate {cand}: run dir {run.dir}", flush=True)
        for stage in (stage_convert, protocol.stage_tasks, protocol.stage_sft, protocol.stage_mars,
                      stage_pilot_eval):
            stage(run)
        rows.append({"settings": cand, **candidate_numbers(run)})
    i = choose(rows, p["tau"], p["min_tokens_per_forward"])
    out = {"rule": RULE, "tau": p["tau"], "min_tokens_per_forward": p["min_tokens_per_forward"],
           "n_eval": p["n_eval"], "split": "val", "chosen": i, "chosen_settings": p["candidates"][i],
           "candidates": rows, "command": f"python -m scripts.real_model --config {path} --pilot" +
           (" --smoke" if smoke else ""), "machine": machine(cfg["device"])}
    os.makedirs(results, exist_ok=True)
    write_json(os.path.join(results, "pilot.json"), out)
    write_text(os.path.join(results, "PILOT.md"), pilot_page(out))
    print(f"[pilot] chosen: {p['candidates'][i]} -> {os.path.join(results, 'pilot.json')}", flush=True)
    return out


def pilot_page(res):
    """PILOT.md from pilot.json alone: the rule, each candidate's validation numbers, the choice."""
    t = f"{res['tau']:g}"
    lines = ["# The task protocol's pilot, on validation", "",
             f"`python -m scripts.real_model --config task --pilot`: MARS (stage 2 after AR SFT) decodes the "
             f"first {res['n_eval']} validation problems (templates never trained on, none of test's) at "
             f"tau = 1 and tau = {t}, for each candidate's settings (both stages). Written by "
             f"scripts/real_model/task_pilot.py from pilot.json. {res['machine']}.", "",
             f"Rule (fixed before the pilot ran): {res['rule']}.", "",
             f"| candidate | accuracy tau = 1 | accuracy tau = {t} | change vs tau = 1, points | "
             f"tokens/forward tau = {t} | chosen |", "|---|---|---|---|---|---|"]
    for i, c in enumerate(res["candidates"]):
        a, b = c["val"]["1"], c["val"][t]
        chosen = "**yes**" if i == res["chosen"] else ""
        lines.append(f"| `{json.dumps(c['settings'])}` | {pct(a['accuracy'], a['ci95'])} | "
                     f"{pct(b['accuracy'], b['ci95'])} | {points(b['vs_tau1'])} | "
                     f"{tpf(b['tokens_per_forward'], b['tpf_ci95'])} | {chosen} |")
    lines += ["", f"Chosen: `{json.dumps(res['chosen_settings'])}`; configs/smollm2-task.json runs it on "
              "test.", ""]
    return "\n".join(lines)
