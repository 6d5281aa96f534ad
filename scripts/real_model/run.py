"""One run of the real-model experiment: its configuration, directory and stages.json, and
the few helpers every stage shares (opening a model, a chat prompt's ids, the EOS ids, the
one batching of prompts).

A Run knows where things go and whether a stage is done (its key against stages.json); it
knows nothing of what a stage does (stages.py) or what is measured (evaluation.py, speed.py).
digest() is the stage key: settings, input files and the source of the code a stage runs.
"""

import hashlib
import inspect
import json
import os
import time

import fast
from checkpoint import load_checkpoint
from tokenizer import Tokenizer
from util.atomic import write_json
from util.precision import compute_dtype

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

BASE_DIR = "out/smollm2"

SMOKE = {"n_train": 6, "n_val": 4, "n_test": 4, "n_human": 4, "n_chat": 2, "max_new_tokens": 12,
         "gen_batch": 4,
         "n_eval": 3, "n_tau": 3, "n_timed": 2, "timing_rounds": 1, "n_curve": 2, "curve_steps": None,
         "reuse_rows": None,
         "taus": [1.0, 0.95],
         "taus_base": [1.0], "drafts": [1, 2], "teacher_k": 8, "timing": True,
         "train": {"mars_steps": 2, "batch_size": 2, "micro_batch_size": 2, "ckpt_interval": 1,
                   "eval_interval": 1, "eval_rows": 2}}

STAGES = ("convert", "prompts", "replies", "arrays", "train", "arms", "eval", "results")


def results_dir(name, cfg, smoke):
    """Where the page goes: the config's results_dir, or the run dir's results/ for --smoke."""
    return os.path.join("out", "real_model", name, "results") if smoke else cfg["results_dir"]


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


def train_settings(full, cfg):
    """train.py's settings of a run: the config file's (full: the whole file), then the run's overrides."""
    own = {k: v for k, v in full.items() if not k.startswith("_")}
    return {**own, **cfg.get("train_overrides", {})}


class Run:
    """One configuration's run directory and its stages.json (key and elapsed time per stage)."""

    def __init__(self, name, cfg, cfg_path, full, smoke):
        self.name, self.cfg, self.cfg_path, self.full, self.smoke = name, cfg, cfg_path, full, smoke
        self.dir = os.path.join("out", "real_model", name)
        self.results = results_dir(name, cfg, smoke)
        os.makedirs(self.dir, exist_ok=True)
        os.makedirs(self.data(), exist_ok=True)
        self.manifest_path = os.path.join(self.dir, "stages.json")
        self.manifest = json.load(open(self.manifest_path)) if os.path.isfile(self.manifest_path) else {}

    def train_settings(self):
        return train_settings(self.full, self.cfg)

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
            if rec.get("unfinished"):  # its outputs were all written before a kill: finished now
                self.manifest[name] = {"key": key, "elapsed_s": rec["elapsed_s"], "resumed": True}
                write_json(self.manifest_path, self.manifest)
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


def open_model(path, run, base=BASE_DIR, dtype=None):
    """(model, tokenizer) on the run's device, in `dtype` or the run's ("auto": util.precision's
    choice for the device); the tokenizer is the base model's. The model runs through the engine
    (fast.make_fast, eager): in bf16 a row's tokens do not depend on its batch or its decoder, so
    exact mode is AR and the outputs do not depend on the batching (eval_batch)."""
    ck = load_checkpoint(path, run.cfg["device"], run_dtype(run, dtype))
    return fast.make_fast(ck.model), Tokenizer.from_dir(base)


def arms(run):
    """name -> (train.py's overrides, the stage its weights end with: "mars" or "ar") of each of
    the config's comparison arms; an AR arm (mars_steps 0) runs as many AR steps as the recipe
    runs MARS steps."""
    S, out = run.train_settings(), {}
    for name, over in run.cfg.get("arms", {}).items():
        if over.get("mars_steps") == 0 and "ar_steps" not in over:
            over = {**over, "ar_steps": S["mars_steps"]}
        out[name] = (over, "mars" if over.get("mars_steps", S["mars_steps"]) else "ar")
    return out


def run_dtype(run, name=None):
    """The torch dtype of `name` (default: the config's "dtype"); "auto" is choose_dtype's pick."""
    return compute_dtype(name or run.cfg["dtype"], run.cfg["device"])


def eval_batch(cfg):
    """How many prompts the evaluation decodes at once: "eval_batch", else gen_batch. Outputs do
    not depend on it (a row's numbers do not depend on the rows beside it: tests/test_bf16.py)."""
    return cfg.get("eval_batch") or cfg["gen_batch"]


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


def load_config(name, smoke):
    path = {"cpu": "configs/smollm2-r3.json", "gpu": "configs/smollm2-gpu.json"}.get(name, name)
    path = path if os.path.isfile(path) else f"configs/smollm2-{name}.json"  # --config final: its file
    with open(path) as f:
        full = json.load(f)
    cfg = dict(full["_real_model"])
    if smoke:
        train_over = {**cfg.get("train_overrides", {}), **SMOKE["train"]}
        cfg.update({k: v for k, v in SMOKE.items() if k != "train"}, train_overrides=train_over)
        cfg["shared_data"] = cfg["shared_data"] + "-smoke" if cfg.get("shared_data") else None
    return path, full, cfg


def predict(cfg, S):
    """The plan's minutes per stage from per-unit costs measured on the 2-core CPU (cost_s)."""
    k, arms = cfg["cost_s"], cfg.get("arms", {}).values()
    rows = cfg["n_train"] + cfg["n_val"] + cfg["n_test"] + cfg["n_chat"]
    mars_runs = 1 + sum(a.get("mars_steps", 1) != 0 for a in arms)
    train_steps = S["mars_steps"] * (k["mars_step"] * mars_runs + k["ar_step"] * (len(arms) + 1 - mars_runs))
    teacher = (cfg["n_train"] + cfg["n_val"]) * k.get("teacher_row", 0)
    m = {"replies + teacher": rows * k["reply_row"] + teacher,
         "train + arms": train_steps, "eval": k["eval_fixed"] + cfg["n_eval"] * k["eval_prompt"]}
    return "predicted (no replies reused) " + ", ".join(f"{s} {v / 60:.0f} min" for s, v in m.items()) + \
        f", total about {sum(m.values()) / 60:.0f} min"
