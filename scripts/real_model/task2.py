"""MARS on SmolLM2, decided (issue 61; docs/spec.md §2, §4-§8): the paper's protocol on task set v2
(data/tasks/v2: many templates, split by story frame), each arm tuned on validation, stage 2 and
the arm at several seeds, every decode on the engine in batches, intervals clustered by template.

    python -m scripts.real_model --config task2           # configs/smollm2-task2.json, resumable
    python -m scripts.real_model --config task2 --report  # the page again from its results.json

A config whose "_real_model" says "protocol": "tasks2" runs these stages (each skipped when its
outputs are on disk with its key; a killed run is started again with the same command):

  tasks    data/tasks/v2's splits (JSONL, templates.json) and train.npz / val.npz, tokenised with
           the base's chat template, into the run's data/
  sft      stage 1, AR SFT from the base with the config's top-level settings -> sft/ar (shared)
  select   for each ARM ("mars": stage 2, MARS from stage 1's weights, the paper's loss; "ar_sft":
           AR SFT continued from stage 1) and each of its "candidates" ({"lr", "steps"}), train.py
           at the first of "seeds" -> ARM-I-sSEED/ (I the candidate's index); each decodes the
           first "n_val" validation problems (frames neither trained on nor tested) at τ = 1, MARS
           also at the gate's τ (val/NAME_tauT.json). RULE chooses each arm's candidate;
           select.json holds every candidate's numbers, the choice and the rule
  seeds    the chosen candidate of each arm at the other seeds (the data order: train.py's seed)
  check    every stage's recorded settings (mars.json) against the protocol and select.json
           (`violations`) -> protocol.json; a violation stops the run
  evaluate the first n_eval test problems, every decode a piece eval/NAME.json written as it ends:
           both arms at τ = 1 at every seed, MARS's τ sweep ("taus"; at seeds after the first
           "taus_more"), exact mode at K of "drafts" (the first seed), the base at τ = 1, and
           `engine_check`: the engine in float32 against the reference decoders (plain model.py,
           float32, one prompt at a time) on the first n_check problems, every decoder
  report   results.json (task2_page.summarise: the pieces' numbers, clustered intervals) and
           replies.jsonl (every reply, `seed`, `template` and `drafts` on each row), then
           RESULTS.md from results.json alone (task2_page.py)

The evaluation runs on the engine (fast.make_fast; eager: its compiled step pays at batch 1, where
the speed run measured it, and recompiles for each batch shape) in the dtype auto picks, prompts in
batches of eval_batch by the length of their reference solution; in bf16 a row's tokens do not
depend on the rows beside it (the engine's tiles), so the batch does not change a reply. Replies
are graded by data/tasks/v2/grade.py, told whether the reply ended by itself.

What this module does not do: decode (task2_decode.py: the decoders, the pieces, the engine check),
render the page (task2_page.py), choose sizes (the config's).
"""

import json
import os

from data.tasks.v2 import build
from decoding import ar_only
from scripts.real_model.run import BASE_DIR, digest
from scripts.real_model.stages import TRAINING
from scripts.real_model.task2_decode import (
    decode,
    engine_check,
    eval_common,
    load_piece,
    problems_of,
    reference_dtype,
    run_pieces,
)
from scripts.real_model.training import train
from util.atomic import write_json, write_text

ARMS = {"mars": "mars", "ar_sft": "ar"}  # arm -> the stage its weights end with (train.py's release)
STAGES = ("convert", "tasks", "sft", "select", "seeds", "check", "evaluate", "report")
TASK_CODE = tuple(f"data/tasks/v2/{m}.py" for m in ("__init__", "frames", "units", "records")) + \
    ("data/tasks/__init__.py", "data/tasks/pools.py", "data/prepare.py", "data/synthetic.py")
PAPER_LOSS = {"w_ar": 1.0, "ar_target": "tokens", "block_size": 4, "bidirectional": False,
              "inv_t_weight": False}  # §4, §7: CE on both streams, weighted equally, B = 4
PER_RUN = {"out_dir", "init_from", "ar_steps", "mars_steps", "lr", "seed"}  # what stages may differ in
RULE = ("each arm by its own validation accuracy at tau = 1 (the higher wins; ties to the earlier "
        "candidate); MARS only among its candidates whose tokens per forward at the gate's tau reach "
        "its minimum (all of them if none does)")
JSONL_KEYS = ("problem", "family", "frame", "template", "model", "seed", "tau", "drafts", "reply", "tokens",
              "forwards", "finished", "answer", "correct", "ids")
# --smoke: a few problems, 2 steps a stage, two candidates an arm, two seeds; float64 (a re-decode
# gives the same tokens whatever the batch); the τ < 1 low (a tiny random model's masks); a τ at
# the first seed only, as in the real config
SMOKE = {"tasks": {"train": 8, "val": 4, "test": 6}, "threads": 1, "n_val": 4, "n_eval": 6, "n_check": 3,
         "seeds": [0, 1], "taus": [1.0, 0.05, 0.03], "taus_more": [1.0, 0.03], "drafts": [2],
         "max_new_tokens": 12,
         "eval_batch": 2, "dtype": "float64",
         "gate": {"tau": 0.03, "min_tokens_per_forward": 1.5},
         "candidates": {"mars": [{"lr": 1e-4, "steps": 2}, {"lr": 3e-5, "steps": 2}],
                        "ar_sft": [{"lr": 1e-4, "steps": 2}, {"lr": 3e-5, "steps": 3}]},
         "train": {"ar_steps": 2, "batch_size": 2, "micro_batch_size": 2, "bucket_window": 1,
                   "ckpt_interval": 1, "eval_interval": 1, "eval_rows": 2}}


def smoke_config(cfg):
    train_over = {**cfg.get("train_overrides", {}), **SMOKE["train"]}
    return {**cfg, **{k: v for k, v in SMOKE.items() if k != "train"}, "train_overrides": train_over}


# ---------------------------------------------------------------- data and training
def stage_tasks(run):
    c, S = run.cfg, run.train_settings()
    outs = [run.path("data", f)
            for f in ("train.npz", "val.npz", "val.jsonl", "test.jsonl", "templates.json")]
    tok_files = [os.path.join(BASE_DIR, f) for f in sorted(os.listdir(BASE_DIR)) if "tokenizer" in f]
    files = [("file", f) for f in TASK_CODE + tuple(tok_files)]
    key = digest("tasks2", c["seed"], c["tasks"], S["max_len"], *files)
    run.stage("tasks", key, outs,
              lambda: build(run.path("data"), c["seed"], c["tasks"], BASE_DIR, S["max_len"]))


def sft_dir(run):
    return run.path("sft", "ar")


def stage2_name(arm, i, seed):
    """The run dir (under the run's) of an arm's candidate i at a seed."""
    return f"{arm}-{i}-s{seed}"


def stage2_release(run, arm, i, seed):
    return run.path(stage2_name(arm, i, seed), ARMS[arm])


def stage2_overrides(run, arm, cand, seed):
    """train.py's overrides of a stage-2 run: from stage 1's weights, the candidate's lr and steps."""
    steps = {"ar_steps": 0, "mars_steps": cand["steps"]} if arm == "mars" else \
        {"ar_steps": cand["steps"], "mars_steps": 0}
    return {"init_from": sft_dir(run), "lr": cand["lr"], "seed": seed, **steps}


def train_key(run, name, over, upstream):
    S = run.train_settings()
    return digest("task2", name, {**S, **over}, upstream, ("file", run.path("data", "train.npz")),
                  ("file", run.path("data", "val.npz")), *[("file", f) for f in TRAINING])


def train_run(run, name, over, release, upstream=None):
    """train.py into run/NAME with the overrides; its key covers the settings, the data, train.py's
    code and stage 1's key (upstream) -> the key."""
    key = train_key(run, name, over, upstream)
    fresh = run.manifest.get(name, {}).get("key") != key
    run.stage(name, key, [os.path.join(run.path(name), release, "model.safetensors")],
              lambda: train(run, name, over, fresh))
    return key


def stage_sft(run):
    train_run(run, "sft", {"ar_steps": run.train_settings()["ar_steps"], "mars_steps": 0}, "ar")


def train_stage2(run, arm, i, seed):
    cand = run.cfg["candidates"][arm][i]
    return train_run(run, stage2_name(arm, i, seed), stage2_overrides(run, arm, cand, seed), ARMS[arm],
                     run.manifest["sft"]["key"])


# ---------------------------------------------------------------- selection on validation
def val_name(arm, i, tau):
    return f"{arm}-{i}_tau{tau:g}"


def stage_select(run):
    """Every candidate of each arm trained at the first seed and decoded on validation; the rule's
    choice -> select.json."""
    c, seed = run.cfg, run.cfg["seeds"][0]
    keys = {(arm, i): train_stage2(run, arm, i, seed)
            for arm in ARMS for i in range(len(c["candidates"][arm]))}
    problems, common, todo = problems_of(run, "val", c["n_val"]), eval_common(run, "val"), []
    for (arm, i), k in keys.items():
        for t in [1.0] + ([c["gate"]["tau"]] if arm == "mars" else []):
            todo.append((val_name(arm, i, t), digest(common, k, c["n_val"], t),
                         stage2_release(run, arm, i, seed),
                         lambda m, tok, arm=arm, t=t: decode(run, m, tok, problems, arm, seed, "tau", t)))
    run_pieces(run, todo, "val")
    out = run.path("select.json")
    run.stage("select", digest("select", [k for _, k, _, _ in todo], RULE, c["gate"], ("code", choose)),
              [out], lambda: write_json(out, selection(run)))


def val_numbers(piece):
    rows = piece["rows"]
    return {"n": len(rows), "correct": sum(r["correct"] for r in rows),
            "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "tokens_per_forward": sum(r["tokens"] for r in rows) / sum(r["forwards"] for r in rows)}


def choose(cands, gate=None):
    """RULE: the index of the chosen candidate from each one's {"1": numbers[, gate τ: numbers]}."""
    ok = [i for i, v in enumerate(cands)
          if gate is None or v[f"{gate['tau']:g}"]["tokens_per_forward"] >= gate["min_tokens_per_forward"]]
    pool = ok or range(len(cands))
    return max(pool, key=lambda i: (cands[i]["1"]["accuracy"], -i))


def selection(run):
    c = run.cfg
    out = {"rule": RULE, "gate": c["gate"], "n_val": c["n_val"], "seed": c["seeds"][0], "arms": {}}
    for arm in ARMS:
        taus = [1.0] + ([c["gate"]["tau"]] if arm == "mars" else [])
        vals = [{f"{t:g}": val_numbers(load_piece(run, "val", val_name(arm, i, t))) for t in taus}
                for i in range(len(c["candidates"][arm]))]
        i = choose(vals, c["gate"] if arm == "mars" else None)
        dirs = [run.path(stage2_name(arm, j, c["seeds"][0])) for j in range(len(vals))]
        cands = [{"settings": s, "val": v, "val_loss": val_losses(d)}
                 for s, v, d in zip(c["candidates"][arm], vals, dirs)]
        out["arms"][arm] = {"candidates": cands, "chosen": i, "chosen_settings": c["candidates"][arm][i]}
        print(f"[select] {arm}: candidate {i} {c['candidates'][arm][i]}", flush=True)
    return out


def val_losses(out_dir):
    """The validation records of a train.py run (its log.jsonl): [{step, val_loss, val_l_mask, val_l_ar}]."""
    recs = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]
    return [{k: r.get(k) for k in ("stage", "step", "val_loss", "val_l_mask", "val_l_ar")}
            for r in recs if r["kind"] == "val"]


def chosen(run):
    """arm -> its chosen candidate's index (select.json)."""
    sel = json.load(open(run.path("select.json")))
    return {arm: sel["arms"][arm]["chosen"] for arm in ARMS}


def stage_seeds(run):
    for arm, i in chosen(run).items():
        for seed in run.cfg["seeds"][1:]:
            train_stage2(run, arm, i, seed)


# ---------------------------------------------------------------- the protocol's check
def recorded(run):
    """name -> train.py's settings as each run's release recorded them: "sft" and (arm, seed)."""
    read = lambda d: json.load(open(os.path.join(d, "mars.json")))["settings"]  # noqa: E731
    out = {"sft": read(sft_dir(run))}
    for arm, i in chosen(run).items():
        for seed in run.cfg["seeds"]:
            out[f"{arm} seed {seed}"] = read(stage2_release(run, arm, i, seed))
    return out


def violations(rec, sft, choice, seeds):
    """What breaks the protocol in the runs' recorded settings (rec: recorded()'s); [] when stage 1
    is AR alone; every arm-seed run starts from stage 1's weights (sft), trains one stage (MARS
    with the paper's loss, or AR), with its arm's chosen lr and steps (choice: arm -> settings) and
    its seed; every other setting equals stage 1's; and the seeds are the config's, each once."""
    s1, out = rec["sft"], []
    if not (s1["ar_steps"] > 0 and s1["mars_steps"] == 0):
        out.append(f"stage 1 is not AR SFT alone: ar_steps {s1['ar_steps']}, mars_steps {s1['mars_steps']}")
    for arm, cand in choice.items():
        for seed in seeds:
            name, r = f"{arm} seed {seed}", rec.get(f"{arm} seed {seed}")
            if r is None:
                out.append(f"{name}: no run")
                continue
            steps = (r["mars_steps"], r["ar_steps"]) if arm == "mars" else (r["ar_steps"], r["mars_steps"])
            if steps != (cand["steps"], 0):
                out.append(f"{name} trains ar_steps {r['ar_steps']}, mars_steps {r['mars_steps']}: its "
                           f"choice is {cand['steps']} {'MARS' if arm == 'mars' else 'AR'} steps alone")
            if r["lr"] != cand["lr"]:
                out.append(f"{name}'s lr is {r['lr']!r}, its arm's choice {cand['lr']!r}")
            if r["seed"] != seed:
                out.append(f"{name}'s seed is {r['seed']!r}")
            if os.path.normpath(r["init_from"]) != os.path.normpath(sft):
                out.append(f"{name} starts from {r['init_from']!r}, not stage 1's {sft!r}")
            if arm == "mars":
                out += [f"{name}'s {k} is {r[k]!r}, the paper's {v!r}"
                        for k, v in PAPER_LOSS.items() if r[k] != v]
            out += [f"{name}'s {k} is {r.get(k)!r}, stage 1's {s1.get(k)!r}"
                    for k in sorted((set(s1) | set(r)) - PER_RUN) if r.get(k) != s1.get(k)]
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        out.append(f"seeds {seeds}: at least two, each once")
    return out


def stage_check(run):
    out = run.path("protocol.json")
    ch = chosen(run)
    files = [os.path.join(sft_dir(run), "mars.json")] + [
        os.path.join(stage2_release(run, a, i, s), "mars.json")
        for a, i in ch.items() for s in run.cfg["seeds"]]
    key = digest("check2", *[("file", f) for f in files + [run.path("select.json")]], ("code", violations))

    def make():
        sel = json.load(open(run.path("select.json")))
        choice = {arm: sel["arms"][arm]["chosen_settings"] for arm in ARMS}
        rec = recorded(run)
        found = violations(rec, sft_dir(run), choice, run.cfg["seeds"])
        record = {"violations": found, "sft_dir": sft_dir(run), "choice": choice, "seeds": run.cfg["seeds"],
                  "settings": rec}
        if found:  # not protocol.json: a run started again must not find the check done
            write_json(run.path("protocol_violations.json"), record)
            raise SystemExit("the run broke the protocol:\n  " + "\n  ".join(found))
        write_json(out, record)
        print(f"[check] the protocol holds: {out}", flush=True)
    run.stage("check", key, [out], make)


# ---------------------------------------------------------------- the evaluation on test
def test_pieces(run):
    """[(name, model label, seed, kind, arg)] in run order: the headline first (both arms at τ = 1 at
    every seed), then the τ rule and exact mode, the base last."""
    c, s0, out = run.cfg, run.cfg["seeds"][0], []
    for s in c["seeds"]:
        out += [(f"ar_sft_s{s}_tau1", "ar_sft", s, "tau", 1.0), (f"mars_s{s}_tau1", "mars", s, "tau", 1.0)]
    for s in c["seeds"]:
        taus = c["taus"] if s == s0 else c["taus_more"]
        out += [(f"mars_s{s}_tau{t:g}", "mars", s, "tau", t) for t in taus if not ar_only(t)]
        out += [(f"mars_s{s}_exact{k}", "mars", s, "exact", k) for k in (c["drafts"] if s == s0 else ())]
    return out + [("base_tau1", "base", None, "tau", 1.0)]


def weights_of(run, model, seed):
    if model == "base":
        return BASE_DIR
    return stage2_release(run, model, chosen(run)[model], seed)


def stage_evaluate(run):
    if json.load(open(run.path("protocol.json")))["violations"]:
        raise SystemExit(f"{run.path('protocol.json')}: the run broke the protocol; nothing is evaluated")
    c, ch = run.cfg, chosen(run)
    problems, common = problems_of(run, "test", c["n_eval"]), eval_common(run, "test")
    train_keys = {(a, s): run.manifest[stage2_name(a, i, s)]["key"]
                  for a, i in ch.items() for s in c["seeds"]}
    todo = []
    for name, model, seed, kind, arg in test_pieces(run):
        k = digest(common, c["n_eval"], train_keys.get((model, seed)), kind, arg,
                   ("file", os.path.join(BASE_DIR, "model.safetensors")) if model == "base" else None)
        todo.append((name, k, weights_of(run, model, seed),
                     lambda m, tok, model=model, seed=seed, kind=kind, arg=arg:
                     decode(run, m, tok, problems, model, seed, kind, arg)))
    mars0 = weights_of(run, "mars", c["seeds"][0])
    todo.append(("engine_check", digest(common, c["n_check"], train_keys[("mars", c["seeds"][0])], "check",
                                        c["taus"], c["drafts"], str(reference_dtype(run)),
                                        ("code", engine_check)), mars0,
                 lambda m, tok: engine_check(run, mars0, tok, problems[:c["n_check"]])))
    keys = [k for _, k, _, _ in todo]
    run.stage("evaluate", digest(keys), [run.path("eval", f"{n}.json") for n, _, _, _ in todo],
              lambda: run_pieces(run, todo, "eval"))


# ---------------------------------------------------------------- report
def reply_rows(run):
    """Every reply of the test pieces on disk, in test_pieces' order."""
    return [r for name, *_ in test_pieces(run) if os.path.isfile(run.path("eval", f"{name}.json"))
            for r in load_piece(run, "eval", name)["rows"]]


def earlier_page(run):
    """The results.json in the run's results_dir when it is another protocol's (it must move below
    first: the report would overwrite it), else None."""
    old = os.path.join(run.results, "results.json")
    if os.path.isfile(old) and json.load(open(old))["config"].get("protocol") != "tasks2":
        return old
    return None


def stage_report(run):
    outs = [os.path.join(run.results, f) for f in ("results.json", "replies.jsonl", "RESULTS.md")]
    key = digest("report2", *[run.manifest.get(s, {}).get("key") for s in ("check", "evaluate", "select")],
                 *[("file", f"scripts/real_model/{m}.py")
                   for m in ("task2_page", "task2", "task2_decode", "clustered")])
    run.stage("report", key, outs, lambda: write_results(run))


def write_results(run, partial=False):
    """replies.jsonl and results.json (task2_page.results_of) into the results dir, then RESULTS.md from
    results.json alone; `partial` (--partial): from the pieces on disk so far, the page marked partial."""
    from scripts.real_model import task2_page

    old = earlier_page(run)
    if old:
        raise SystemExit(f"{old} is an earlier run's (issue 54's protocol): move its pages below "
                         f"{run.results} first (earlier runs are kept below the page)")
    res = task2_page.results_of(run, partial)
    os.makedirs(run.results, exist_ok=True)
    rows = reply_rows(run)
    write_text(os.path.join(run.results, "replies.jsonl"),
               "".join(json.dumps({k: r[k] for k in JSONL_KEYS}) + "\n" for r in rows))
    write_json(os.path.join(run.results, "results.json"), res)
    task2_page.write_page(res, run.results)
    print(f"[report] {run.results}: results.json, replies.jsonl ({len(rows)} rows), RESULTS.md"
          f"{' (partial)' if partial else ''}", flush=True)


def stage_losses(run):
    """Each run's validation records (train.py's log.jsonl): stage 1, and each arm's chosen candidate
    at each seed, those finished (released)."""
    runs = {"sft": (run.path("sft"), "ar")}
    if os.path.isfile(run.path("select.json")):
        runs.update({f"{arm} seed {s}": (run.path(stage2_name(arm, i, s)), ARMS[arm])
                     for arm, i in chosen(run).items() for s in run.cfg["seeds"]})
    return {name: val_losses(d) for name, (d, release) in runs.items()
            if os.path.isfile(os.path.join(d, release, "model.safetensors"))}  # finished runs only


def predict(cfg, S):
    """Minutes per stage from per-unit costs (cost_s): a training step; per problem a decode at τ = 1,
    at τ < 1 and exact mode at each K; the engine check per problem."""
    k, seeds = cfg["cost_s"], cfg["seeds"]
    cands = [c["steps"] for a in ARMS for c in cfg["candidates"][a]]
    more = sum(cfg["candidates"][a][0]["steps"] for a in ARMS) * (len(seeds) - 1)  # about: the first's steps
    n_val_dec = sum(len(cfg["candidates"][a]) for a in ARMS)
    m = {"sft": S["ar_steps"] * k["step"],
         "select": sum(cands) * k["step"] + cfg["n_val"] * (n_val_dec * k["ar_problem"] +
                                                           len(cfg["candidates"]["mars"]) * k["tau_problem"]),
         "seeds": more * k["step"],
         "evaluate": cfg["n_eval"] * (k["ar_problem"] * (2 * len(seeds) + 1) +
                                     k["tau_problem"] * (len(cfg["taus"]) - 1 + (len(seeds) - 1) *
                                                         (len(cfg["taus_more"]) - 1)) +
                                     sum(k["exact_problem"][str(d)] for d in cfg["drafts"])) +
         cfg["n_check"] * k["check_problem"]}
    return "predicted " + ", ".join(f"{s} {v / 60:.0f} min" for s, v in m.items()) + \
        f", in all about {sum(m.values()) / 60:.0f} min"
