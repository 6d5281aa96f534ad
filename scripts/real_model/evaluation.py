"""The measures of quality: teacher-forced agreement, KL and NLL against the base (a), the
greedy replies against the base's, the τ sweep (b), the learning curve (d), and the replies
side by side for the page; with the inputs every evaluation shares (the test, validation
and general-chat rows, the human paragraphs) and the bootstrap interval over prompts.

Each eval_* takes a Run and returns a JSON-able result; which evaluations run and their key
is stages.py's, the lossless decoders' speed is speed.py's, and the page is report.py's.
"""

import json
import os

import numpy as np
import torch

from exact import generate_exact
from generate import generate, generate_ar, mars_decode
from scripts.real_model.reliability import mask_records, reliability, tau_lossless
from scripts.real_model.run import BASE_DIR, arms, chat_ids, chunks, eos_of, eval_batch, open_model
from tokenizer import Tokenizer


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
    row_kl, row_tokens = {name: [] for name in models}, []  # per row: the cluster bootstrap's items
    device = base.lm_head.weight.device
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        T = max(len(r[0]) for r in part)
        x = torch.tensor([r[0] + [0] * (T - len(r[0])) for r in part], device=device)  # right pad: causal
        sel = torch.tensor([r[1][1:] + [False] * (T - len(r[1])) for r in part], device=device)  # (N, T-1)
        target = x[:, 1:][sel]  # (n,)
        row = torch.arange(len(part), device=device)[:, None].expand_as(sel)[sel]  # (n,): each one's row
        logp = scored_logp(base, x, sel)  # (n, V)
        count += len(target)
        row_tokens += torch.bincount(row, minlength=len(part)).tolist()
        for name, model in models.items():
            logq = logp if model is base else scored_logp(model, x, sel)
            s, kl = sums[name], (logp.exp() * (logp - logq)).sum(-1).double()  # (n,)
            s[0] += (logq.argmax(-1) == logp.argmax(-1)).sum().item()
            s[1] += kl.sum().item()
            s[2] -= logq.gather(1, target[:, None]).sum().item()
            per_row = torch.zeros(len(part), dtype=kl.dtype, device=device).index_add(0, row, kl)
            row_kl[name] += per_row.tolist()
    return {name: {"agreement": s[0] / count, "kl": s[1] / count, "nll": s[2] / count, "tokens": count,
                   "row_kl": row_kl[name], "row_tokens": row_tokens} for name, s in sums.items()}


def in_chunks(fn, prompts, n, lengths=None):
    """fn(batch of prompts) -> [Generation], over the prompts in chunks() of n, in prompt order;
    batched by the prompts' lengths, or by `lengths` (one per prompt) where given."""
    out = [None] * len(prompts)
    for idx in chunks([len(p) for p in prompts] if lengths is None else lengths, n):
        for i, g in zip(idx, fn([prompts[i] for i in idx])):
            out[i] = g
    return out


def eval_inputs(run):
    """The evaluated rows (the first n_eval of the split the config's "eval_split" names: "test"
    for a final run, evaluated once; "val" for a pilot, which never sees the test prompts), val
    (the first n_val validation rows: K and τ are chosen there), the general chat rows and the
    human paragraphs."""
    c = run.cfg
    rows = {s: [json.loads(line) for line in open(run.data(f"{s}.jsonl"))] for s in ("val", "test", "chat")}
    human = json.load(open(run.data("prompts.json")))["human"]
    return rows[c.get("eval_split", "test")][:c["n_eval"]], rows["val"][:c["n_val"]], rows["chat"], human


def groups_of(rows):
    """Each row's cluster (data/prompts.py): the unit the bootstrap resamples."""
    return [r.get("group") or r["id"] for r in rows]


def eval_models(run):
    """name -> directory of each model evaluated: the base, each comparison arm, MARS (the recipe)."""
    trained = {name: run.path("arms", name, stage) for name, (_, stage) in arms(run).items()}
    return {"base": BASE_DIR, **trained, "mars": run.path("train", "mars")}


def prompts_of(tok, rows):
    return [chat_ids(tok, r["messages"][0]["content"]) for r in rows]


def bootstrap(num, den, groups=None, n=2000, seed=0):
    """The 95 % interval of sum(num) / sum(den) over the items, resampled with replacement: the
    items themselves, or with `groups` (one label per item) whole groups (a cluster bootstrap:
    the items of one cluster are not independent, issue 33)."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    if groups is not None:  # per-group sums: resampling groups is resampling these
        labels = sorted(set(groups))
        at = np.array([labels.index(g) for g in groups])
        num, den = np.bincount(at, num, len(labels)), np.bincount(at, den, len(labels))
    idx = np.random.default_rng(seed).integers(0, len(num), (n, len(num)))
    r = num[idx].sum(1) / den[idx].sum(1)
    return [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]


def per_prompt(gens, ref=None, groups=None):
    """Tokens per forward of a decoder over prompts (sum / sum), its bootstrap interval (over
    `groups` when given), the sample size, and the share of its outputs identical to ref (for
    exact mode: our AR's on the same model)."""
    tokens, forwards = [len(g.ids) for g in gens], [g.forwards for g in gens]
    out = {"tokens_per_forward": sum(tokens) / sum(forwards), "ci95": bootstrap(tokens, forwards, groups),
           "tokens": sum(tokens), "forwards": sum(forwards), "n": len(gens),
           "groups": len(set(groups)) if groups is not None else None}
    if ref is not None:
        out["identical"] = sum(g.ids == r.ids for g, r in zip(gens, ref)) / len(gens)
    return out


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
    groups = {"base_replies": groups_of(test), "chat_replies": groups_of(chat),
              "human_chat": groups_of(human), "human_plain": groups_of(human)}
    res = {"n": len(test), "n_chat": len(chat), "n_human": len(human), "split": c.get("eval_split", "test"),
           "groups": {k: len(set(g)) for k, g in groups.items()}, "teacher_forced": {}}
    for k, rows in tf.items():  # KL with its interval over clusters; the per-row sums are not kept
        res["teacher_forced"][k] = {name: {**{x: v for x, v in r.items() if not x.startswith("row_")},
                                           "kl_ci95": bootstrap(r["row_kl"], r["row_tokens"], groups[k])}
                                    for name, r in teacher_forced(models["base"], models, rows).items()}
    print(f"[eval a] teacher-forced {res['teacher_forced']}", flush=True)
    ref, stage = None, [r["reply_ids"] for r in test]
    for name, model in models.items():
        gens = in_chunks(lambda b, m=model: generate_ar(m, b, c["max_new_tokens"], eos_of(tok)),
                         prompts_of(tok, test), eval_batch(c))
        outs = [g.ids for g in gens]
        ref = outs if ref is None else ref
        res[name] = {**agreement(ref, outs), "replies_stage_identical": agreement(stage, outs)["identical"],
                     "replies": outs}
        print(f"[eval a] {name}: {({k: v for k, v in res[name].items() if k != 'replies'})}", flush=True)
    return res


def sweep(run, model, base, tok, rows, taus):
    """The τ rule at each τ (B of training, window cache) on rows: tokens per forward with its
    interval over clusters, agreement with τ = 1 (the first τ), each reply's NLL under the base."""
    c, B = run.cfg, run.train_settings()["block_size"]
    texts, groups, out, ref = [r["messages"][0]["content"] for r in rows], groups_of(rows), [], None
    for tau in taus:
        gens = in_chunks(lambda b, t=tau: generate(
            model, b, block_size=B, tau=t, max_new_tokens=c["max_new_tokens"], mask_id=tok.mask_id,
            eos_ids=eos_of(tok)), prompts_of(tok, rows), eval_batch(c))
        outs = [g.ids for g in gens]
        ref = outs if ref is None else ref
        nll = teacher_forced(base, {"base": base}, reply_rows(tok, texts, outs))["base"]
        out.append({"tau": tau, **{k: v for k, v in per_prompt(gens, groups=groups).items()},
                    **agreement(ref, outs), "nll_under_base": nll["nll"], "replies": outs})
        print(f"[eval b] tau={tau}: {out[-1]['tokens_per_forward']:.3f} tok/forward, "
              f"identical {out[-1]['identical']:.3f}, NLL under base {nll['nll']:.3f}", flush=True)
    return out


def eval_taus(run):
    """(b) the τ rule. On the validation prompts the MARS model's sweep over "taus" gives
    tau_lossless: the τ with the most tokens per forward whose replies' NLL under the base stays
    within 3 % of τ = 1's (reliability.tau_lossless); on the evaluated prompts, the MARS model
    at τ = 1, 0.95 and that τ, and the base at "taus_base" (its masks are untrained: what the
    τ rule does without MARS)."""
    ev, val, _, _ = eval_inputs(run)
    c, (base, tok) = run.cfg, open_model(BASE_DIR, run)
    mars = open_model(run.path("train", "mars"), run)[0]
    res = {"block_size": run.train_settings()["block_size"], "n": len(ev[:c["n_tau"]]), "n_val": len(val)}
    res["val"] = {"mars": sweep(run, mars, base, tok, val, c["taus"])}
    res["tau_lossless"] = tau_lossless(res["val"]["mars"])["tau"]
    print(f"[eval b] tau_lossless = {res['tau_lossless']} (chosen on {len(val)} val prompts)", flush=True)
    taus = sorted({1.0, 0.95, res["tau_lossless"]}, reverse=True)
    res["mars"] = sweep(run, mars, base, tok, ev[:c["n_tau"]], taus)
    res["base"] = sweep(run, base, base, tok, ev[:c["n_tau"]], c["taus_base"])
    return res


def eval_curve(run):
    """(d) the learning curve on the validation prompts (never the test set: it is read to
    judge the length of training): at each saved step in "curve_steps" (all when absent; 0 =
    the base) exact-mode tokens per forward (K = 2) and KL(base || model) on the base's replies,
    each with its interval over clusters, teacher-forced agreement, and the NLL of the human
    text (chat): when the AR path moves."""
    _, val_rows, _, human = eval_inputs(run)
    c, tok = run.cfg, Tokenizer.from_dir(BASE_DIR)
    snaps = sorted(os.listdir(run.path("snapshots")))
    points = [(0, BASE_DIR)] + [(int(s.split("_")[1]), run.path("snapshots", s)) for s in snaps
                                if s.startswith("step_")]
    points = [(s, p) for s, p in points if c.get("curve_steps") is None or s in c["curve_steps"]]
    rows = val_rows[:c["n_curve"]]
    groups = groups_of(rows)
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
            eos_ids=eos_of(tok)), prompts, eval_batch(c))
        tf, tpf = teacher_forced(base, {"m": model}, replies)["m"], per_prompt(gens, groups=groups)
        res.append({"step": step, "drafts": K, "tokens_per_forward": tpf["tokens_per_forward"],
                    "tpf_ci95": tpf["ci95"], "n": len(rows), "groups": len(set(groups)),
                    "agreement": tf["agreement"], "kl": tf["kl"],
                    "kl_ci95": bootstrap(tf["row_kl"], tf["row_tokens"], groups),
                    "nll_human_chat": teacher_forced(base, {"m": model}, human_chat)["m"]["nll"],
                    "val_loss": val.get(step)})
        print(f"[eval d] {res[-1]}", flush=True)
    return res


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
    """The first n test prompts with the base's greedy reply and MARS's at τ = 1 and 0.95, the
    tokens accepted by one forward in [brackets]; newlines as spaces (each is a list item on
    the page). Saved in results.json, so the page is rendered without the model."""
    test, *_ = eval_inputs(run)
    model, tok = open_model(run.path("train", "mars"), run)
    rows = []
    for r in test[:n]:
        ids = chat_ids(tok, r["messages"][0]["content"])
        rows.append({"kind": r["kind"], "prompt": r["messages"][0]["content"],
                     "replies": {"base (greedy)": tok.decode(r["reply_ids"]).replace("\n", " "),
                                 "MARS tau = 1": bracketed(run, model, tok, ids, 1.0),
                                 "MARS tau = 0.95": bracketed(run, model, tok, ids, 0.95)}})
    return rows


def mask_models(run):
    """eval_models less the AR arms: the models whose masks mean something (the base's untrained
    ones as the reference)."""
    ar_arms = {name for name, (_, stage) in arms(run).items() if stage == "ar"}  # no mask stream
    return {n: p for n, p in eval_models(run).items() if n not in ar_arms}


def eval_reliability(run):
    """(f) why the τ rule accepts what it does (issue 33): on the validation prompts, for the base,
    every MARS-trained arm and the recipe, each mask position's candidate against the token
    greedy AR then emits (reliability.mask_records at τ = 1, whose replies must be the model's
    greedy AR: checked here), binned by its confidence (reliability.reliability)."""
    _, val, _, _ = eval_inputs(run)
    c, tok, S = run.cfg, Tokenizer.from_dir(BASE_DIR), run.train_settings()
    prompts, res = prompts_of(tok, val), {"n": len(val), "groups": len(set(groups_of(val))), "models": {}}
    for name, path in mask_models(run).items():
        model = open_model(path, run)[0]
        records, replies = mask_records(model, prompts, block_size=S["block_size"], mask_id=tok.mask_id,
                                        eos_ids=eos_of(tok), max_new_tokens=c["max_new_tokens"],
                                        batch=eval_batch(c))
        ar = in_chunks(lambda b, m=model: generate_ar(m, b, c["max_new_tokens"], eos_of(tok)), prompts,
                       eval_batch(c))
        same = sum(r == g.ids for r, g in zip(replies, ar)) / len(ar)
        res["models"][name] = {**reliability(records), "replies_equal_greedy_ar": same}
        print(f"[eval f] {name}: " + ", ".join(
            f"j={p['j']} acc {p['accuracy']:.3f} p {p['mean_probability']:.3f}"
            for p in res["models"][name]["positions"]), flush=True)
    return res
