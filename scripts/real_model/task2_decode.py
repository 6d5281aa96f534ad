"""Issue 61's decoding (task2.py's stages call it; docs/spec.md §5, §6, §8): every decode of the
protocol on the engine in batches, written as resumable pieces, and the check that the engine is the
reference.

  decoders      (kind, arg) -> a batch decoder: our AR at τ = 1, the τ rule (window cache), exact mode
  decode        a piece: every problem's reply row (reply_row: counts and the v2 grader's verdict)
  run_pieces    the pieces not on disk with their key, made and written one by one
  eval_common   what every piece's key holds: the settings, the dtype auto resolved to, the code
  engine_check  the engine in float32, batched, against the reference decoders one prompt at a time

A piece's key covers the source of decoders, reply_row and decode and the files in EVAL_CODE and
PROMPT_CODE, so this module's other lines may move without a piece being decoded again.
"""

import json
import os
import time

from checkpoint import load_checkpoint
from data.tasks.v2.grade import is_correct
from decoding import ar_only
from exact import generate_exact
from generate import generate, generate_ar
from scripts.common import machine
from scripts.real_model.evaluation import in_chunks
from scripts.real_model.run import BASE_DIR, chat_ids, digest, eos_of, open_model, run_dtype
from scripts.real_model.stages import DECODING
from tokenizer import Tokenizer
from util.atomic import write_json

EVAL_CODE = DECODING + ("exact.py", "data/tasks/v2/grade.py", "scripts/real_model/evaluation.py") + tuple(
    f"fast/{m}.py" for m in ("__init__", "step", "linear", "attention", "cache", "argmax"))
PROMPT_CODE = ("tokenizer.py", "chat_template.py")  # what turns a problem into the prompt's ids


def problems_of(run, split, n):
    with open(run.path("data", f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f][:n]


def solution_lengths(problems):
    return [len(p["messages"][1]["content"]) for p in problems]


def decoders(run, model, tok):
    """(kind, arg) -> fn(batch of prompts) -> [Generation]: ("tau", T) our AR decoder at T = 1, else
    the τ rule with the window cache, the B of training; ("exact", K) exact mode at K drafts."""
    B, eos, n = run.train_settings()["block_size"], eos_of(tok), run.cfg["max_new_tokens"]

    def fn(kind, arg):
        if kind == "exact":
            return lambda b: generate_exact(model, b, block_size=B, drafts=arg, max_new_tokens=n,
                                            mask_id=tok.mask_id, eos_ids=eos)
        if ar_only(arg):
            return lambda b: generate_ar(model, b, n, eos)
        return lambda b: generate(model, b, block_size=B, tau=arg, max_new_tokens=n, mask_id=tok.mask_id,
                                  eos_ids=eos, cache="window")
    return fn


def reply_row(tok, problem, model, seed, kind, arg, gen):
    """One JSONL row (JSONL_KEYS): a reply, its counts and the v2 grader's verdict (the text without
    its EOS; `finished`: it ended by itself, not at the length cap)."""
    finished = bool(gen.ids) and gen.ids[-1] in eos_of(tok)
    reply = tok.decode(gen.ids[:-1] if finished else gen.ids)
    return {"problem": problem["id"], "family": problem["family"], "frame": problem["frame"],
            "template": problem["template"], "model": model, "seed": seed,
            "tau": 1.0 if kind == "exact" else arg, "drafts": arg if kind == "exact" else None,
            "reply": reply, "tokens": len(gen.ids), "forwards": gen.forwards, "finished": finished,
            "answer": problem["answer"], "correct": is_correct(problem, reply, finished), "ids": gen.ids}


def decode(run, model, tok, problems, label, seed, kind, arg):
    """-> the piece's result: every problem's reply row, decoded in batches of eval_batch."""
    gens = in_chunks(decoders(run, model, tok)(kind, arg), [chat_ids(tok, p["messages"][0]["content"])
                                                            for p in problems],
                     run.cfg["eval_batch"], solution_lengths(problems))
    rows = [reply_row(tok, p, label, seed, kind, arg, g) for p, g in zip(problems, gens)]
    acc = sum(r["correct"] for r in rows) / len(rows)
    tpf = sum(r["tokens"] for r in rows) / sum(r["forwards"] for r in rows)
    print(f"[{label} s{seed} {kind} {arg:g}] accuracy {acc:.3f}, {tpf:.3f} tokens/forward", flush=True)
    return {"model": label, "seed": seed, "kind": kind, "arg": arg, "dtype": str(run_dtype(run)),
            "max_new_tokens": run.cfg["max_new_tokens"], "machine": machine(run.cfg["device"]), "rows": rows}


def run_pieces(run, todo, folder):
    """todo: [(name, key, weights dir, fn(model, tok) -> result)]: each not saved with its key is made
    and written to folder/NAME.json as it ends; the weights of consecutive pieces loaded once."""
    tok, loaded = Tokenizer.from_dir(BASE_DIR), {}
    os.makedirs(run.path(folder), exist_ok=True)
    for name, key, weights, fn in todo:
        path = run.path(folder, f"{name}.json")
        if os.path.isfile(path) and json.load(open(path)).get("key") == key:
            print(f"[{folder}] {name} done before, skipped", flush=True)
            continue
        if weights not in loaded:  # one model in memory at a time
            loaded = {weights: open_model(weights, run)[0]}
        t0 = time.time()
        res = fn(loaded[weights], tok)
        write_json(path, {"key": key, "elapsed_s": round(time.time() - t0, 1), "result": res})
        print(f"[{folder}] {name} in {(time.time() - t0) / 60:.1f} min", flush=True)


def load_piece(run, folder, name):
    return json.load(open(run.path(folder, f"{name}.json")))["result"]


def eval_common(run, split):
    # the dtype auto resolved to: a run resumed on a CPU without bf16 units decodes its pieces again
    return digest("eval2", {k: run.cfg.get(k) for k in ("max_new_tokens", "eval_batch", "dtype", "device")},
                  str(run_dtype(run)),
                  run.train_settings()["block_size"], *[("file", f) for f in EVAL_CODE + PROMPT_CODE],
                  *[("code", f) for f in (decoders, reply_row, decode)],
                  ("file", run.path("data", f"{split}.jsonl")))


def reference_dtype(run):
    """The check's dtype: float32, as `python generate.py` decodes (in the smoke too: the claim is
    float32's)."""
    import torch
    return torch.float32


def engine_check(run, weights, tok, problems):
    """The engine as the evaluation runs it (fast.make_fast, batches of eval_batch), in the
    reference's dtype, against the reference decoders (plain model.py, one prompt at a time), on
    `problems`, at every decoder of the evaluation -> per decoder the share of equal replies."""
    import fast
    dev, dt = run.cfg["device"], reference_dtype(run)
    ref = load_checkpoint(weights, dev, dt).model
    eng = fast.make_fast(load_checkpoint(weights, dev, dt).model)
    prompts = [chat_ids(tok, p["messages"][0]["content"]) for p in problems]
    out = {"dtype": str(dt), "n": len(prompts), "eval_batch": run.cfg["eval_batch"], "decoders": {}}
    for kind, arg in [("tau", t) for t in run.cfg["taus"]] + [("exact", k) for k in run.cfg["drafts"]]:
        want = [decoders(run, ref, tok)(kind, arg)([p])[0] for p in prompts]
        got = in_chunks(decoders(run, eng, tok)(kind, arg), prompts, run.cfg["eval_batch"],
                        solution_lengths(problems))
        same = [a.ids == b.ids and a.forwards == b.forwards for a, b in zip(want, got)]
        out["decoders"][f"{kind} {arg:g}"] = {"equal": sum(same) / len(same), "n": len(same),
                                              "tokens": sum(len(g.ids) for g in got)}
        print(f"[engine_check] {kind} {arg:g}: {sum(same)}/{len(same)} replies equal (tokens and forwards)",
              flush=True)
    return out
