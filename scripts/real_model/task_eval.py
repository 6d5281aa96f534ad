"""The task protocol's evaluation on test, once (issue 54, item 3; docs/spec.md §5-§8), and the
τ rule's ceiling on round 3's open chat (item 4).

The evaluation is a list of PIECES, each one (model, setting) and its own JSON under the run's
eval/, written atomically as it finishes and skipped when present with its key, so a killed run
loses one piece at most:

  decode_M_tauT  model M's replies to the first n_eval test problems at τ = T, every row graded
                 (data/tasks/grade.py). τ = 1 is AR mode (§5.5: one token per step, c_0 only) and
                 runs our AR decoder (generate.generate_ar: the same tokens and forwards as
                 generate.generate at τ = 1, without the B masks a step would carry for nothing);
                 τ < 1 runs generate.generate with the window cache (§6) and the B of training:
                 a row's tokens and forwards do not depend on the rows beside it. MARS at every
                 τ of "taus", the base and AR SFT at "taus_ar" (τ = 1: their masks are untrained)
  exact_KK       exact mode (exact.py, §8) at K drafts on MARS, first n_exact problems: tokens
                 per forward, and its replies against MARS's τ = 1 replies (AR of the same weights)
  ceiling_M      the τ rule's ceiling (ceiling.py) on model M's own τ = 1 replies, at every τ
  timing         wall clock on the first n_timed problems, at batch 1 and 4: our AR against the
                 τ rule at timing_tau with each cache of "timed_caches" (the block cache, B_cache =
                 block_cache: the paper's batch strategy; the window cache), alternated, warmed up
                 (speed.time_decoders; paired ratios with speed.speed_rows), in the run's dtype

Prompts are batched by the length of the problem's reference solution (evaluation.in_chunks): rows
of one batch end at about the same step, so few forwards run for rows already done. summarise()
turns the pieces into results.json's numbers (bootstrap intervals over problems); the page is
task_page.py's, the pieces' keys and the stage wiring protocol.py's.

What this module does not know: which directory holds which model (protocol.py passes them), how
the page looks (task_page.py).
"""

import json
import os
import time
from collections import Counter

from data.prepare import load_npz
from data.tasks.grade import is_correct
from decoding import ar_only
from exact import generate_exact
from generate import generate, generate_ar
from scripts.common import machine
from scripts.real_model.ceiling import ceiling, measure, own_probabilities
from scripts.real_model.committed import reusable_rows
from scripts.real_model.evaluation import bootstrap, in_chunks, per_prompt
from scripts.real_model.run import BASE_DIR, chat_ids, eos_of, eval_batch, open_model, run_dtype
from scripts.real_model.speed import speed_rows, time_decoders
from scripts.real_model.stages import stage_prompts
from tokenizer import Tokenizer
from util.atomic import write_json

MODELS = ("base", "ar_sft", "mars")  # the JSONL's "model" values, in the order they are evaluated
JSONL_KEYS = ("problem", "family", "template", "model", "tau", "reply", "tokens", "forwards", "finished",
              "answer", "correct", "ids")


def decode_name(model, tau):
    return f"decode_{model}_tau{tau:g}"


def pieces(cfg):
    """[(piece name, model, kind, argument)] in run order: model by model, so each is loaded once;
    a model's τ = 1 replies before the pieces that read them (exact mode, the ceiling)."""
    out = []
    for m in MODELS:
        taus = cfg["taus"] if m == "mars" else cfg["taus_ar"]
        if 1.0 not in taus:
            raise ValueError(f"{m}'s taus {taus} lack 1.0: the ceiling and exact mode read its tau = 1 "
                             "replies")
        out += [(decode_name(m, t), m, "decode", t) for t in taus]
        out += [(f"exact_K{k}", m, "exact", k) for k in (cfg["drafts"] if m == "mars" else ())]
        out += [(f"ceiling_{m}", m, "ceiling", None)]
    return out + [("timing", "mars", "timing", None)]


def piece_path(run, name):
    """eval/NAME.json; a pilot's pieces (its "eval_split" not test) under eval_SPLIT/, beside them."""
    split = run.cfg.get("eval_split", "test")
    return run.path("eval" if split == "test" else f"eval_{split}", f"{name}.json")


def load_piece(run, name):
    return json.load(open(piece_path(run, name)))["result"]


def eval_problems(run):
    """The first n_eval problems of the config's "eval_split": "test" (the default; data/tasks/: their
    templates never trained on) for the run, evaluated once; "val" for a pilot, which never sees test."""
    with open(run.path("data", f"{run.cfg.get('eval_split', 'test')}.jsonl")) as f:
        return [json.loads(line) for line in f][:run.cfg["n_eval"]]


def prompt_of(tok, problem):
    return chat_ids(tok, problem["messages"][0]["content"])


def solution_lengths(problems):
    """The batching key: each problem's reference solution, in characters (module docstring)."""
    return [len(p["messages"][1]["content"]) for p in problems]


def reply_row(tok, problem, model, tau, gen):
    """One JSONL row: a reply, its counts and the grader's verdict (the reply's text without its
    EOS, as data/tasks/grade.py reads text)."""
    finished = bool(gen.ids) and gen.ids[-1] in eos_of(tok)
    reply = tok.decode(gen.ids[:-1] if finished else gen.ids)
    return {"problem": problem["id"], "family": problem["family"], "template": problem["template"],
            "model": model, "tau": tau, "reply": reply, "tokens": len(gen.ids), "forwards": gen.forwards,
            "finished": finished, "answer": problem["answer"], "correct": is_correct(problem, reply),
            "ids": gen.ids}


def decoder(run, model, tok, tau, cache="window"):
    """fn(batch of prompts) -> [Generation] at τ: our AR decoder at τ = 1 (module docstring), else
    the τ rule with `cache`, the B of training, greedy."""
    c, B, eos = run.cfg, run.train_settings()["block_size"], eos_of(tok)
    if ar_only(tau):
        return lambda b: generate_ar(model, b, c["max_new_tokens"], eos)
    bc = c["block_cache"] if cache == "block" else None
    return lambda b: generate(model, b, block_size=B, tau=tau, max_new_tokens=c["max_new_tokens"],
                              mask_id=tok.mask_id, eos_ids=eos, cache=cache, block_cache_size=bc)


def decode_piece(run, model, tok, problems, name, tau):
    gens = in_chunks(decoder(run, model, tok, tau), [prompt_of(tok, p) for p in problems],
                     eval_batch(run.cfg), solution_lengths(problems))
    rows = [reply_row(tok, p, name, tau, g) for p, g in zip(problems, gens)]
    acc, n = sum(r["correct"] for r in rows) / len(rows), sum(r["forwards"] for r in rows)
    print(f"[evaluate] {name} tau={tau:g}: accuracy {acc:.3f}, "
          f"{sum(r['tokens'] for r in rows) / n:.3f} tokens/forward", flush=True)
    return {"model": name, "tau": tau, "decoder": "ar" if ar_only(tau) else "window",
            "block_size": run.train_settings()["block_size"], "max_new_tokens": run.cfg["max_new_tokens"],
            "rows": rows}


def exact_piece(run, model, tok, problems, name, K):
    """Exact mode at K drafts: tokens per forward, and its replies equal to MARS's τ = 1 ones?"""
    c, B, rows = run.cfg, run.train_settings()["block_size"], problems[:run.cfg["n_exact"]]
    fn = lambda b: generate_exact(model, b, block_size=B, drafts=K, max_new_tokens=c["max_new_tokens"],  # noqa: E731
                                  mask_id=tok.mask_id, eos_ids=eos_of(tok))
    gens = in_chunks(fn, [prompt_of(tok, p) for p in rows], eval_batch(c), solution_lengths(rows))
    ar = {r["problem"]: r["ids"] for r in load_piece(run, decode_name(name, 1.0))["rows"]}
    res = {"drafts": K, **per_prompt(gens),
           "identical_to_tau1": sum(g.ids == ar[p["id"]] for p, g in zip(rows, gens)) / len(rows),
           "row_tokens": [len(g.ids) for g in gens], "row_forwards": [g.forwards for g in gens]}
    print(f"[evaluate] exact K={K}: {res['tokens_per_forward']:.3f} tokens/forward, identical to tau = 1 "
          f"{res['identical_to_tau1']:.3f}", flush=True)
    return res


def summarised(ceil):
    """A ceiling() result without its per-reply lists, with the bound's interval over replies."""
    return {**{k: v for k, v in ceil.items() if k not in ("tokens", "forwards")},
            "ci95": bootstrap(ceil["tokens"], ceil["forwards"])}


def ceiling_piece(run, model, tok, problems, name, _):
    """The ceiling on the model's own τ = 1 replies, at every τ of the sweep, B of training."""
    prompts = {p["id"]: prompt_of(tok, p) for p in problems}
    pairs = [(prompts[r["problem"]], r["ids"]) for r in load_piece(run, decode_name(name, 1.0))["rows"]]
    B = run.train_settings()["block_size"]
    res = {"block_size": B, "n": len(pairs), "dtype": str(run_dtype(run)),
           "ceilings": [summarised(x) for x in measure(model, pairs, run.cfg["taus"], B)]}
    print(f"[evaluate] ceiling {name}: " + ", ".join(f"tau={x['tau']:g} {x['tokens_per_forward']:.3f}"
                                                    for x in res["ceilings"]), flush=True)
    return res


def timing_piece(run, model, tok, problems, name, _):
    """Wall clock (module docstring): our AR against the τ rule's caches at timing_tau, batch 1, 4."""
    c = run.cfg
    fns = {"our AR": decoder(run, model, tok, 1.0)}
    fns.update({f"{cache} tau={c['timing_tau']:g}": decoder(run, model, tok, c["timing_tau"], cache)
                for cache in c["timed_caches"]})
    prompts = [prompt_of(tok, p) for p in problems[:c["n_timed"]]]
    res = {"dtype": str(run_dtype(run)), "tau": c["timing_tau"], "block_cache": c["block_cache"],
           "n": len(prompts), "rounds": c["timing_rounds"], "batches": {}}
    for bs in (1, 4):
        items = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
        t, outs = time_decoders(fns, items, c["timing_rounds"], c["device"])
        rows = speed_rows(t)
        for n, r in rows.items():
            r["tokens_per_forward"] = per_prompt(outs[n])["tokens_per_forward"]
            r["identical_to_ar"] = sum(a.ids == b.ids for a, b in zip(outs[n], outs["our AR"])) / len(outs[n])
        res["batches"][f"batch {bs}"] = rows
        print(f"[evaluate] timing batch {bs}: " + ", ".join(
            f"{n} {r['speed_paired']:.3f}x {r['speed_paired_ci95']}" for n, r in rows.items()), flush=True)
    return res


KINDS = {"decode": decode_piece, "exact": exact_piece, "ceiling": ceiling_piece, "timing": timing_piece}


def evaluate(run, dirs, keys):
    """Every piece of `keys` (piece -> key) not yet saved with its key, model by model (dirs: model ->
    weights directory); each piece written as it finishes."""
    problems, tok, loaded = eval_problems(run), Tokenizer.from_dir(BASE_DIR), {}
    for name, model, kind, arg in pieces(run.cfg):
        if name not in keys:
            continue
        path = piece_path(run, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.isfile(path) and json.load(open(path)).get("key") == keys[name]:
            print(f"[evaluate] {name} done before, skipped", flush=True)
            continue
        if model not in loaded:  # one model in memory at a time
            loaded = {model: open_model(dirs[model], run)[0]}
        t0 = time.time()
        res = KINDS[kind](run, loaded[model], tok, problems, model, arg)
        write_json(path, {"key": keys[name], "elapsed_s": round(time.time() - t0, 1), "result": res})
        print(f"[evaluate] {name} in {(time.time() - t0) / 60:.1f} min", flush=True)


# ---------------------------------------------------------------- round 3's open chat (item 4)
def r3_val_pairs(r3run, tok, model):
    """(prompt ids, reply ids) of round 3's validation rows as its replies stage makes them: its
    prompts (stages.stage_prompts, in its run dir), those within max_prompt_tokens, each one's
    committed greedy reply where its reuse_rows has one, else the base's greedy reply (generate_ar
    in chunks of gen_batch prompts by text length)."""
    c = r3run.cfg
    stage_prompts(r3run)
    val = sorted(json.load(open(r3run.data("prompts.json")))["val"], key=lambda p: int(p["id"].split("-")[1]))
    items = [p for p in val if len(chat_ids(tok, p["text"])) <= c["max_prompt_tokens"]][:c["n_val"]]
    reuse = reusable_rows(r3run)
    replies = {p["id"]: reuse[(False, p["text"])]["reply_ids"] for p in items if (False, p["text"]) in reuse}
    todo = [p for p in items if p["id"] not in replies]
    gens = in_chunks(lambda b: generate_ar(model, b, c["max_new_tokens"], eos_of(tok)),
                     [chat_ids(tok, p["text"]) for p in todo], c["gen_batch"], [len(p["text"]) for p in todo])
    replies.update({p["id"]: g.ids for p, g in zip(todo, gens)})
    return [(chat_ids(tok, p["text"]), replies[p["id"]]) for p in items]


def ceiling_r3(run, r3run, taus, block_sizes):
    """The ceiling of the base on its own greedy replies to round 3's validation prompts (r3's
    val.jsonl when that run was made here, else r3_val_pairs), in r3's data dtype, at each τ and
    each B of `block_sizes` (round 3's and this protocol's)."""
    c, tok = r3run.cfg, Tokenizer.from_dir(BASE_DIR)
    model = open_model(BASE_DIR, run, dtype=c.get("data_dtype"))[0]
    val = r3run.data("val.jsonl")
    if os.path.isfile(val):
        rows = [json.loads(line) for line in open(val)][:c["n_val"]]
        pairs, source = [(r["prompt_ids"], r["reply_ids"]) for r in rows], val
    else:
        pairs, source = r3_val_pairs(r3run, tok, model), "rebuilt: " + r3run.data("prompts.json")
    if not pairs:
        raise SystemExit(f"[ceiling_r3] no validation prompt of {r3run.cfg_path} within max_prompt_tokens")
    qs = own_probabilities(model, pairs)
    res = {"config": r3run.cfg_path, "source": source, "n": len(pairs),
           "dtype": str(model.lm_head.weight.dtype),
           "mean_reply_tokens": sum(len(r) for _, r in pairs) / len(pairs),
           "finished": sum(bool(r) and r[-1] in eos_of(tok) for _, r in pairs) / len(pairs),
           "ceilings": {str(B): [summarised(ceiling(qs, t, B)) for t in taus] for B in block_sizes}}
    print(f"[ceiling_r3] {len(pairs)} replies: " + ", ".join(
        f"B={B} tau={x['tau']:g} {x['tokens_per_forward']:.3f}" for B, xs in res["ceilings"].items()
        for x in xs), flush=True)
    return res


# ---------------------------------------------------------------- results.json from the pieces
def accuracy(rows):
    """Share correct with its 95 % bootstrap interval over problems."""
    c = [float(r["correct"]) for r in rows]
    return {"n": len(c), "correct": int(sum(c)), "accuracy": sum(c) / len(c),
            "ci95": bootstrap(c, [1.0] * len(c))}


def paired_change(rows, ref):
    """Accuracy of `rows` minus that of `ref` on the same problems, with the bootstrap interval of
    the mean difference over problems (paired: a problem's two replies are resampled together)."""
    was = {r["problem"]: float(r["correct"]) for r in ref}
    d = [float(r["correct"]) - was[r["problem"]] for r in rows]
    return {"change": sum(d) / len(d), "ci95": bootstrap(d, [1.0] * len(d)), "n": len(d)}


def decode_summary(piece, ref=None):
    """A decode piece's numbers: accuracy (all, per family), tokens per forward with its interval,
    reply length, the share ended by EOS; against `ref` (the model's τ = 1 piece) the paired change
    of accuracy and the share of identical replies."""
    rows = piece["rows"]
    tokens, forwards = [r["tokens"] for r in rows], [r["forwards"] for r in rows]
    out = {k: piece[k] for k in ("model", "tau", "decoder", "block_size", "max_new_tokens")}
    out.update(accuracy(rows), families={f: accuracy([r for r in rows if r["family"] == f])
                                         for f in sorted({r["family"] for r in rows})},
               tokens_per_forward=sum(tokens) / sum(forwards), tpf_ci95=bootstrap(tokens, forwards),
               mean_tokens=sum(tokens) / len(rows), finished=sum(r["finished"] for r in rows) / len(rows))
    if ref is not None:
        same = {r["problem"]: r["ids"] for r in ref["rows"]}
        out.update(vs_tau1=paired_change(rows, ref["rows"]),
                   identical_to_tau1=sum(r["ids"] == same[r["problem"]] for r in rows) / len(rows))
    return out


def summarise(run):
    """The evaluation's numbers for results.json (no replies: those go to replies.jsonl)."""
    out = {"decode": {}, "exact": {}, "ceiling": {}, "timing": None}
    for name, model, kind, arg in pieces(run.cfg):
        p = load_piece(run, name)
        if kind == "decode":
            ref = load_piece(run, decode_name(model, 1.0)) if arg != 1.0 else None
            out["decode"][name] = decode_summary(p, ref)
        elif kind == "exact":
            out["exact"][name] = {k: v for k, v in p.items() if not k.startswith("row_")}
        elif kind == "ceiling":
            out["ceiling"][model] = p
        else:
            out["timing"] = p
    rows = {m: load_piece(run, decode_name(m, 1.0))["rows"] for m in ("mars", "ar_sft")}
    out["mars_vs_ar_sft"] = paired_change(rows["mars"], rows["ar_sft"])
    return out


def reply_rows(run):
    """Every reply of every decode piece (JSONL_KEYS), in the pieces' order."""
    return [r for name, _, kind, _ in pieces(run.cfg) if kind == "decode"
            for r in load_piece(run, name)["rows"]]


R3_RESULTS = os.path.join("results", "real_model", "r3", "results.json")  # round 3's committed numbers


def r3_reached():
    """Round 3's τ rule on its validation prompts (its MARS model, its B): τ -> tokens per forward,
    from its committed results.json; None where it is absent."""
    if not os.path.isfile(R3_RESULTS):
        return None
    b = json.load(open(R3_RESULTS))["b_taus"]
    return {"source": R3_RESULTS, "block_size": b["block_size"], "n": b["n_val"],
            "tokens_per_forward": {f"{p['tau']:g}": p["tokens_per_forward"] for p in b["val"]["mars"]}}


def results_of(run, violations, r3_ceiling):
    """results.json: everything the page shows, from the run's saved pieces (summarise), its settings,
    stages.json, the protocol's check, the data's sizes, round 3's ceiling and numbers, the command
    and the machine."""
    test, off = eval_problems(run), load_npz(run.path("data", "train.npz"))["offsets"]
    command = f"python -m scripts.real_model --config {run.cfg_path}" + (" --smoke" if run.smoke else "")
    stages = {k: v for k, v in run.manifest.items() if not v.get("unfinished")}
    return {"config": run.cfg, "train_settings": run.train_settings(), "stages": stages,
            "protocol": violations,
            "data": {"train_rows": len(off) - 1, "split": run.cfg.get("eval_split", "test"),
                     "test_problems": len(test),
                     "test_families": dict(sorted(Counter(p["family"] for p in test).items()))},
            **summarise(run), "ceiling_r3": r3_ceiling, "r3_reached": r3_reached(),
            "run": {"command": command, "smoke": run.smoke, "machine": machine(run.cfg["device"])}}
