"""The paper's protocol on the task set (issue 54; docs/spec.md §2, §4, §7): a config of this package
whose "_real_model" says "protocol": "tasks" (configs/smollm2-task.json) runs these stages instead
of round 3's replies and arms:

  tasks    data/tasks/: the task set's JSONL splits (by template) and train.npz / val.npz, tokenised
           with the base's chat template (data/prepare.py), into the run's data/
  sft      stage 1, AR SFT from the base: train.py with ar_steps = the config's, mars_steps = 0 -> sft/ar
  mars     stage 2, MARS from stage 1's saved weights (init_from = sft/ar): ar_steps = 0, mars_steps
           = the config's, with the config's loss (the paper's: CE on both streams, w_ar 1, B = 4)
           -> mars/mars
  ar_sft   the comparison at equal compute: AR SFT continued from sft/ar for stage 2's steps, on the
           same rows, lr and schedule -> ar_sft/ar
  check    every stage's recorded settings (its mars.json) read back and checked against the
           protocol (`violations`) -> protocol.json; a violation stops the run
  evaluate the test problems, once, for the base, AR SFT and MARS (task_eval.py): accuracy and
           tokens per forward over the τ sweep, exact mode, the wall clock, the τ rule's ceiling;
           each piece its own eval/NAME.json, skipped when present with its key (resumable)
  report   results.json (the pieces' numbers) and replies.jsonl (every reply of the sweep, graded)
           into results_dir, then RESULTS.md and tau_sweep.png from results.json alone
           (task_page.py; `--report` rewrites them without a model)

and, after convert, ceiling_r3: the ceiling on round 3's open chat (the base's own greedy replies
to configs/smollm2-r3.json's validation prompts) -> eval/ceiling_r3.json; alone, after the base's
conversion: `python -m scripts.real_model --config task --until ceiling_r3` (a few minutes).

"The same rows": train.py draws the rows of step s of a stage as a pure function of (seed, stage,
s) (data/batches.step_rows), so the MARS stage and the AR arm walk the rows in different orders;
with stage 2's steps a whole number of epochs (steps x batch a multiple of the training rows, and of
the length-bucket window) each row is trained on equally often in both, which the check counts.
An equal ORDER would need train.py to draw the arm's rows under the "mars" stage's key.

What this module does not do: measure (task_eval.py), render the page (task_page.py) or decide
the sizes (the config's); it runs train.py through training.train as the other stages do.
"""

import json
import os
from collections import Counter

from data.batches import step_rows
from data.prepare import load_npz
from data.tasks import build
from scripts.real_model.run import BASE_DIR, Run, digest, load_config
from scripts.real_model.stages import DECODING, TRAINING
from scripts.real_model.task_eval import (
    JSONL_KEYS,
    MODELS,
    ceiling_r3,
    evaluate,
    piece_path,
    pieces,
    r3_reached,
    r3_val_pairs,
    reply_rows,
    results_of,
    summarised,
)
from scripts.real_model.task_page import write_page
from scripts.real_model.training import train
from util.atomic import write_json, write_text

STAGE_DIRS = {"sft": ("sft", "ar"), "mars": ("mars", "mars"), "ar_sft": ("ar_sft", "ar")}  # out_dir, release
PROTOCOL_STAGES = ("convert", "ceiling_r3", "tasks", "sft", "mars", "ar_sft", "check", "evaluate", "report")
TASK_CODE = tuple(f"data/tasks/{m}.py" for m in ("__init__", "gsm", "convert", "extract", "pools")) + \
    ("data/prepare.py", "data/synthetic.py")
PAPER_LOSS = {"w_ar": 1.0, "ar_target": "tokens", "block_size": 4, "bidirectional": False,
              "inv_t_weight": False}  # §4, §7: CE on both streams, weighted equally, B = 4
PER_STAGE = {"out_dir", "init_from", "ar_steps", "mars_steps"}  # the settings the stages may differ in
EVAL_KEYS = ("n_eval", "taus", "taus_ar", "max_new_tokens", "eval_batch", "drafts", "n_exact", "n_timed",
             "timing_rounds", "timing_tau", "block_cache", "timed_caches", "dtype", "device",
             "eval_split")  # what evaluate reads
EVAL_CODE = DECODING + ("exact.py", "data/tasks/grade.py") + tuple(
    f"scripts/real_model/{m}.py" for m in ("task_eval", "ceiling", "evaluation", "speed"))
# --smoke: a few problems, 2 steps a stage; 4 training rows, batches of 2 and no length buckets, so that
# stage 2's 2 steps are one whole epoch (the rows check holds); the evaluation on the 4 test problems at
# 2 τ (the second low: a tiny random model's masks, p ~ 0.02-0.07, pass it at times), short replies, in
# float64 (a re-decode gives the same tokens whatever the batch); round 3's prompts with a cap that a
# tiny BPE's ids fit
SMOKE = {"tasks": {"train": 4, "val": 4, "test": 4}, "threads": 1,
         "n_eval": 4, "taus": [1.0, 0.03], "taus_ar": [1.0], "max_new_tokens": 12, "eval_batch": 2,
         "n_exact": 4, "drafts": [2, 4], "n_timed": 2, "timing_rounds": 1, "dtype": "float64",
         "pilot_overrides": {"tau": 0.03, "n_eval": 4, "candidates": [{"lr": 1e-4, "ar_steps": 2},
                                                                     {"lr": 3e-5, "ar_steps": 2}]},
         "r3_overrides": {"max_prompt_tokens": 512},
         "train": {"ar_steps": 2, "mars_steps": 2, "batch_size": 2, "micro_batch_size": 2, "bucket_window": 1,
                   "ckpt_interval": 1, "eval_interval": 1, "eval_rows": 2}}


def is_protocol(cfg):
    return cfg.get("protocol") == "tasks"


def smoke_config(cfg):
    """The run's config shrunk for --smoke (SMOKE over run.load_config's round-3 smoke)."""
    train_over = {**cfg.get("train_overrides", {}), **SMOKE["train"]}
    out = {**cfg, **{k: v for k, v in SMOKE.items() if k not in ("train", "pilot_overrides")},
           "train_overrides": train_over}
    if "pilot" in cfg:
        out["pilot"] = {**cfg["pilot"], **SMOKE["pilot_overrides"]}
    return out


def check_pilot(cfg, path, settings):
    """A clear stop unless the config's pilot candidates each set the same train.py settings, ones the
    config has (settings: the run's), and no two are the same."""
    cands = cfg.get("pilot", {}).get("candidates", [])
    unknown = sorted(set(cands[0]) - set(settings)) if cands else []
    if unknown:
        raise SystemExit(f"{path}: pilot candidate {cands[0]} sets {unknown}, not train.py settings of "
                         "the config")
    for c in cands:
        if set(c) != set(cands[0]):
            raise SystemExit(f"{path}: pilot candidate {c} sets {sorted(c)}, the first "
                             f"{sorted(cands[0])}: every candidate names the same settings")
    if len({json.dumps(c, sort_keys=True) for c in cands}) < len(cands):
        raise SystemExit(f"{path}: the pilot lists a candidate twice: {cands}")


def run_name(name, cfg, settings):
    """The run dir's name for train.py `settings`: name-KEYVALUE when they are a pilot candidate other
    than the first (KEYVALUE: where it differs from the first, e.g. smollm2-task-lr3e-05), else `name`
    (the first candidate: the config's proposal). The pilot's candidates and the run on test after it
    share their stages whatever the config's own settings are by then (task_pilot.py)."""
    cands = cfg.get("pilot", {}).get("candidates", [])
    for c in cands[1:]:
        if all(settings.get(k) == v for k, v in c.items()):
            own = sorted((k, v) for k, v in c.items() if cands[0][k] != v)
            return name + "-" + "-".join(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in own)
    return name


def stage_dir(run, name):
    """Where stage `name`'s released weights are (train.py's out_dir/STAGE)."""
    d, release = STAGE_DIRS[name]
    return run.path(d, release)


def stage_tasks(run):
    c, S = run.cfg, run.train_settings()
    outs = [run.path("data", f) for f in ("train.npz", "val.npz", "test.jsonl", "templates.json")]
    tok_files = [os.path.join(BASE_DIR, f) for f in sorted(os.listdir(BASE_DIR)) if "tokenizer" in f]
    files = [("file", f) for f in TASK_CODE + tuple(tok_files)]
    key = digest("tasks", c["seed"], c["tasks"], S["max_len"], *files)
    make = lambda: build(run.path("data"), c["seed"], c["tasks"], BASE_DIR, S["max_len"])  # noqa: E731
    run.stage("tasks", key, outs, make)


def overrides(run):
    """train.py's overrides of each stage (module docstring)."""
    S, sft = run.train_settings(), stage_dir(run, "sft")
    return {"sft": {"ar_steps": S["ar_steps"], "mars_steps": 0},
            "mars": {"init_from": sft, "ar_steps": 0, "mars_steps": S["mars_steps"]},
            "ar_sft": {"init_from": sft, "ar_steps": S["mars_steps"], "mars_steps": 0}}


def train_stage(run, name):
    """One training stage: train.py with the config and its overrides, into run/NAME; its key covers
    the settings, the data, train.py's code and, for stage 2 and the arm, stage 1's key."""
    S, over = run.train_settings(), overrides(run)[name]
    upstream = run.manifest.get("sft", {}).get("key") if name != "sft" else None
    key = digest("protocol", name, {**S, **over}, upstream, ("file", run.path("data", "train.npz")),
                 ("file", run.path("data", "val.npz")), *[("file", f) for f in TRAINING])
    fresh = run.manifest.get(name, {}).get("key") != key
    run.stage(name, key, [os.path.join(stage_dir(run, name), "model.safetensors")],
              lambda: train(run, STAGE_DIRS[name][0], over, fresh))


def stage_sft(run):
    train_stage(run, "sft")


def stage_mars(run):
    train_stage(run, "mars")


def stage_ar_sft(run):
    train_stage(run, "ar_sft")


def stage_rows(settings, stage, steps, lengths):
    """How often each training row is drawn by `steps` optimizer steps of `stage` (train.py's rows)."""
    S, n = settings, len(lengths)
    rows = (step_rows(n, S["batch_size"], S["seed"], stage, s, lengths, S["bucket_window"])
            for s in range(steps))
    return Counter(i for r in rows for i in r.tolist())


def violations(recorded, sft_dir, lengths):
    """What breaks the protocol in the stages' recorded settings ({"sft", "mars", "ar_sft": train.py's
    settings, as mars.json holds them}); [] when: stage 1 is AR only, stage 2 MARS only with the paper's
    loss, the arm AR only for stage 2's steps; stage 2 and the arm start from stage 1's weights
    (sft_dir); every other setting (lr, schedule, batch, seed, dtype, ...) is the same in all three;
    and stage 2 and the arm draw every training row equally often (lengths: each row's tokens)."""
    sft, mars, arm = recorded["sft"], recorded["mars"], recorded["ar_sft"]
    out = []
    if not (sft["ar_steps"] > 0 and sft["mars_steps"] == 0):
        out.append(f"stage 1 is not AR SFT alone: ar_steps {sft['ar_steps']}, mars_steps {sft['mars_steps']}")
    if not (mars["ar_steps"] == 0 and mars["mars_steps"] > 0):
        out.append(f"stage 2 is not MARS alone: ar_steps {mars['ar_steps']}, mars_steps {mars['mars_steps']}")
    if not (arm["ar_steps"] == mars["mars_steps"] and arm["mars_steps"] == 0):
        out.append(f"the arm runs {arm['ar_steps']} AR steps (+ {arm['mars_steps']} MARS), stage 2 "
                   f"{mars['mars_steps']}")
    out += [f"stage 2's {k} is {mars[k]!r}, the paper's {v!r}" for k, v in PAPER_LOSS.items() if mars[k] != v]
    for name in ("mars", "ar_sft"):
        r = recorded[name]
        if os.path.normpath(r["init_from"]) != os.path.normpath(sft_dir):
            out.append(f"{name} starts from {r['init_from']!r}, not stage 1's {sft_dir!r}")
        out += [f"{name}'s {k} is {r.get(k)!r}, stage 1's {sft.get(k)!r}"
                for k in sorted((set(sft) | set(r)) - PER_STAGE) if r.get(k) != sft.get(k)]
    if stage_rows(mars, "mars", mars["mars_steps"], lengths) != stage_rows(arm, "ar", arm["ar_steps"],
                                                                             lengths):
        out.append("stage 2 and the arm do not train on the same rows equally often (make stage 2's steps a "
                   "whole number of epochs and of bucket windows)")
    return out


def stage_check(run):
    out = run.path("protocol.json")
    releases = [os.path.join(stage_dir(run, n), "mars.json") for n in STAGE_DIRS]
    key = digest("check", *[("file", f) for f in releases], ("file", run.path("data", "train.npz")),
                 ("code", violations), ("code", stage_rows))
    run.stage("check", key, [out], lambda: write_check(run, out))


def write_check(run, out):
    recorded = {n: json.load(open(os.path.join(stage_dir(run, n), "mars.json")))["settings"]
                for n in STAGE_DIRS}
    off = load_npz(run.path("data", "train.npz"))["offsets"]
    found = violations(recorded, stage_dir(run, "sft"), (off[1:] - off[:-1]).tolist())
    write_json(out, {"violations": found, "sft_dir": stage_dir(run, "sft"), "settings": recorded})
    if found:
        raise SystemExit("the run broke the protocol:\n  " + "\n  ".join(found))
    print(f"[check] the protocol holds: {out}", flush=True)


def model_dirs(run):
    """model -> the weights directory evaluated: the base, the arm's and stage 2's releases."""
    return {"base": BASE_DIR, "ar_sft": stage_dir(run, "ar_sft"), "mars": stage_dir(run, "mars")}


def eval_keys(run):
    """piece -> its key: the evaluation's settings, B, the code it runs and the test problems, and
    for a trained model its training stage's key (a piece of the base outlives a new training)."""
    split = run.cfg.get("eval_split", "test")
    common = digest("evaluate", {k: run.cfg.get(k) for k in EVAL_KEYS}, run.train_settings()["block_size"],
                    *[("file", f) for f in EVAL_CODE], ("file", run.path("data", f"{split}.jsonl")),
                    ("file", os.path.join(BASE_DIR, "model.safetensors")))
    trained = {m: run.manifest.get(m, {}).get("key") for m in MODELS if m != "base"}
    return {name: digest(common, trained.get(model), name) for name, model, _, _ in pieces(run.cfg)}


def stage_evaluate(run):
    keys = eval_keys(run)
    run.stage("evaluate", digest(sorted(keys.items())), [piece_path(run, n) for n in keys],
              lambda: evaluate(run, model_dirs(run), keys))


def r3_run(run):
    """Round 3's run (configs/smollm2-r3.json, --smoke shrunk as its own smoke, with the config's
    "r3_overrides"): whose validation prompts ceiling_r3 reads, and its B."""
    path, full, cfg = load_config("r3", run.smoke)
    name = os.path.splitext(os.path.basename(path))[0] + ("-smoke" if run.smoke else "")
    return Run(name, {**cfg, **run.cfg.get("r3_overrides", {})}, path, full, run.smoke), full["block_size"]


def stage_ceiling_r3(run):
    r3, r3_block = r3_run(run)
    sizes = sorted({r3_block, run.train_settings()["block_size"]})
    out = run.path("eval", "ceiling_r3.json")
    key = digest("ceiling_r3", r3.cfg, sizes, run.cfg["taus"],
                 ("file", os.path.join(BASE_DIR, "model.safetensors")),
                 *[("file", f) for f in DECODING + ("data/prompts.py", "scripts/real_model/ceiling.py")],
                 ("code", ceiling_r3), ("code", r3_val_pairs), ("code", summarised))

    def make():
        os.makedirs(run.path("eval"), exist_ok=True)
        write_json(out, {"key": key, "result": ceiling_r3(run, r3, run.cfg["taus"], sizes)})
    run.stage("ceiling_r3", key, [out], make)


def stage_report(run):
    outs = [os.path.join(run.results, f)
            for f in ("results.json", "replies.jsonl", "RESULTS.md", "tau_sweep.png")]
    key = digest("report", *[run.manifest.get(s, {}).get("key") for s in ("check", "evaluate", "ceiling_r3")],
                 r3_reached(), *[("file", f"scripts/real_model/{m}.py") for m in ("task_page", "task_eval")])
    run.stage("report", key, outs, lambda: write_report(run))


def write_report(run):
    """results.json and replies.jsonl from the run's saved pieces, then the page from results.json
    alone (task_page.write_page, as --report does)."""
    os.makedirs(run.results, exist_ok=True)
    rows = reply_rows(run)
    write_text(os.path.join(run.results, "replies.jsonl"),
               "".join(json.dumps({k: r[k] for k in JSONL_KEYS}) + "\n" for r in rows))
    res = results_of(run, json.load(open(run.path("protocol.json")))["violations"],
                     json.load(open(run.path("eval", "ceiling_r3.json")))["result"])
    write_json(os.path.join(run.results, "results.json"), res)
    write_page(res, run.results)
    print(f"[report] {run.results}: results.json, replies.jsonl ({len(rows)} rows), RESULTS.md, "
          "tau_sweep.png", flush=True)


def predict(cfg, S):
    """The plan's minutes per stage from per-unit costs on the 2-core CPU (cost_s): training steps,
    and the evaluation's decoding per test problem (an AR pass, a τ < 1 pass, exact mode at each K),
    the ceiling per reply, the wall clock and round 3's ceiling as wholes."""
    k = cfg["cost_s"]
    m = {"sft": S["ar_steps"] * k["ar_step"], "mars": S["mars_steps"] * k["mars_step"],
         "ar_sft": S["mars_steps"] * k["ar_step"]}
    if "eval_ar_problem" in k:
        tau_passes = len(cfg["taus"]) - 1 + 2 * (len(cfg["taus_ar"]) - 1)  # τ < 1; τ = 1: an AR pass a model
        m["evaluate"] = (cfg["n_eval"] * (3 * k["eval_ar_problem"] + tau_passes * k["eval_tau_problem"] +
                                          3 * k["ceiling_row"]) +
                         cfg["n_exact"] * sum(k["exact_problem"][str(K)] for K in cfg["drafts"]) +
                         k["timing"] + k["ceiling_r3"])
    return "predicted " + ", ".join(f"{s} {v / 60:.0f} min" for s, v in m.items()) + \
        f", in all about {sum(m.values()) / 60:.0f} min"
