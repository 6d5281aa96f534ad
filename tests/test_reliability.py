"""Proofs for scripts/real_model/reliability.py: the reliability of the mask candidates per mask
position j (docs/spec.md §5; issue 33).

Claims, each against an independent reference:
  * mask_records scores the candidates the decoder's own step saw: for every step t of every
    row and every j, c_j and its confidences equal the output at mask j-1 of a from-scratch HF
    forward (float64) of [prompt + reply[:t] + B masks], the no-cache input of §5.1; the record
    set is exactly the (row, t, j) with a target in the reply; the replies are generate_ar's.
    The prompts have different lengths and the row that stops first (EOS) is the first of its
    batch, so reading the wrong row of the step's logits after it stopped would show.
  * reliability(): bins, counts, accuracies, ECE and τ passes on records written out with
    their answers by hand, and against a brute-force loop on random records.
  * tau_lossless picks the most tokens per forward within 3 % of greedy's NLL and no further.
  * the figure is a PNG, written atomically (no temp file left); the tables show the numbers.
"""

import math

import numpy as np
import pytest
import torch
from conftest import hf_float64, make_hf_model

from generate import generate_ar
from model import Qwen2
from sampling import METRICS
from scripts.real_model.reliability import (
    ENTROPY_EDGES,
    TAUS,
    mask_records,
    reliability,
    reliability_figure,
    reliability_lines,
    tau_lossless,
)

MASK, B, N_NEW = 255, 4, 16
# the row that stops first (EOS 200 after 2 tokens) comes first; the second row repeats a token,
# so some mask candidates are right (seed 1 of the tiny model)
PROMPTS = [[42, 7], [5, 17, 99, 3, 40], [8, 1, 2, 3, 4, 5, 6, 7, 200]]
EOS = (200,)
# |confidence - float64 reference|: the code reads an fp32 softmax of the float64 logits (as the
# decoder does); measured at most 3.4e-8 (probability, margin) and 7.1e-7 (entropy, nats): 14x
CONF_ATOL = 1e-5
# top-1 minus top-2 logit of every compared candidate: far above the fp32 cast of the logits
# (~1e-6 at their size), so the argmax of the code's fp32 copy cannot differ by rounding; the
# smallest gap met is 2.7e-3 (measured)
TIE_GAP = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, our model in float64) with the same random weights."""
    path = str(tmp_path_factory.mktemp("rel"))
    hf = make_hf_model(path, seed=1)
    return hf, Qwen2.from_pretrained(path, dtype=torch.float64).eval()


@torch.no_grad()
def brute_force(hf, prompts, replies):
    """§5 without a cache on HF in float64: for each row i, step t and mask position j with a
    target, one plain forward of prompt + reply[:t] + B masks, read at mask j-1
    -> {(i, t + j, j): (candidate, correct, {metric: value}, top-2 logit gap)}."""
    want = {}
    with hf_float64(hf):
        for i, (p, r) in enumerate(zip(prompts, replies)):
            for t in range(len(r)):
                logits = hf(torch.tensor([p + r[:t] + [MASK] * B])).logits[0]  # (T, V) float64
                for j in range(1, B):
                    if t + j >= len(r):
                        continue
                    x = logits[len(p) + t - 1 + j]  # mask j-1 sits at len(p) + t + j - 1
                    probs = x.softmax(-1)
                    c = int(x.argmax())
                    top = probs.topk(2).values
                    conf = {"probability": float(probs[c]), "margin": float(top[0] - top[1]),
                            "entropy": float(-(probs * probs.log()).sum())}
                    gap = float(x.topk(2).values[0] - x.topk(2).values[1])
                    want[i, t + j, j] = (c, c == r[t + j], conf, gap)
    return want


def test_mask_records_are_the_decoders_candidates_and_replies_are_greedy_ar(tiny):
    hf, model = tiny
    ar = [g.ids for g in generate_ar(model, PROMPTS, N_NEW, eos_ids=EOS)]
    assert len({len(r) for r in ar}) > 1 and ar[0][-1] in EOS, "rows must stop at different steps"
    want = brute_force(hf, PROMPTS, ar)
    for batch in (2, 16):  # 2: the EOS row shares a batch with one row, and a lone row follows
        rec, replies = mask_records(model, PROMPTS, block_size=B, mask_id=MASK, eos_ids=EOS,
                                    max_new_tokens=N_NEW, batch=batch)
        assert replies == ar
        keys = list(zip(rec["prompt"].tolist(), rec["position"].tolist(), rec["j"].tolist()))
        assert sorted(keys) == sorted(want) and len(keys) == len(set(keys))
        worst = dict.fromkeys(METRICS, 0.0)
        for n, key in enumerate(keys):
            c, correct, conf, gap = want[key]
            assert gap > TIE_GAP, f"near-tie at {key}: {gap:.2e}"
            assert rec["candidate"][n] == c and rec["correct"][n] == correct, key
            for m in METRICS:
                worst[m] = max(worst[m], abs(rec[m][n] - conf[m]))
        assert max(worst.values()) <= CONF_ATOL, worst
    assert 0 < rec["correct"].sum() < len(keys)  # both kinds are present: not vacuous
    # the comparison can fail: every probability read one step late, or in the next row, breaks
    # the bound (by 2.0e-4 at least, measured; even in the row that repeats one token)
    for di, dq in ((0, 1), (1, 0)):
        moved = [(want[i + di, q + dq, j][2]["probability"], p) for (i, q, j), p
                 in zip(keys, rec["probability"]) if (i + di, q + dq, j) in want]
        assert len(moved) > 40 and all(abs(a - b) > CONF_ATOL for a, b in moved)


def records(rows):
    """Columns from rows (j, correct, probability, entropy, margin)."""
    cols = list(zip(*rows))
    return {"j": np.array(cols[0]), "correct": np.array(cols[1], bool),
            **{m: np.array(c, float) for m, c in zip(("probability", "entropy", "margin"), cols[2:])}}


def test_reliability_of_a_hand_written_example():
    rec = records([  # j, correct, probability, entropy (nats), margin
        (1, 0, 0.05, 3.0, 0.01), (1, 0, 0.15, 0.3, 0.12), (1, 1, 0.95, 0.03, 0.9),
        (1, 1, 0.97, 0.07, 0.95), (1, 0, 0.99, 20.0, 1.0),
        (2, 1, 0.55, 1.5, 0.25), (2, 0, 0.65, 1.5, 0.35)])
    s = reliability(rec, bins=10)
    one, two = s["positions"]
    assert (one["j"], one["n"], two["j"], two["n"]) == (1, 5, 2, 2)
    assert one["accuracy"] == pytest.approx(2 / 5) and one["mean_probability"] == pytest.approx(3.11 / 5)
    prob = {i: (b["count"], b["mean"], b["accuracy"]) for i, b in enumerate(one["bins"]["probability"])
            if b["count"]}
    assert prob == {0: (1, pytest.approx(0.05), 0.0), 1: (1, pytest.approx(0.15), 0.0),
                    9: (3, pytest.approx(0.97), pytest.approx(2 / 3))}
    # ECE = 1/5 * 0.05 + 1/5 * 0.15 + 3/5 * |2/3 - 0.97|
    assert one["ece"] == pytest.approx(0.01 + 0.03 + 0.6 * (0.97 - 2 / 3))
    # entropy: 0.03 in [0, 0.05); 0.07 in [0.05, 0.1); 0.3 in [0.25, 0.5); 3.0 in [2, 4); 20 above 16: last
    ent = [b["count"] for b in one["bins"]["entropy"]]
    assert ent == [1, 1, 0, 1, 0, 0, 1, 0, 1] and s["edges"]["entropy"] == list(ENTROPY_EDGES)
    marg = {i: b["count"] for i, b in enumerate(one["bins"]["margin"]) if b["count"]}
    assert marg == {0: 1, 1: 1, 9: 3}  # 1.0 falls in the last bin, [0.9, 1]
    # τ passes, p >= τ: 0.95 passes τ = 0.95
    passes = {t["tau"]: (t["count"], t["accuracy"]) for t in one["tau"]}
    assert passes == {0.5: (3, pytest.approx(2 / 3)), 0.7: (3, pytest.approx(2 / 3)),
                      0.8: (3, pytest.approx(2 / 3)), 0.9: (3, pytest.approx(2 / 3)),
                      0.95: (3, pytest.approx(2 / 3))}
    assert [(t["count"], t["accuracy"]) for t in two["tau"]] == [(2, 0.5), (0, None), (0, None),
                                                                 (0, None), (0, None)]
    assert two["ece"] == pytest.approx(0.5 * 0.45 + 0.5 * 0.65)  # bins [0.5, 0.6) and [0.6, 0.7)


def brute_bins(values, correct, edges):
    """Bins by the comparisons written out: lo <= v < hi, the last bin closed and open above."""
    out = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        last = i == len(edges) - 2
        members = [(v, c) for v, c in zip(values, correct) if lo <= v and (v < hi or last)]
        out.append((len(members), sum(v for v, _ in members) / len(members) if members else None,
                    sum(c for _, c in members) / len(members) if members else None))
    return out


def close(a, b):
    return a is None and b is None or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def test_reliability_equals_a_brute_force_loop_on_random_records():
    rng = np.random.default_rng(0)
    n, bins = 2000, 7
    p = rng.uniform(0, 1, n)
    p[:bins + 1] = np.arange(bins + 1) / bins  # values on every edge, 0 and 1 included
    rec = {"j": rng.integers(1, 4, n), "correct": rng.uniform(0, 1, n) < p, "probability": p,
           "entropy": rng.uniform(0, 12, n) ** rng.uniform(0.5, 1.2, n), "margin": rng.uniform(0, 1, n) * p}
    rec["entropy"][:len(ENTROPY_EDGES)] = ENTROPY_EDGES
    rec["margin"][-bins - 1:] = p[:bins + 1]
    s, unit = reliability(rec, bins=bins), [i / bins for i in range(bins + 1)]
    assert [q["j"] for q in s["positions"]] == [1, 2, 3]
    for q in s["positions"]:
        sel = rec["j"] == q["j"]
        col = {k: v[sel].tolist() for k, v in rec.items()}
        assert q["n"] == len(col["j"]) and close(q["accuracy"], sum(col["correct"]) / q["n"])
        for m in METRICS:
            edges = unit if m != "entropy" else list(ENTROPY_EDGES)
            want = brute_bins(col[m], col["correct"], edges)
            got = [(b["count"], b["mean"], b["accuracy"]) for b in q["bins"][m]]
            assert [w[0] for w in want] == [g[0] for g in got] and sum(g[0] for g in got) == q["n"]
            assert all(close(w[1], g[1]) and close(w[2], g[2]) for w, g in zip(want, got))
        prob_bins = brute_bins(col["probability"], col["correct"], unit)
        ece = sum(c / q["n"] * abs(a - mu) for c, mu, a in prob_bins if c)
        assert close(q["ece"], ece)
        for t in q["tau"]:
            ok = [c for v, c in zip(col["probability"], col["correct"]) if v >= t["tau"]]
            assert t["count"] == len(ok) and close(t["accuracy"], sum(ok) / len(ok))


SWEEP = [{"tau": 1.0, "tokens_per_forward": 1.0, "nll_under_base": 2.0},
         {"tau": 0.95, "tokens_per_forward": 1.03, "nll_under_base": 2.01},
         {"tau": 0.9, "tokens_per_forward": 1.2, "nll_under_base": 2.06},  # exactly 3 % over: kept
         {"tau": 0.8, "tokens_per_forward": 1.5, "nll_under_base": 2.0601},  # just over the bound
         {"tau": 0.5, "tokens_per_forward": 2.4, "nll_under_base": 3.5}]


def test_tau_lossless_picks_the_most_tokens_within_the_bound():
    assert tau_lossless(SWEEP)["tau"] == 0.9
    assert tau_lossless(SWEEP[::-1])["tau"] == 0.9  # order does not matter
    assert tau_lossless(SWEEP, tol=0.1)["tau"] == 0.8
    assert tau_lossless(SWEEP, tol=0.001)["tau"] == 1.0  # nothing else qualifies: greedy
    tie = SWEEP[:2] + [{"tau": 0.7, "tokens_per_forward": 1.03, "nll_under_base": 2.0}]
    assert tau_lossless(tie)["tau"] == 0.95  # a tie in tokens per forward goes to the larger τ
    with pytest.raises(ValueError, match="no tau = 1 entry"):
        tau_lossless(SWEEP[1:])


def random_summary(seed, n=500):
    rng = np.random.default_rng(seed)
    p = rng.uniform(0, 1, n)
    return reliability({"j": rng.integers(1, 4, n), "correct": rng.uniform(0, 1, n) < p ** 2,
                        "probability": p, "entropy": rng.uniform(0, 5, n), "margin": p / 2})


def test_figure_is_a_png_written_atomically(tmp_path):
    path = tmp_path / "reliability.png"
    reliability_figure({"base": random_summary(0), "MARS (CE)": random_summary(1)}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reliability.png"]


def test_tables_show_each_models_numbers():
    by_model = {"base": random_summary(0), "MARS (KL)": random_summary(1)}
    lines = reliability_lines(by_model)
    for j in (1, 2, 3):
        at = lines.index(f"Mask position j = {j} (c_{j}, read at mask {j - 1}):")
        for k, (name, s) in enumerate(by_model.items()):
            pos = s["positions"][j - 1]
            t = pos["tau"][TAUS.index(0.9)]
            assert lines[at + 4 + k] == (f"| {name} | {pos['n']} | {pos['accuracy']:.3f} | "
                                         f"{pos['mean_probability']:.3f} | {pos['ece']:.3f} | "
                                         f"{t['share']:.3f} | {t['accuracy']:.3f} |")
    with pytest.raises(ValueError, match="tau must be one of"):
        reliability_lines(by_model, tau=0.85)
