"""Rows made once and kept in git: `--export-rows` copies a run's prompts and replies (text
and ids, not the teacher arrays: they are large and recomputed in minutes) into
results/real_model/data/NAME with meta.json; a later run whose settings match imports them
and computes only the teacher again (replies.row_teacher).

This module knows where committed rows live and whether they fit a run (rows_settings); the
replies themselves are made by replies.py, and the stage keys are stages.py's.
"""

import json
import os
import subprocess

import numpy as np

from scripts.real_model.replies import REPLY_SPLITS, TEACHER_SPLITS, row_teacher, template_tail
from scripts.real_model.run import BASE_DIR, GGUF, Progress, open_model
from util.atomic import atomic_write, write_json

COMMITTED = os.path.join("results", "real_model", "data")  # rows made once, kept in git (text)


def committed_dir(run):
    """results/real_model/data/NAME: where a run's rows are committed (NAME as in Run.data)."""
    return os.path.join(COMMITTED, run.cfg.get("shared_data") or run.name)


def copy_atomic(src, dst):
    """Copy src to dst through dst.tmp and a rename (util.atomic): a killed copy leaves no half file
    under a stage's output name."""
    with open(src, "rb") as f:
        data = f.read()
    atomic_write(dst, lambda out: out.write(data), "wb")


def rows_settings(run):
    """What a run's replies depend on, besides the code that made them: committed rows are
    used by a run whose settings these are, made by whatever commit meta.json names."""
    c = run.cfg
    return {"sizes": [c["seed"], c["n_train"], c["n_val"], c["n_test"], c["n_human"], c["n_chat"]],
            "max_new_tokens": c["max_new_tokens"], "gen_batch": c["gen_batch"],
            "max_prompt_tokens": c["max_prompt_tokens"], "reply_temperature": c.get("reply_temperature", 0.0),
            "base": GGUF}


def committed_rows(run):
    """results/real_model/data/NAME (NAME = shared_data or the run's name) when it holds rows
    made with this run's settings (`--export-rows` wrote it), else None. Rows of other settings
    are not used: the run makes its own, and says why."""
    d = committed_dir(run)
    meta_path = os.path.join(d, "meta.json")
    if not os.path.isfile(meta_path):
        return None
    meta = json.load(open(meta_path))
    if meta.get("settings") != rows_settings(run):
        print(f"[rows] {d} holds rows of other settings ({meta.get('settings')}): not used", flush=True)
        return None
    return d


def reusable_rows(run):
    """{(for a train row, prompt text): row} of the committed rows named by the config's
    "reuse_rows" whose generation settings are this run's (reply cap, prompt cap, batch, base):
    the replies stage takes a chunk's replies from there when it has them all. Greedy rows
    serve every split (and train rows of a greedy run); train rows sampled at the run's
    reply_temperature serve train rows only. {} without "reuse_rows"."""
    name = run.cfg.get("reuse_rows")
    if not name:
        return {}
    d = os.path.join(COMMITTED, name)
    meta = json.load(open(os.path.join(d, "meta.json")))
    mine, theirs = rows_settings(run), meta["settings"]
    if any(mine[k] != theirs[k] for k in ("max_new_tokens", "gen_batch", "max_prompt_tokens", "base")):
        raise SystemExit(f"reuse_rows: {d} was made with other settings ({theirs})")
    temp = mine["reply_temperature"]
    out = {}
    for split in sorted(meta["rows"]):
        greedy = split != "train" or theirs["reply_temperature"] == 0
        for line in open(os.path.join(d, f"{split}.jsonl")):
            r = json.loads(line)
            text = r["messages"][0]["content"]
            if greedy:
                out[(False, text)] = r
            if (greedy and temp == 0) or (split == "train" and theirs["reply_temperature"] == temp):
                out[(True, text)] = r
    return out


def import_rows(run, d):
    """The committed replies into the run's data dir, and the teacher arrays computed again from
    them (teacher_topk: one teacher-forced forward per train / held-out row)."""
    model, tok = open_model(BASE_DIR, run, dtype=run.cfg.get("data_dtype"))
    tail = template_tail(tok)
    for split in REPLY_SPLITS:
        rows = [json.loads(line) for line in open(os.path.join(d, f"{split}.jsonl"))]
        if split in TEACHER_SPLITS:
            k, progress = run.cfg["teacher_k"], Progress(f"replies: {split} teacher", len(rows), "rows")
            progress(0)  # the rate (and the ETA) counts from here
            # filled in place: thousands of small arrays kept between the forwards' large
            # temporaries fragment the heap (the process grew by GBs)
            n = [len(r["reply_ids"]) + (len(tail) if r["finished"] else 0) for r in rows]
            off = np.concatenate([[0], np.cumsum(n, dtype=np.int64)])
            arrays = {"t_logp": np.zeros((off[-1], k), np.float16), "t_ids": np.zeros((off[-1], k), np.int32),
                      "t_rest": np.zeros(off[-1], np.float32), "t_offsets": off}
            for i, r in enumerate(rows):
                for name, a in zip(("t_logp", "t_ids", "t_rest"), row_teacher(model, r, tail, k)):
                    arrays[name][off[i]:off[i + 1]] = a
                if (i + 1) % 100 == 0 or i + 1 == len(rows):
                    progress(i + 1)
            atomic_write(run.data(f"{split}_teacher.npz"), lambda f, a=arrays: np.savez(f, **a), "wb")
        copy_atomic(os.path.join(d, f"{split}.jsonl"), run.data(f"{split}.jsonl"))


def export_rows(run):
    """--export-rows: the run's prompts and replies (text and ids, not the teacher arrays) into
    results/real_model/data/NAME with meta.json (the settings, the commit, the counts), for git."""
    d = committed_dir(run)
    os.makedirs(d, exist_ok=True)
    for name in ("prompts.json", *[f"{s}.jsonl" for s in REPLY_SPLITS]):
        copy_atomic(run.data(name), os.path.join(d, name))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    counts = {s: sum(1 for _ in open(run.data(f"{s}.jsonl"))) for s in REPLY_SPLITS}
    meta = {"settings": rows_settings(run), "made_by_commit": git.stdout.strip() or None, "rows": counts,
            "replies_key": run.manifest["replies"]["key"]}
    write_json(os.path.join(d, "meta.json"), meta)
    print(f"[rows] exported {counts} to {d}", flush=True)
