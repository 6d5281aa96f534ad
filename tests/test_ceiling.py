"""The τ rule's ceiling (scripts/real_model/ceiling.py) equals a brute-force recomputation: on a tiny
random model in float64, each reply position's own AR probability equals a separate plain forward
of its prefix, and the shares of positions whose next j probabilities pass τ and the tokens per
forward a perfect mask allows equal plain Python loops over those probabilities."""

import pytest
import torch

from model import Qwen2, Qwen2Config, init_weights
from scripts.real_model.ceiling import ceiling, measure, own_probabilities

VOCAB, B = 24, 4
TAUS = (0.95, 0.9, 0.8, 0.6, 0.5)
MARGIN = 1e-6  # no probability this close to a τ: batched and separate forwards differ by ~1e-15


@pytest.fixture(scope="module")
def model():
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    # a wide init makes the next-token distributions peaked: many positions pass a high τ
    return init_weights(Qwen2(cfg), std=1.5, seed=0).double().eval()


@pytest.fixture(scope="module")
def pairs(model):
    """(prompt, reply) pairs of many lengths: the model's own greedy replies (where the ceiling is
    meant to be read) and random ones (where a reply token need not be the argmax)."""
    g, out = torch.Generator().manual_seed(1), []
    for i in range(12):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        n = int(torch.randint(0, 14, (1,), generator=g))
        if i % 3:
            reply = []
            with torch.no_grad():
                for _ in range(n + 1):
                    reply.append(int(model(torch.tensor([prompt + reply]))[0, -1].argmax()))
        else:
            reply = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
        out.append((prompt, reply))
    return out


def brute_probabilities(model, pairs):
    """q[t] from one plain forward of prompt + reply[:t] per position, no batching."""
    out = []
    with torch.no_grad():
        for prompt, reply in pairs:
            out.append([torch.softmax(model(torch.tensor([prompt + reply[:t]]))[0, -1], -1)[reply[t]].item()
                        for t in range(len(reply))])
    return out


def brute_ceiling(qs, tau, block_size):
    """The shares and the bound by the definitions' words, in loops."""
    passed, windows, tokens, forwards = [0] * (block_size - 1), [0] * (block_size - 1), 0, 0
    for q in qs:
        L = len(q)
        for j in range(1, block_size):
            for t in range(L):
                if t + j <= L - 1:
                    windows[j - 1] += 1
                    passed[j - 1] += all(q[t + k] >= tau for k in range(1, j + 1))
        t = 0
        while t < L:  # one step: c_0, then the masks while they pass, at most B tokens
            n = 1
            while tau < 1 and n < block_size and t + n < L and q[t + n] >= tau:
                n += 1
            t, tokens, forwards = t + n, tokens + n, forwards + 1
    return [p / w if w else None for p, w in zip(passed, windows)], windows, tokens / forwards


def test_own_probabilities_equal_separate_forwards(model, pairs):
    got = own_probabilities(model, pairs, batch=5)  # batches of rows of different lengths, right-padded
    want = brute_probabilities(model, pairs)
    assert [len(q) for q in got] == [len(r) for _, r in pairs]
    for q, w in zip(got, want):
        assert torch.allclose(torch.from_numpy(q), torch.tensor(w, dtype=torch.float64), rtol=0, atol=1e-12)


def test_ceiling_equals_brute_force_counts(model, pairs):
    qs = brute_probabilities(model, pairs)
    flat = [x for q in qs for x in q]
    for tau in TAUS:
        assert min(abs(x - tau) for x in flat) > MARGIN  # no near-tie the 1e-15 differences could flip
    results = measure(model, pairs, TAUS + (1.0,), B, batch=4)
    for res, tau in zip(results, TAUS):
        share, windows, tpf = brute_ceiling(qs, tau, B)
        assert res["tau"] == tau and res["windows"] == windows
        assert res["share"] == pytest.approx(share, rel=0, abs=0)
        assert res["tokens_per_forward"] == pytest.approx(tpf, rel=1e-15)
        assert res["positions"] == sum(len(r) for _, r in pairs) == sum(res["tokens"])
    shares = [r["share"] for r in results[:-1]]
    assert all(0 < s < 0.6 for row in shares for s in row)  # at every τ and j, windows pass and fail
    assert shares[0][0] < shares[-1][0] and 1.2 < results[0]["tokens_per_forward"] < B
    ar = results[-1]  # τ = 1: AR mode, one token per forward, whatever q rounds to (§5.5)
    assert ar["tokens_per_forward"] == 1.0 and ar["forwards"] == ar["tokens"]


def test_ceiling_on_hand_made_probabilities():
    """A reply spelt out: q = [., 0.99, 0.97, 0.5, 0.96, 0.99, 0.99, 0.99], τ = 0.95, B = 4."""
    q = [0.1, 0.99, 0.97, 0.5, 0.96, 0.99, 0.99, 0.99]
    res = ceiling([q], 0.95, 4)
    # steps: t=0 takes r0 r1 r2 (r3 fails); t=3 takes r3 r4 r5 r6 (capped at B); t=7 takes r7
    assert res["forwards"] == [3] and res["tokens_per_forward"] == 8 / 3
    # j = 1: of t = 0..6, the next position passes for t = 0, 1, 3, 4, 5, 6
    # j = 2: of t = 0..5, t = 0, 3, 4, 5; j = 3: of t = 0..4, t = 3, 4
    assert res["windows"] == [7, 6, 5] and res["share"] == [6 / 7, 4 / 6, 2 / 5]
