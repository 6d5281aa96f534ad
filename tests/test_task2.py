"""Issue 61's protocol (scripts/real_model/task2.py), its --smoke run once for the module on a tiny random
base: the protocol as wired (stage 2 and the arm from stage 1's saved weights, each arm's lr and steps
its own validation choice by the rule written out, the seeds recorded); the engine's batched
evaluation = the reference decoders one prompt at a time; every reply row regraded and recounted; the
page's numbers recomputed from replies.jsonl by brute force; the page back from results.json alone."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import page_through_report, task_smoke_root

from tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join("out", "real_model", "smollm2-task2-smoke")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`python -m scripts.real_model --config task2 --smoke` run once for this module, on a tiny random
    base in SmolLM2's place (its BPE trained on task set v2) -> the root it ran in."""
    from data.tasks.v2 import generate

    rows = generate({"train": 40, "val": 8, "test": 8}, seed=0)
    return task_smoke_root(tmp_path_factory, "task2_smoke", rows, "task2")


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def rule_choice(cands, gate):
    """task2.RULE written out: best τ = 1 accuracy, earlier on ties, among those passing the gate."""
    passing = [i for i, c in enumerate(cands) if gate is None or
               c["val"][f"{gate['tau']:g}"]["tokens_per_forward"] >= gate["min_tokens_per_forward"]]
    pool = passing if passing else list(range(len(cands)))
    best = None
    for i in pool:
        if best is None or cands[i]["val"]["1"]["accuracy"] > cands[best]["val"]["1"]["accuracy"]:
            best = i
    return best


def test_protocol_as_wired(smoke):
    """The runs' recorded settings (each release's mars.json, read here, not protocol.json's copy):
    stage 1 AR alone; each arm at each seed from stage 1's saved weights, one stage, its arm's chosen
    lr and steps, its seed; the choice is the rule on the validation numbers, which are counts of
    the validation replies; a record with one thing changed is caught."""
    from scripts.real_model.task2 import SMOKE, violations

    run = smoke / RUN
    sel = json.load(open(run / "select.json"))
    sft = os.path.join(RUN, "sft", "ar")
    recs = {"sft": json.load(open(run / "sft" / "ar" / "mars.json"))["settings"]}
    assert recs["sft"]["ar_steps"] == 2 and recs["sft"]["mars_steps"] == 0
    for arm, stage in (("mars", "mars"), ("ar_sft", "ar")):
        a = sel["arms"][arm]
        gate = SMOKE["gate"] if arm == "mars" else None
        for i, c in enumerate(a["candidates"]):
            assert c["settings"] == SMOKE["candidates"][arm][i]
            rows = json.load(open(run / "val" / f"{arm}-{i}_tau1.json"))["result"]["rows"]
            assert len(rows) == SMOKE["n_val"] and all(r["problem"].startswith("val-") for r in rows)
            assert c["val"]["1"]["correct"] == sum(r["correct"] for r in rows)
            assert c["val"]["1"]["tokens_per_forward"] == sum(r["tokens"] for r in rows) / sum(
                r["forwards"] for r in rows)
        assert a["chosen"] == rule_choice(a["candidates"], gate)
        cand = SMOKE["candidates"][arm][a["chosen"]]
        for seed in SMOKE["seeds"]:
            S = json.load(open(run / f"{arm}-{a['chosen']}-s{seed}" / stage / "mars.json"))["settings"]
            assert S["init_from"] == sft and S["lr"] == cand["lr"] and S["seed"] == seed
            steps = (S["mars_steps"], S["ar_steps"]) if arm == "mars" else (S["ar_steps"], S["mars_steps"])
            assert steps == (cand["steps"], 0)
            recs[f"{arm} seed {seed}"] = S
    choice = {arm: sel["arms"][arm]["chosen_settings"] for arm in ("mars", "ar_sft")}
    assert violations(recs, sft, choice, SMOKE["seeds"]) == []
    assert json.load(open(run / "protocol.json"))["violations"] == []
    for name, key, value in (("mars seed 0", "init_from", "out/smollm2"), ("ar_sft seed 1", "lr", 0.5),
                             ("mars seed 1", "seed", 0), ("mars seed 0", "w_ar", 4.0),
                             ("ar_sft seed 0", "mars_steps", 2), ("mars seed 1", "warmup_frac", 0.5)):
        bad = {**recs, name: {**recs[name], key: value}}
        assert violations(bad, sft, choice, SMOKE["seeds"]), (name, key)
    assert violations(recs, sft, choice, [0, 0])  # a seed twice


def test_val_losses_logged_apart(smoke):
    """train.py's validation records hold L_mask and L_AR apart: MARS's loss is their sum (w_ar 1);
    the AR stage has no L_mask."""
    run = smoke / RUN
    sel = json.load(open(run / "select.json"))
    mars_recs = sel["arms"]["mars"]["candidates"][0]["val_loss"]
    ar_recs = sel["arms"]["ar_sft"]["candidates"][0]["val_loss"]
    assert mars_recs and ar_recs
    for r in mars_recs:  # the sum rounded in float32 once per micro-batch: 8 ulps (measured 0.3, 28x margin)
        assert abs(r["val_loss"] - (r["val_l_mask"] + r["val_l_ar"])) <= 8 * 2.0 ** -23 * r["val_loss"]
    assert all(r["val_l_mask"] is None and r["val_l_ar"] is not None for r in ar_recs)


def test_replies_regrade_and_engine_is_the_reference(smoke):
    """replies.jsonl: one row per test problem and piece, with seed, template and drafts; each row's
    verdict is the v2 grader's on its own text; and the reference decoders (plain model.py, float64,
    one prompt at a time) give back each row's ids and forwards: the engine's batched evaluation, at
    τ = 1, the τ rule and exact mode, is the reference's."""
    from checkpoint import load_checkpoint
    from data.tasks.v2.grade import is_correct
    from decoding import Generation
    from exact import generate_exact
    from generate import generate
    from scripts.real_model.run import chat_ids, eos_of
    from scripts.real_model.task2 import SMOKE
    from scripts.real_model.task2_decode import reply_row

    run = smoke / RUN
    rows = read_jsonl(run / "results" / "replies.jsonl")
    problems = {p["id"]: p for p in read_jsonl(run / "data" / "test.jsonl")}
    tok = Tokenizer.from_dir(smoke / "out" / "smollm2")
    sel = json.load(open(run / "select.json"))
    seen = {(r["model"], r["seed"], r["tau"], r["drafts"]) for r in rows}
    want = {("ar_sft", s, 1.0, None) for s in SMOKE["seeds"]} | {("base", None, 1.0, None)} | \
        {("mars", 0, t, None) for t in SMOKE["taus"]} | {("mars", 1, t, None) for t in SMOKE["taus_more"]} | \
        {("mars", 0, 1.0, k) for k in SMOKE["drafts"]}
    assert seen == want
    assert len(rows) == len(want) * SMOKE["n_eval"]
    for r in rows:
        p = problems[r["problem"]]
        keys = ("template", "frame", "family", "answer")
        assert [r[k] for k in keys] == [p[k] for k in keys]
        assert r["correct"] == is_correct(p, r["reply"], r["finished"])
        assert r["reply"] == tok.decode(r["ids"][:-1] if r["finished"] else r["ids"])
    p = problems[rows[0]["problem"]]  # the smoke's replies are all wrong: reply_row on a right one too
    right = tok.encode(p["messages"][1]["content"]) + [tok.eos_id]
    assert reply_row(tok, p, "mars", 0, "tau", 1.0, Generation(right, 9))["correct"]
    assert not reply_row(tok, p, "mars", 0, "tau", 1.0, Generation(right[:-4], 9))["correct"]  # cut
    eos, multi = eos_of(tok), 0
    models = {}
    for r in rows:
        if r["model"] != "mars":
            continue
        d = run / f"mars-{sel['arms']['mars']['chosen']}-s{r['seed']}" / "mars"
        model = models.setdefault(r["seed"], load_checkpoint(str(d), "cpu", torch.float64).model)
        prompt = chat_ids(tok, problems[r["problem"]]["messages"][0]["content"])
        kw = dict(block_size=4, max_new_tokens=SMOKE["max_new_tokens"], mask_id=tok.mask_id, eos_ids=eos)
        g = (generate_exact(model, [prompt], drafts=r["drafts"], **kw)[0] if r["drafts"] else
             generate(model, [prompt], tau=r["tau"], **kw)[0])
        assert (g.ids, g.forwards) == (r["ids"], r["forwards"]), r
        multi += r["forwards"] < r["tokens"]
    assert multi  # some steps kept several tokens
    check = json.load(open(run / "eval" / "engine_check.json"))["result"]
    assert check["dtype"] == "torch.float32" and check["n"] == SMOKE["n_check"]
    decoders = {f"tau {t:g}" for t in SMOKE["taus"]} | {f"exact {k}" for k in SMOKE["drafts"]}
    assert set(check["decoders"]) == decoders
    assert all(v["equal"] == 1.0 for v in check["decoders"].values())


def brute_two_stage(values_fn, groups, draws, seed=0):
    """clustered.resamples' draw written out in loops: templates in first-seen order, each pick's
    problems drawn by int(u * m)."""
    order = list(dict.fromkeys(groups))
    members = {g: [i for i, x in enumerate(groups) if x == g] for g in order}
    rng, out = np.random.default_rng(seed), []
    for _ in range(draws):
        picks = rng.integers(0, len(order), len(order))
        sizes = [len(members[order[p]]) for p in picks]
        u = rng.random(sum(sizes))
        idx, k = [], 0
        for p, m in zip(picks, sizes):
            for _ in range(m):
                idx.append(members[order[p]][int(u[k] * m)])
                k += 1
        out.append(values_fn(np.array(idx)))
    return float(np.percentile(out, 2.5)), float(np.percentile(out, 97.5))


def test_page_numbers_recount_from_the_replies(smoke):
    """results.json's headline and sweep, recomputed here from replies.jsonl alone: accuracies and the
    MARS - AR SFT difference as counts (pooled over seeds: each problem's seed mean), tokens per forward
    as sums, the share kept as a ratio of counts, and the clustered interval of the difference by the
    two-stage draw written out in loops."""
    from scripts.real_model.task2 import SMOKE
    from scripts.real_model.task2_page import DRAWS

    run = smoke / RUN
    res = json.load(open(run / "results" / "results.json"))
    rows = read_jsonl(run / "results" / "replies.jsonl")
    ids = [p["id"] for p in read_jsonl(run / "data" / "test.jsonl")][:SMOKE["n_eval"]]
    groups = [next(r["template"] for r in rows if r["problem"] == i) for i in ids]

    def col(model, seed, tau=1.0, drafts=None, key="correct"):
        by = {r["problem"]: r for r in rows if (r["model"], r["seed"], r["tau"], r["drafts"]) ==
              (model, seed, tau, drafts)}
        return np.array([float(by[i][key]) for i in ids])

    def replies(model, seed, tau, drafts):
        return {r["problem"]: r["ids"] for r in rows
                if (r["model"], r["seed"], r["tau"], r["drafts"]) == (model, seed, tau, drafts)}
    seeds = SMOKE["seeds"]
    a = np.mean([col("ar_sft", s) for s in seeds], 0)
    m = np.mean([col("mars", s) for s in seeds], 0)
    head = res["numbers"]["tau1"]["pooled"]
    assert head["ar_sft"]["estimate"] == pytest.approx(100 * a.mean(), abs=1e-12)
    assert head["mars_minus_ar_sft"]["estimate"] == pytest.approx(100 * (m.mean() - a.mean()), abs=1e-12)
    lo, hi = brute_two_stage(lambda idx: 100 * (m[idx].mean() - a[idx].mean()), groups, DRAWS)
    assert head["mars_minus_ar_sft"]["ci95"] == pytest.approx([lo, hi], abs=1e-9)
    assert head["mars_minus_ar_sft"]["half_width"] == pytest.approx((hi - lo) / 2, abs=1e-9)
    for r in res["numbers"]["sweep"] + res["numbers"]["exact"]:  # a seed's, or the seeds' pooled
        ss = seeds if r["seed"] == "pooled" else [r["seed"]]
        tau, drafts = r.get("tau", 1.0), r.get("drafts")
        tok = sum(col("mars", s, tau, drafts, "tokens") for s in ss)
        fwd = sum(col("mars", s, tau, drafts, "forwards") for s in ss)
        assert r["tokens_per_forward"]["estimate"] == pytest.approx(tok.sum() / fwd.sum(), abs=1e-12)
        acc1 = np.mean([col("mars", s) for s in ss], 0).mean()
        acc = np.mean([col("mars", s, tau, drafts) for s in ss], 0).mean()
        assert r["accuracy"]["estimate"] == pytest.approx(100 * acc, abs=1e-12)
        if drafts is None and acc1:
            assert r["kept"]["estimate"] == pytest.approx(acc / acc1, abs=1e-12)
        same = [replies("mars", s, tau, drafts)[i] == replies("mars", s, 1.0, None)[i]
                for s in ss for i in ids]
        assert r["identical_to_tau1"] == sum(same) / len(same)
    assert {(r["seed"], r["tau"]) for r in res["numbers"]["sweep"]} == \
        {(0, t) for t in SMOKE["taus"]} | {(s, t) for s in (1, "pooled") for t in SMOKE["taus_more"]}
    met = {t["target"]: t["met"] for t in res["targets"]}
    d = head["mars_minus_ar_sft"]
    assert met["MARS - AR SFT at tau = 1 (pooled seeds): half-width <= 3 points"] == (d["half_width"] <= 3)


def test_page_regenerates_from_results_alone(smoke, tmp_path):
    """RESULTS.md comes back byte for byte from results.json alone: in an empty directory, and through
    `--report` with the run's pieces gone."""
    from scripts.real_model.task2_page import rewrite

    res_dir, eval_dir = smoke / RUN / "results", smoke / RUN / "eval"
    page = (res_dir / "RESULTS.md").read_text()
    for heading in ("## Targets", "## MARS against AR SFT at tau = 1", "## The tau rule and exact mode",
                    "## Selection on validation", "## The engine = the reference"):
        assert heading in page
    shutil.copy(res_dir / "results.json", tmp_path / "results.json")
    rewrite(str(tmp_path))
    assert (tmp_path / "RESULTS.md").read_text() == page
    assert page_through_report(smoke, "task2", res_dir, eval_dir, tmp_path) == page


def test_rule_on_hand_made_numbers():
    """task2.choose against the rule written out (rule_choice) on numbers where it matters: the gate
    drops the most accurate MARS candidate; none passes the gate (all are eligible); a tie goes to the
    earlier candidate; the AR arm has no gate."""
    from scripts.real_model.task2 import choose

    gate = {"tau": 0.95, "min_tokens_per_forward": 1.5}

    def c(acc, tpf=None):
        return {"val": {"1": {"accuracy": acc}, **({"0.95": {"tokens_per_forward": tpf}} if tpf else {})}}
    cases = [([c(0.6, 1.4), c(0.5, 1.6), c(0.4, 1.7)], gate, 1),  # the best fails the gate
             ([c(0.6, 1.4), c(0.7, 1.2)], gate, 1),  # none passes: the best of all
             ([c(0.5, 1.6), c(0.5, 1.9)], gate, 0),  # a tie: the earlier
             ([c(0.3), c(0.8), c(0.8)], None, 1)]  # the AR arm
    for cands, g, want in cases:
        assert choose([x["val"] for x in cands], g) == rule_choice(cands, g) == want


def test_partial_page_from_the_pieces_on_disk(smoke, tmp_path, monkeypatch):
    """`--partial` while pieces are missing: the page is marked partial and names them, its numbers come
    from the pieces there (seed 0's headline alone when seed 1's MARS reply set is missing, no pooled row,
    no base, no engine check), and nothing is run; the report stage's pages are untouched once restored."""
    from scripts.real_model.__main__ import main
    from scripts.real_model.task2 import SMOKE

    run, res_dir = smoke / RUN, smoke / RUN / "results"
    shutil.copytree(res_dir, tmp_path / "results")
    gone = ["mars_s1_tau1", "base_tau1", "engine_check"]
    for n in gone:
        os.rename(run / "eval" / f"{n}.json", tmp_path / f"{n}.json")
    monkeypatch.chdir(smoke)
    try:
        main(["--config", "task2", "--smoke", "--partial"])
        res = json.load(open(res_dir / "results.json"))
        page = (res_dir / "RESULTS.md").read_text()
    finally:
        for n in gone:
            os.rename(tmp_path / f"{n}.json", run / "eval" / f"{n}.json")
        shutil.rmtree(res_dir)
        shutil.copytree(tmp_path / "results", res_dir)
    assert res["partial"]["missing"] == gone and "**Partial" in page
    assert list(res["numbers"]["tau1"]) == ["0"] and res["numbers"]["base"] is None
    assert res["engine_check"] is None and {r["seed"] for r in res["numbers"]["sweep"]} == {0}
    rows = [r for r in read_jsonl(run / "results" / "replies.jsonl")
            if (r["model"], r["seed"], r["tau"], r["drafts"]) == ("mars", 0, 1.0, None)]
    acc = sum(r["correct"] for r in rows) / SMOKE["n_eval"]
    assert res["numbers"]["tau1"]["0"]["mars"]["estimate"] == pytest.approx(100 * acc, abs=1e-12)
