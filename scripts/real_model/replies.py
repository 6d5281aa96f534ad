"""The training rows: the base model's own replies to the prompts (self-distillation), its
top-k next-token distribution at every reply position (the teacher arrays), and the arrays
train.py reads (train.npz, val.npz) built from the generated ids.

The replies are made in chunks of gen_batch prompts, each chunk its own file, so a killed
run resumes; this module does not decide when a stage runs (stages.py) nor where committed
rows come from (committed.py). The teacher is one teacher-forced forward per row
(teacher_topk), the distribution mars.teacher_kl trains the clean stream against.
"""

import json
import os

import numpy as np
import torch

from data.prepare import add_teacher, prepare, prepare_generated, save_npz
from generate import generate_ar
from sampling import GREEDY, Sampling
from scripts.real_model.run import BASE_DIR, Progress, chat_ids, chunks, digest, eos_of, open_model
from tokenizer import Tokenizer
from util.atomic import atomic_write, write_json, write_text

REPLY_SPLITS = ("train", "val", "test", "chat")  # test, chat: evaluation only
TEACHER_SPLITS = ("train", "val")  # the rows train.py reads (train.npz, val.npz)


def make_replies(run, key, reuse=None):
    """The base's replies in chunks of gen_batch prompts, each chunk its own file (a chunk whose
    key matches is kept: resumable), then one JSONL (and teacher .npz) per split. The prompts
    with a reply in `reuse` ({(train row?, prompt text): row}, committed.reusable_rows: made by
    an earlier run with the same generation settings) are chunked apart from the others; their
    chunks take those replies and compute the teacher only."""
    c = run.cfg
    model, tok = open_model(BASE_DIR, run, dtype=c.get("data_dtype"))
    prompts = json.load(open(run.data("prompts.json")))
    os.makedirs(run.data("replies"), exist_ok=True)
    plan = []  # (split, chunk index, [prompt items])
    for split in REPLY_SPLITS:
        items = [p for p in prompts[split] if len(chat_ids(tok, p["text"])) <= c["max_prompt_tokens"]]
        have = [(split == "train", p["text"]) in (reuse or {}) for p in items]
        for part in ([p for p, h in zip(items, have) if h], [p for p, h in zip(items, have) if not h]):
            for idx in chunks([len(p["text"]) for p in part], c["gen_batch"]):  # reused chunks apart
                plan.append((split, sum(s == split for s, *_ in plan), [part[j] for j in idx]))
    progress = Progress("replies", sum(len(p) for *_, p in plan), "prompts")
    done = 0
    for split, i, items in plan:
        path = run.data("replies", f"{split}_{i:04d}.json")
        ck = digest(key, [p["id"] for p in items])
        if not (os.path.isfile(path) and json.load(open(path))["key"] == ck):
            reply_chunk(run, model, tok, split, i, items, ck, reuse or {})
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


def reply_chunk(run, model, tok, split, i, items, ck, reuse):
    """One chunk: the replies (greedy; sampled at reply_temperature for train rows if set; or
    all of them from `reuse`), and for the rows train.py reads, the base's top-k at every
    reply position."""
    c = run.cfg
    ids = [chat_ids(tok, p["text"]) for p in items]
    old = [reuse.get((split == "train", p["text"])) for p in items]
    if all(old):
        reply_ids = [r["reply_ids"] for r in old]
    else:
        temp = c.get("reply_temperature", 0.0) if split == "train" else 0.0  # evaluation: greedy always
        sampling = Sampling(temperature=temp, seed=c["seed"] * 100003 + i) if temp > 0 else GREEDY
        reply_ids = [g.ids for g in generate_ar(model, ids, c["max_new_tokens"], eos_of(tok), sampling)]
    rows = [reply_row(tok, p, r, pid) for p, r, pid in zip(items, reply_ids, ids)]
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
    return {"id": prompt["id"], "kind": prompt["kind"], "group": prompt.get("group"), "finished": finished,
            "prompt_ids": prompt_ids, "reply_ids": ids,
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


def make_arrays(run):
    """train.npz / val.npz from the generated ids (data/prepare.prepare_generated) with the teacher
    arrays; counts the rows whose re-tokenised text would have given other ids."""
    tok, S, stats = Tokenizer.from_dir(BASE_DIR), run.train_settings(), {}
    tail = template_tail(tok)
    for split, name in (("train", "train"), ("val", "val")):
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
                       "groups": len({r.get("group") for r in rows}),
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
