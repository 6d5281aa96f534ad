"""Round 3's measures and wiring (issue 33; scripts/real_model/), no real model needed: the
cluster bootstrap and the paired speed equal their rules written out as loops, the cluster
interval widens where clustered items are not independent, committed replies are reused
only where their generation settings allow, every arm trains on the recipe's rows and steps
and is evaluated from its own directory, and round 3's summary keeps round 2's keys and
adds the issue's."""

import json
import os

import numpy as np
import pytest

from scripts.real_model import committed, stages
from scripts.real_model.evaluation import bootstrap, eval_models, mask_models
from scripts.real_model.report import summary as round2_summary
from scripts.real_model.round3 import summary
from scripts.real_model.run import Run
from scripts.real_model.speed import paired_speed


def test_cluster_bootstrap_is_the_rule_written_out():
    num, den = [3, 1, 4, 1, 5, 9, 2], [2, 2, 2, 1, 2, 3, 1]
    groups = ["b", "a", "b", "c", "a", "c", "b"]
    got = bootstrap(num, den, groups, n=400, seed=3)
    labels = sorted(set(groups))  # groups resampled whole, in this order of labels
    draws = np.random.default_rng(3).integers(0, len(labels), (400, len(labels)))
    ratios = []
    for row in draws:
        chosen = [labels[k] for k in row]
        n = sum(num[i] for g in chosen for i in range(len(num)) if groups[i] == g)
        d = sum(den[i] for g in chosen for i in range(len(den)) if groups[i] == g)
        ratios.append(n / d)
    assert got == [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def test_cluster_interval_is_wider_for_clustered_items():
    rng = np.random.default_rng(0)
    per_group = rng.normal(1.5, 0.3, 10)  # 10 clusters of 8 items, items alike within a cluster
    num = np.repeat(per_group, 8) + rng.normal(0, 0.01, 80)
    den, groups = np.ones(80), np.repeat(np.arange(10), 8).tolist()
    by_item, by_group = bootstrap(num, den), bootstrap(num, den, groups)
    assert by_group[1] - by_group[0] > 2 * (by_item[1] - by_item[0])


def test_paired_speed_is_the_median_of_per_round_ratios():
    ar = [[1.0, 2.0, 1.0], [3.0, 2.0, 1.0], [1.0, 1.0, 1.0]]  # (rounds, items)
    dec = [[0.5, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 2.0]]
    speed, ci = paired_speed(ar, dec, groups=["x", "y", "x"], n=300, seed=2)
    assert speed == float(np.median([4.0 / 2.5, 6.0 / 3.0, 3.0 / 4.0]))
    # not the ratio of the median round totals (3.0 / 3.0): pairing is the point
    assert speed != np.median([4.0, 6.0, 3.0]) / np.median([2.5, 3.0, 4.0])
    members = {"x": [0, 2], "y": [1]}
    rng, draws = np.random.default_rng(2), []
    for _ in range(300):
        idx = [i for k in rng.integers(0, 2, 2) for i in members[["x", "y"][k]]]
        draws.append(float(np.median([sum(ar[r][i] for i in idx) / sum(dec[r][i] for i in idx)
                                      for r in range(3)])))
    assert ci == [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]


def write_committed(root, temperature):
    d = os.path.join(root, committed.COMMITTED, "old")
    os.makedirs(d)
    settings = {"sizes": [0, 2, 1, 1, 1, 1], "max_new_tokens": 4, "gen_batch": 2, "max_prompt_tokens": 16,
                "reply_temperature": temperature, "base": committed.GGUF}
    meta = {"settings": settings, "rows": {"train": 1, "heldout": 1}}
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f)
    for split, text in (("train", "a train prompt"), ("heldout", "a held-out prompt")):
        with open(os.path.join(d, f"{split}.jsonl"), "w") as f:
            f.write(json.dumps({"messages": [{"role": "user", "content": text}], "reply_ids": [1, 2]}) + "\n")


@pytest.mark.parametrize("theirs, mine, keys", [
    (0.0, 0.0, {(False, "a train prompt"), (True, "a train prompt"), (False, "a held-out prompt"),
                (True, "a held-out prompt")}),
    (0.0, 1.0, {(False, "a train prompt"), (False, "a held-out prompt")}),  # sampled train rows: made anew
    (1.0, 1.0, {(True, "a train prompt"), (False, "a held-out prompt")}),  # sampled rows: train only
    (1.0, 0.0, {(False, "a held-out prompt"), (True, "a held-out prompt")}),  # greedy rows: any split
])
def test_committed_replies_are_reused_only_where_settings_allow(tmp_path, monkeypatch, theirs, mine, keys):
    monkeypatch.chdir(tmp_path)
    write_committed(tmp_path, theirs)
    cfg = {"reuse_rows": "old", "results_dir": "r", "seed": 0, "n_train": 9, "n_val": 1, "n_test": 1,
           "n_human": 1, "n_chat": 1, "max_new_tokens": 4, "gen_batch": 2, "max_prompt_tokens": 16,
           "reply_temperature": mine}
    assert set(committed.reusable_rows(Run("a", cfg, "a.json", {}, smoke=False))) == keys
    with pytest.raises(SystemExit, match="other settings"):
        committed.reusable_rows(Run("b", {**cfg, "max_new_tokens": 5}, "b.json", {}, smoke=False))


def test_every_arm_trains_on_the_recipes_rows_and_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arms = {"ar_kl": {"mars_steps": 0, "ar_target": "teacher"},
            "mars_ce": {"w_ar": 1.0, "ar_target": "tokens"}}
    recipe = {"mars_steps": 7, "w_ar": 4.0, "batch_size": 8}
    run = Run("a", {"arms": arms, "results_dir": "r"}, "a.json", recipe, smoke=False)
    for f in ("train.npz", "val.npz"):
        os.makedirs(run.path("data"), exist_ok=True)
        open(run.path("data", f), "w").close()
    calls = []
    monkeypatch.setattr(stages, "train", lambda run, name, over, fresh: calls.append((name, over)))
    monkeypatch.setattr(stages, "TRAINING", ())
    stages.stage_arms(run)
    assert calls == [
        (os.path.join("arms", "ar_kl"), {"mars_steps": 0, "ar_target": "teacher", "ar_steps": 7}),  # AR too
        (os.path.join("arms", "mars_ce"), {"w_ar": 1.0, "ar_target": "tokens"})]
    assert eval_models(run) == {"base": "out/smollm2", "ar_kl": run.path("arms", "ar_kl", "ar"),
                                "mars_ce": run.path("arms", "mars_ce", "mars"),
                                "mars": run.path("train", "mars")}
    assert mask_models(run) == {"base": "out/smollm2", "mars_ce": run.path("arms", "mars_ce", "mars"),
                                "mars": run.path("train", "mars")}  # the reliability diagram's: no AR arm


def test_round3_summary_keeps_round2_keys_and_adds_the_issues():
    m = lambda nll, kl, agree: {"nll": nll, "kl": kl, "agreement": agree}  # noqa: E731
    models = {"base": m(2.0, 0.0, 1.0), "ar_kl": m(2.0, 0.01, 0.99), "ar_ce": m(2.1, 0.2, 0.9),
              "mars_ce": m(2.05, 0.1, 0.95), "mars": m(2.02, 0.04, 0.96)}
    tf = {part: models for part in ("base_replies", "chat_replies", "human_chat", "human_plain")}
    timing = {f"batch {bs}": {"exact K=2": {"speed_vs_ar": 9.0, "speed_paired": p}}
              for bs, p in ((1, 1.4), (4, 1.05))}
    res = {"a_quality": {"teacher_forced": tf, "mars": {"identical": 0.25}, "groups": {"base_replies": 23}},
           "b_taus": {"tau_lossless": 0.9, "mars": [{"tau": 1.0, "tokens_per_forward": 1.0},
                                                    {"tau": 0.95, "tokens_per_forward": 1.1},
                                                    {"tau": 0.9, "tokens_per_forward": 1.25}]},
           "c_exact": {"tokens_per_forward": {"test/mars/exact K=2": {"tokens_per_forward": 1.8},
                                              "test/mars/HF prompt lookup": {"tokens_per_forward": 1.6}}},
           "e_timing": {"k_choice": {"drafts": 2}, "timing": timing}, "f_reliability": {},
           "stages": {"train": {"elapsed_s": 3600.0}, "eval": {"elapsed_s": 900.0},
                      "results": {"elapsed_s": 60.0}},
           "train_settings": {"mars_steps": 500, "batch_size": 8},
           "data": {"train": {"distinct_prompts": 2000}}}
    base = round2_summary(res, ar_sft="ar_ce")
    s = summary(res, base)
    assert set(base) <= set(s) and s["ar_sft_kl_base_replies"] == 0.2  # round 2's AR SFT: the CE arm
    assert s["exact_speed_vs_ar_batch1"] == 1.4 and s["exact_speed_vs_ar_batch4"] == 1.05  # paired medians
    assert s["tau_lossless_tokens_per_forward"] == 1.25 and s["tau_lossless"] == 0.9
    arms = (s["ar_kl_sft_kl_base_replies"], s["ar_ce_sft_kl_base_replies"], s["mars_ce_kl_base_replies"])
    assert arms == (0.01, 0.2, 0.1)
    assert s["test_groups"] == 23.0 and s["eval_minutes"] == 15.0 and s["run_hours"] == 4500 / 3600
    assert s["mars_greedy_identical_to_base"] == 0.25


def rerendered(d, tmp_path, monkeypatch):
    """d's results.json (d relative to the repo root) -> that dict, after asserting that the page
    rendered from it alone into tmp_path equals d's committed RESULTS.md and summary.json byte for
    byte."""
    from scripts.real_model.page import write_page

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
    res = json.load(open(os.path.join(d, "results.json")))
    write_page(res, str(tmp_path))
    for name in ("RESULTS.md", "summary.json"):
        assert (tmp_path / name).read_text() == open(os.path.join(d, name)).read(), name
    return res


def test_round3_committed_page_renders_and_its_headlines_follow_from_the_raw_numbers(tmp_path, monkeypatch):
    """results/real_model/r3/results.json alone gives back the committed RESULTS.md and summary.json
    byte for byte (the page can be regenerated, and a change to round3.py that alters it is seen
    here); and the headline numbers of summary.json follow from the raw ones by the rules written
    out here: the paired speed from the per-round times, tokens per forward from tokens / forwards,
    tau_lossless's tokens per forward from the sweep's row at that τ, the test clusters from the
    evaluated rows."""
    d = os.path.join("results", "real_model", "r3")
    res = rerendered(d, tmp_path, monkeypatch)
    s = json.load(open(os.path.join(d, "summary.json")))
    for bs in (1, 4):
        t = res["e_timing"]["timing"][f"batch {bs}"]
        ratios = [sum(a) / sum(e) for a, e in zip(t["our AR"]["times_s"], t["exact K=2"]["times_s"])]
        assert s[f"exact_speed_vs_ar_batch{bs}"] == pytest.approx(float(np.median(ratios)), rel=1e-12)
    k2 = res["c_exact"]["tokens_per_forward"]["test/mars/exact K=2"]
    assert s["exact_tokens_per_forward_k2_batch1"] == pytest.approx(k2["tokens"] / k2["forwards"], rel=1e-12)
    row = [r for r in res["b_taus"]["mars"] if r["tau"] == s["tau_lossless"]][0]
    assert s["tau_lossless_tokens_per_forward"] == pytest.approx(row["tokens"] / row["forwards"], rel=1e-12)
    assert s["test_groups"] == k2["groups"] and s["test_groups"] >= 20


def test_round3_curve_page_renders_and_reaches_twice_round2s_tokens(tmp_path, monkeypatch):
    """results/real_model/r3/curve/results.json alone gives back its committed RESULTS.md and
    summary.json byte for byte; and the curve it reports is the one item 4 asks for: snapshots up
    to at least 2x round 2's MARS rows (its results.json: 250 steps x 8), each judged on at least
    32 validation prompts with a cluster interval that contains its point, the base (step 0) first."""
    res = rerendered(os.path.join("results", "real_model", "r3", "curve"), tmp_path, monkeypatch)
    S, curve = res["train_settings"], res["d_curve"]
    assert curve[0]["step"] == 0 and curve[-1]["step"] == S["mars_steps"]
    r2 = json.load(open(os.path.join("results", "real_model", "results.json")))["train_settings"]
    assert S["mars_steps"] * S["batch_size"] >= 2 * r2["mars_steps"] * r2["batch_size"]
    for p in curve:
        lo, hi = p["tpf_ci95"]
        assert p["n"] >= 32 and lo <= p["tokens_per_forward"] <= hi, p["step"]
