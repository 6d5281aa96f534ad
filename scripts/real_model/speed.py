"""The lossless decoders and their speed: our AR, exact mode at each K (exact.py) and HF
prompt lookup (transformers, no training), on the same model. (c) tokens per forward with a
bootstrap interval over clusters of prompts; (e) the wall clock.

How the wall clock is measured (time_decoders, eval_timing): K is chosen on the validation
prompts (one round, the fastest exact mode against our AR), never on the test prompts; then
every decoder is warmed up, and each test item (a batch of 1 or 4 prompts) is run by every
decoder in turn, the order rotated each round. A decoder's speed against our AR is the
median over rounds of the paired ratio of round totals (AR's round / its round: both timed
in the same round, so a slow spell of the machine hits both), with an interval that
resamples the items by cluster (paired_speed; issue 33); the ratio of median round totals is
kept beside it (round 2's figure). One timed call is
scripts.common.time_once (synchronised on CUDA). The decoders' outputs of the first round
are compared with our AR's: "identical" is part of the claim.

Which evaluations run is stages.py's; the quality measures are evaluation.py's.
"""

import statistics

import numpy as np
import torch

from decoding import Generation
from exact import generate_exact
from generate import generate_ar
from scripts.common import time_once as timed
from scripts.real_model.evaluation import bootstrap, eval_inputs, groups_of, in_chunks, per_prompt, prompts_of
from scripts.real_model.run import BASE_DIR, eos_of, eval_batch, open_model, run_dtype


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
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=run_dtype(run)).to(c["device"]).eval()
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


def eval_exact(run):
    """(c) exact mode's tokens per forward: K in drafts, our AR and HF prompt lookup on the MARS
    model (exact mode K = 2 and HF prompt lookup on the base's weights as side rows), on the
    test prompts, and K = 2 on the general-chat prompts; bootstrap intervals over prompts."""
    test, val, chat, _ = eval_inputs(run)
    c = run.cfg
    model, tok = open_model(run.path("train", "mars"), run)
    base = open_model(BASE_DIR, run)[0]
    fns = decoders(run, model, tok, run.path("train", "mars"))
    side = ("our AR", "exact K=2") + (("HF prompt lookup",) if c.get("hf_lookup_base", True) else ())
    fns_base = {n: f for n, f in decoders(run, base, tok, BASE_DIR).items() if n in side}
    res = {"n_test": len(test), "n_val": len(val), "n_chat": len(chat), "tokens_per_forward": {}}
    for split, rows in (("test", test), ("chat", chat)):
        for owner, table_ in (("mars", fns), ("base", fns_base)):
            p, groups = prompts_of(tok, rows), groups_of(rows)
            ar = in_chunks(table_["our AR"], p, eval_batch(c))
            for n, fn in table_.items():
                if split == "chat" and not (n == "exact K=2" or owner == "mars" and n == "our AR"):
                    continue  # far-from-training prompts: K = 2 (our AR is its reference)
                gens = ar if n == "our AR" else in_chunks(fn, p, 1 if n.startswith("HF") else eval_batch(c))
                res["tokens_per_forward"][f"{split}/{owner}/{n}"] = per_prompt(gens, ar, groups)
                print(f"[eval c] {split}/{owner}/{n}: {res['tokens_per_forward'][f'{split}/{owner}/{n}']}",
                      flush=True)
    return res


def time_decoders(fns, items, rounds, device, order_log=None, on_item=None):
    """Wall clock of each decoder on each item (a batch of prompts): every decoder warmed up
    first, then `rounds` rounds, each item run by every decoder in turn (the order rotated per
    round, so none is always first). -> {name: {"per_round_s", "median_s", "spread_s",
    "per_item_s" (the median over rounds)}}, and each decoder's outputs of the first round;
    order_log (a list), where given, gets [round, item, name] of every timed call in turn;
    on_item(round, item), where given, is called after each item's calls (outside the clock)."""
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
                if order_log is not None:
                    order_log.append([r, i, n])
            if on_item is not None:
                on_item(r, i)
    res = {}
    for n in names:
        per_round = [sum(x) for x in times[n]]
        res[n] = {"per_round_s": per_round, "median_s": statistics.median(per_round), "times_s": times[n],
                  "spread_s": [min(per_round), max(per_round)],
                  "per_item_s": [statistics.median(times[n][r][i] for r in range(rounds))
                                 for i in range(len(items))]}
    return res, outs


def paired_speed(ar_times, times, groups=None, n=2000, seed=0):
    """Speed against our AR from times (rounds, items) of both, taken in the same rounds: the
    median over rounds of the paired ratio sum(AR's round) / sum(the decoder's round), and its
    95 % interval with the items resampled by group (each item's label in `groups`; every item
    its own without), the same statistic on each resample."""
    a, d = np.asarray(ar_times, float), np.asarray(times, float)
    labels = list(range(a.shape[1])) if groups is None else groups
    members = [np.flatnonzero(np.array(labels, dtype=object) == g) for g in dict.fromkeys(labels)]
    stat = lambda idx: float(np.median(a[:, idx].sum(1) / d[:, idx].sum(1)))  # noqa: E731
    rng = np.random.default_rng(seed)
    draws = [stat(np.concatenate([members[k] for k in rng.integers(0, len(members), len(members))]))
             for _ in range(n)]
    return stat(np.arange(a.shape[1])), [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]


def speed_rows(t, ar="our AR", groups=None):
    """Speed of each decoder against our AR: the median of the paired per-round ratios with its
    interval over groups of items (paired_speed, the headline since issue 33), and as before the
    ratio of the median round times and the bootstrap interval of the per-item medians."""
    out = {}
    for n, v in t.items():
        paired, ci = paired_speed(t[ar]["times_s"], v["times_s"], groups)
        out[n] = {**v, "speed_vs_ar": t[ar]["median_s"] / v["median_s"],
                  "speed_ci95": bootstrap(t[ar]["per_item_s"], v["per_item_s"]),
                  "speed_paired": paired, "speed_paired_ci95": ci, "items": len(v["per_item_s"])}
    return out


def eval_timing(run):
    """(e) wall clock. K is chosen on the val prompts (the fastest exact mode against our AR,
    one round; no round when "drafts" names one K); then our AR, exact mode at that K and HF
    prompt lookup on the same MARS model
    are timed on the first n_timed test prompts, interleaved, timing_rounds rounds, at batch 1,
    and our AR and exact mode at batch 4. Off in the pilots ("timing": false)."""
    test, val, _, _ = eval_inputs(run)
    c, dev = run.cfg, run.cfg["device"]
    if not c["timing"]:
        return {}
    model, tok = open_model(run.path("train", "mars"), run)
    fns, res = decoders(run, model, tok, run.path("train", "mars")), {"dtype": str(run_dtype(run))}
    if len(c["drafts"]) == 1:  # nothing to choose
        res["k_choice"] = {"val_speed_vs_ar": {}, "drafts": c["drafts"][0]}
    else:
        val_p = [[p] for p in prompts_of(tok, val)]
        lossless = {n: fns[n] for n in fns if n == "our AR" or n.startswith("exact")}
        v = speed_rows(time_decoders(lossless, val_p, 1, dev)[0])
        K = max(c["drafts"], key=lambda k: v[f"exact K={k}"]["speed_vs_ar"])
        res["k_choice"] = {"val_speed_vs_ar": {n: r["speed_vs_ar"] for n, r in v.items()}, "drafts": K}
    K = res["k_choice"]["drafts"]
    print(f"[eval e] K = {K}: {res['k_choice']}", flush=True)
    timed_rows = sorted(test[:c["n_timed"]], key=lambda r: str(r.get("group")))  # a batch: mostly one cluster
    test_p, groups = prompts_of(tok, timed_rows), groups_of(timed_rows)
    pick = {n: fns[n] for n in ("our AR", f"exact K={K}", "HF prompt lookup")}
    res["timing"] = {}
    for bs in (1, 4):
        items = [test_p[i:i + bs] for i in range(0, len(test_p), bs)]
        t, outs = time_decoders(pick if bs == 1 else {n: pick[n] for n in pick if not n.startswith("HF")},
                                items, c["timing_rounds"], dev)
        res["timing"][f"batch {bs}"] = speed_rows(t, groups=groups[::bs])  # an item: its first prompt's
        for n in t:
            res["timing"][f"batch {bs}"][n]["identical_to_ar"] = sum(
                a.ids == b.ids for a, b in zip(outs[n], outs["our AR"])) / len(outs[n])
        rows = res["timing"][f"batch {bs}"]
        print(f"[eval e] batch {bs}: " + ", ".join(f"{n} {r['speed_paired']:.3f}x {r['speed_paired_ci95']}"
                                                   for n, r in rows.items()), flush=True)
    return res
