"""Proofs for sampling.py (issue 13; docs/spec.md §5): each claim against an independent
reference, each able to fail.

  * processed_probs is Hugging Face's TemperatureLogitsWarper -> TopKLogitsWarper ->
    TopPLogitsWarper -> softmax, bit for bit (torch.equal: the same float32 ops in the
    same order give the same bits; no tolerance is needed, so none is allowed), on random
    logits with ties, -inf entries, k >= V, tiny and exact top-p edges, any leading shape;
  * sampling.argmax (the reference's greedy pick) and fast.argmax.block_argmax (the engine's:
    block maxima on the CPU) are the rule written out (the first largest, NaN the largest)
    and torch.argmax, on ties across and inside blocks, NaN, infinities and signed zeros, at
    every block width; a decoder's greedy pick is its model's (decoding.greedy_pick: the
    engine's model brings the block one, a reference model reads sampling.argmax, and making
    an engine replaces nothing in sampling);
  * temperature 0: pick is `logits.float().argmax(-1)` (today's greedy rule) and uses no
    randomness; the probability confidence is `logits.float().softmax(-1).gather(c)`;
  * bad settings are ValueErrors naming the flag;
  * a row drawn in a batch equals the row drawn alone (per-row generators); with one
    Generator, an AR loop of pick over HF's logits IS HF generate(do_sample=True) under
    the same seed, token for token (20,000 rows);
  * the speculative rule preserves the target distribution: chi-square at the 0.999
    quantile on >= 20,000 seeded samples (deterministic, so never flaky), for the first
    token and for the joint of three tokens of a toy two-distribution "model" decoded
    with K = 2 drafts; the same test REJECTS a wrong rule (accept every draft);
  * one-hot p and q (temperature 0) reduce the rule exactly to the greedy rule;
  * the decoders' future reference, the exact AR distribution of all 3-token
    continuations of a tiny HF Qwen2 (tests/sampling_reference.py), is what HF's own
    sampler draws, and the chi-square test tells it from another temperature's.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from sampling_reference import (
    ar_distribution,
    chi_square,
    critical_value,
    hf_next_logits,
    hf_probs,
    histogram,
    tiny_hf_model,
)
from transformers import GenerationConfig

from fast.argmax import block_argmax
from sampling import (
    Sampling,
    argmax,
    categorical,
    confidence,
    confident,
    greedy_accept,
    pick,
    processed_probs,
    row_generators,
    sample_drafts,
    speculative_accept,
)


def random_logits(seed, N, V, kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 3
    if kind == "ties":  # few distinct values: many ties at the top-k edge and in the top-p sort
        x = x.round()
    if kind == "-inf":  # logits already masked (e.g. by an earlier processor)
        x[torch.rand(N, V, generator=g) < 0.3] = -math.inf
        x[:, 0] = 0.0  # at least one finite score per row
    return x


# ---------------------------------------------------------------- the processed distribution
def test_processed_probs_equal_hf_warpers_bit_for_bit():
    settings = [Sampling(temperature=t, top_k=k, top_p=p)
                for t, k, p in itertools.product((0.3, 0.7, 1.0, 1.7), (0, 1, 3, 10, 64, 1000),
                                                 (1.0, 0.999, 0.9, 0.5, 0.05, 1e-9))]
    checked = 0
    for (seed, V, kind), s in itertools.product(
            [(0, 64, "normal"), (1, 64, "ties"), (2, 64, "-inf"), (3, 1, "normal"), (4, 7, "ties"),
             (5, 1000, "normal"), (6, 1000, "ties")], settings):
        x = random_logits(seed, 6, V, kind)
        ours, ref = processed_probs(x, s), hf_probs(x, s)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, ref), (seed, V, kind, s)
        assert ((ours > 0).sum(-1) >= 1).all()  # at least one token kept
        checked += 1
    assert checked == 7 * 144


def test_processed_probs_bf16_logits_and_any_leading_shape():
    x = random_logits(7, 24, 50, "ties").to(torch.bfloat16)  # cast to float32 first, as HF does
    s = Sampling(temperature=0.6, top_k=12, top_p=0.8)
    assert torch.equal(processed_probs(x, s), hf_probs(x.float(), s))
    assert torch.equal(processed_probs(x.view(2, 3, 4, 50), s), hf_probs(x.float(), s).view(2, 3, 4, 50))


def test_top_p_keeps_the_smallest_set_with_enough_mass():
    """The rule in words, on a hand-made distribution: probs 0.5, 0.3, 0.15, 0.05."""
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None]
    kept = lambda p: (processed_probs(x, Sampling(temperature=1.0, top_p=p)) > 0).sum().item()
    assert [kept(p) for p in (0.4, 0.55, 0.75, 0.85, 0.96, 1.0)] == [1, 2, 2, 3, 4, 4]
    assert kept(0.5) == 1  # mass exactly top_p is enough (HF removes cumulative <= 1 - top_p)


# ---------------------------------------------------------------- temperature 0 is greedy
def first_largest(row):
    """The greedy rule written out for one row of floats: the first NaN if there is one
    (torch counts NaN as the largest), else the first entry equal to the maximum."""
    nans = [i for i, v in enumerate(row) if math.isnan(v)]
    return nans[0] if nans else row.index(max(row))


def adversarial_logits(seed, N, V):
    """Rows built to trip a blockwise argmax: few distinct values (the largest repeated in
    several blocks and inside one), -0.0 beside 0.0, +-inf, all -inf, NaN late and early."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 1, (N, V), generator=g).float()  # maximum 0, tied many times
    x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    x[1] = -3.0
    x[1, V - 1] = 0.0  # the only maximum in the last block
    x[2] = -math.inf  # all -inf: index 0
    x[3, V // 2] = math.inf
    x[4, V - 2] = math.nan  # NaN after the maxima
    x[5, 1], x[5, V - 1] = math.nan, math.nan
    x[6] = torch.randn(V, generator=g)  # one maximum anywhere
    return x


@pytest.mark.parametrize("V", [128, 1024, 49152, 130])
def test_argmax_is_the_first_largest(V):
    """sampling.argmax (the reference's greedy pick) and fast.argmax.block_argmax (the engine's,
    block maxima on the CPU: FastQwen2.argmax) are the rule written
    out and torch.argmax, at every block width that divides V (and V not a multiple of 128: the
    plain kernel)."""
    for seed in range(3):
        x = adversarial_logits(seed, 8, V)
        want = torch.tensor([first_largest(r) for r in x.tolist()])
        assert torch.equal(x.argmax(-1), want)  # torch's own kernel agrees with the rule
        assert torch.equal(argmax(x), want)
        for width in (1, 2, 8, 128, V):
            if V % width == 0:
                assert torch.equal(block_argmax(x, width), want), (V, width)
        for f in (argmax, block_argmax):
            assert torch.equal(f(x), want)
            assert torch.equal(f(x.view(2, 4, V)), want.view(2, 4))  # any leading shape
            bf16 = x.bfloat16()
            assert torch.equal(f(bf16), torch.tensor([first_largest(r) for r in bf16.tolist()]))
            assert f(torch.zeros(0, 3, V)).shape == (0, 3)


def test_a_decoders_greedy_pick_is_its_models_and_the_engine_replaces_nothing():
    """pick and sample_drafts read at temperature 0 the greedy pick they are handed (shown with a
    wrong one, the smallest); decoding.greedy_pick hands a reference model sampling.argmax and
    the engine's model its block_argmax; making an engine leaves sampling's names as they were."""
    import fast
    import sampling
    from decoding import greedy_pick
    from model import Qwen2, Qwen2Config

    x = torch.tensor([[0.0, 1.0, 1.0, 0.0] * 32])  # ties: the first largest is index 1
    smallest = lambda logits: logits.float().argmin(-1)
    assert pick(x, Sampling()).item() == 1
    assert pick(x, Sampling(), None, smallest).item() == 0  # the one handed decides
    assert sample_drafts(x[None], Sampling(), None, 0.0, smallest)[0].item() == 0
    before = dict(vars(sampling))
    model = Qwen2(Qwen2Config(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1))
    assert greedy_pick(model) is argmax
    engine = fast.make_fast(model)
    assert greedy_pick(engine) is block_argmax
    assert vars(sampling) == before and sampling.argmax is argmax


def test_temperature_zero_is_todays_argmax_and_uses_no_randomness():
    for dtype in (torch.float32, torch.bfloat16):
        x = random_logits(8, 40, 30, "ties").view(5, 8, 30).to(dtype)  # ties: first index wins
        g = torch.Generator().manual_seed(3)
        state = g.get_state()
        c = pick(x, Sampling(), [g] * 5)
        assert torch.equal(c, x.float().argmax(-1))
        assert torch.equal(g.get_state(), state)  # nothing drawn
        q = processed_probs(x, Sampling(top_k=3, top_p=0.5))  # top-k/top-p do not matter at T = 0
        assert torch.equal(q, F.one_hot(c, 30).float())


def test_probability_confidence_at_temperature_zero_is_the_greedy_rule():
    x = random_logits(9, 40, 30, "normal").view(5, 8, 30).to(torch.bfloat16)
    c = pick(x, Sampling(), None)
    expected = x.float().softmax(-1).gather(-1, c[..., None])[..., 0]  # decoding.candidates before sampling
    assert torch.equal(confidence(x, c, "probability"), expected)


def test_entropy_and_margin_confidences():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [1.0, 0.0, 0.0, 0.0]])
    x = p.log()  # -inf for the zeros: entropy must still be finite
    c = torch.tensor([1, 0])
    H = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    assert torch.allclose(confidence(x, c, "entropy"), torch.tensor([H, 0.0]))
    assert torch.allclose(confidence(x, c, "margin"), torch.tensor([0.2, 1.0]))  # not of c: of p
    assert torch.allclose(confidence(x, c, "probability"), torch.tensor([0.3, 1.0]))
    assert confidence(torch.zeros(1, 1), torch.zeros(1, dtype=torch.long), "margin").item() == 1.0  # V = 1
    conf = torch.tensor([0.2, 0.5])
    assert confident(conf, 0.3, "probability").tolist() == [False, True]
    assert confident(conf, 0.3, "entropy").tolist() == [True, False]


# ---------------------------------------------------------------- bad settings
@pytest.mark.parametrize("kwargs, flag", [
    (dict(temperature=-1), "--temperature must be >= 0, got -1"),
    (dict(temperature=float("nan")), "--temperature"),
    (dict(temperature=float("inf")), "--temperature"),
    (dict(top_k=-1), "--top-k"), (dict(top_k=2.5), "--top-k"),
    (dict(top_p=0.0), "--top-p must be in (0, 1], got 0.0"), (dict(top_p=1.5), "--top-p"),
    (dict(top_p=float("nan")), "--top-p"),
    (dict(seed=1.5), "--seed"),
    (dict(accept_metric="confidence"), "--accept-metric must be one of probability, entropy, margin"),
])
def test_bad_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError) as e:
        Sampling(**kwargs)
    assert flag in str(e.value)


# ---------------------------------------------------------------- generators
def test_a_row_in_a_batch_equals_the_row_alone():
    """Per-row generators: what row b draws depends on row b only, not on its batch (nor on
    the batch's largest draft count k)."""
    s, V, seed = Sampling(temperature=0.8, top_k=20, top_p=0.95), 30, 11
    x = random_logits(12, 4 * 3 * V, 1, "normal").view(4, 3, V)
    batch = pick(x, s, row_generators(seed, 4, "cpu"))
    for b in range(4):
        assert torch.equal(pick(x[b:b + 1], s, row_generators(seed + b, 1, "cpu"))[0], batch[b])

    d, n, q = sample_drafts(x, s, row_generators(seed, 4, "cpu"))
    p = processed_probs(random_logits(13, 4 * 4 * V, 1, "normal").view(4, 4, V), s)
    n = torch.tensor([0, 2, 1, 3])  # ragged draft counts
    gens = row_generators(seed, 4, "cpu")
    a, nxt = speculative_accept(p, q, d, n, gens)
    for b in range(4):
        k = int(n[b])
        ab, nb = speculative_accept(p[b:b + 1, :k + 1], q[b:b + 1, :k], d[b:b + 1, :k], n[b:b + 1],
                                    row_generators(seed + b, 1, "cpu"))
        assert (ab.item(), nb.item()) == (a[b].item(), nxt[b].item())
    assert len(set(a.tolist())) > 1 or len(set(nxt.tolist())) > 1  # not a degenerate batch


def test_sampled_tokens_follow_the_processed_distribution():
    N, s = 20_000, Sampling(temperature=0.7, top_k=6, top_p=0.9)
    x = random_logits(14, 1, 8, "normal") / 3
    probs = hf_probs(x, s)[0]  # HF's warpers: the reference shares no code with pick
    draws = pick(x.expand(N, 8), s, torch.Generator().manual_seed(0))
    stat, df = chi_square(histogram(draws[:, None], 8), probs)
    assert df >= 3  # top-k and top-p left a real distribution to test
    assert stat < critical_value(df), (stat, critical_value(df))


# ---------------------------------------------------------------- the speculative rule
def accept_every_draft(p, q, d, n, gens):
    """A deliberately WRONG rule: keep all drafts, then sample after the last one."""
    return n, categorical(p[torch.arange(len(n)), n], gens)


def first_tokens(rule, p, q, N, gen):
    """N first emitted tokens: one draft d ~ q, verified against targets p (2, V)."""
    d = categorical(q.expand(N, 1, -1), gen)  # (N, 1)
    a, nxt = rule(p.expand(N, 2, -1), q.expand(N, 1, -1), d, torch.ones(N, dtype=torch.long), gen)
    return torch.where(a > 0, d[:, 0], nxt)


@pytest.mark.parametrize("seed, V", [(0, 8), (1, 5), (2, 3)])
def test_speculative_first_token_is_distributed_as_the_target(seed, V):
    N, s = 20_000, Sampling(temperature=1.0)
    g = torch.Generator().manual_seed(seed)
    p = processed_probs(torch.randn(2, V, generator=g) * 1.5, s)
    q = processed_probs(torch.randn(1, V, generator=g) * 1.5, s)
    crit = lambda df: critical_value(df)
    stat, df = chi_square(histogram(first_tokens(speculative_accept, p, q, N, g)[:, None], V), p[0])
    assert stat < crit(df), (stat, crit(df))
    wrong, df = chi_square(histogram(first_tokens(accept_every_draft, p, q, N, g)[:, None], V), p[0])
    assert wrong > 3 * crit(df), (wrong, crit(df))  # the same test rejects the wrong rule, widely


def toy_decode(target, draft, c0, L, K, s, gen, rule, N):
    """Exact mode on a toy model, N rows at once: the target's next-token logits are
    target[last token] (V, V), the drafter's are draft[previous token] (V, V). Each step
    drafts d_1..d_K ~ q (each seeing the previous draft, as mask groups are causal),
    verifies them against p at [last, d_1..d_K] with `rule`, and emits d_1..d_a, next.
    -> the first L emitted tokens (N, L)."""
    W = L + K + 1
    out, length = torch.full((N, W), -1), torch.zeros(N, dtype=torch.long)
    last, row = torch.full((N,), c0), torch.arange(N)
    while (length < L).any():
        d, q, prev = [], [], last
        for _ in range(K):
            q.append(processed_probs(draft[prev], s))
            prev = categorical(q[-1], gen) if not s.greedy else q[-1].argmax(-1)
            d.append(prev)
        d, q = torch.stack(d, 1), torch.stack(q, 1)  # (N, K), (N, K, V)
        p = processed_probs(target[torch.cat([last[:, None], d], 1)], s)  # (N, K+1, V)
        a, nxt = rule(p, q, d, torch.full((N,), K), gen)
        emitted = torch.cat([d, nxt[:, None]], 1)
        emitted[row, a] = nxt  # (N, K+1): d_1..d_a, next, (unused)
        for j in range(K + 1):
            m = (j <= a) & (length + j < W)
            out[row[m], (length + j)[m]] = emitted[m, j]
        length, last = length + a + 1, nxt
    return out[:, :L]


def joint_ar(target, c0, L, s):
    """Exact P(x_1..x_L) of AR sampling from the toy target: (V,)*L, from HF's warpers."""
    pt = hf_probs(target, s).double()  # (V, V): [previous token, next token]
    probs = pt[c0]  # (V,)
    for t in range(1, L):  # the last axis of probs is the previous token
        probs = probs[..., None] * pt.reshape((1,) * (t - 1) + pt.shape)
    return probs


@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=4, top_p=0.9)])
def test_speculative_joint_of_three_tokens_is_ar(s):
    """K = 2 drafts per step, three tokens: every way of emitting them (rejection at d_1,
    at d_2, all accepted + bonus, across steps) must give the AR product distribution."""
    N, V, L, K = 40_000, 5, 3, 2
    g = torch.Generator().manual_seed(5)
    target, draft = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)
    draft = 0.5 * draft + 0.5 * target  # drafts right often enough for all paths to occur
    probs = joint_ar(target, 0, L, s)
    assert (N * probs[probs > 0] >= 5).float().mean() > 0.8  # few cells are pooled by chi_square
    crit = lambda df: critical_value(df)

    seen = set()

    def rule(*args):  # speculative_accept, recording how many drafts each step accepted
        a, nxt = speculative_accept(*args)
        seen.update(a.tolist())
        return a, nxt

    stat, df = chi_square(histogram(toy_decode(target, draft, 0, L, K, s, g, rule, N), V), probs)
    assert stat < crit(df), (stat, crit(df))
    assert seen == {0, 1, 2}  # every path occurred: rejection at d_1, at d_2, both accepted
    wrong, df = chi_square(histogram(toy_decode(target, draft, 0, L, K, s, g, accept_every_draft, N), V),
                           probs)
    assert wrong > 3 * crit(df), (wrong, crit(df))


def test_joint_ar_reference_is_the_product():
    """The enumerated reference itself, against a loop over sequences."""
    s, V = Sampling(temperature=0.9, top_p=0.8), 4
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(6))
    pt, probs = hf_probs(target, s).double(), joint_ar(target, 2, 3, s)
    for x in itertools.product(range(V), repeat=3):
        assert probs[x] == pt[2, x[0]] * pt[x[0], x[1]] * pt[x[1], x[2]]
    assert abs(probs.sum().item() - 1) < 1e-6


def test_speculative_rule_at_temperature_zero_is_the_greedy_rule():
    """One-hot p (argmax of the AR logits) and q (at the drafts): accepted = the leading run
    of d_i == argmax after d_{i-1}, next = the argmax after the last accepted (the greedy exact.verify)."""
    N, k, V = 500, 4, 6
    g = torch.Generator().manual_seed(7)
    ar_logits = torch.randint(-2, 3, (N, k + 1, V), generator=g).float()  # ties: first index
    ar = ar_logits.argmax(-1)  # (N, k+1)
    d = torch.where(torch.rand(N, k, generator=g) < 0.7, ar[:, :k], torch.randint(0, V, (N, k), generator=g))
    n = torch.randint(0, k + 1, (N,), generator=g)
    p, q = processed_probs(ar_logits, Sampling()), F.one_hot(d, V).float()
    a_ref = ((d == ar[:, :k]) & (torch.arange(k) < n[:, None])).long().cumprod(1).sum(1)
    for seed in range(3):  # whatever the random numbers
        a, nxt = speculative_accept(p, q, d, n, torch.Generator().manual_seed(seed))
        assert torch.equal(a, a_ref) and torch.equal(nxt, ar.gather(1, a_ref[:, None])[:, 0])
    assert set(a_ref.tolist()) == set(range(k + 1))  # every acceptance count occurred
    # the greedy path (no one-hot tensors) is this rule: equal to speculative_accept on p, q,
    # also without randomness (gens=None), with ties and for k = 0
    ref = speculative_accept(p, q, d, n, None)
    assert all(torch.equal(x, y) for x, y in zip(greedy_accept(ar, d, n), ref))
    a0, nxt0 = greedy_accept(ar[:, :1], d[:, :0], torch.zeros_like(n))
    assert torch.equal(a0, torch.zeros_like(n)) and torch.equal(nxt0, ar[:, 0])
    assert all(torch.equal(x, y) for x, y in zip((a0, nxt0), speculative_accept(p[:, :1], q[:, :0], d[:, :0],
                                                                               torch.zeros_like(n), None)))


def test_draft_cut_reads_the_position_not_the_draw():
    """sample_drafts' n is exact.py's greedy cut at temperature 0, and at any temperature it
    does not depend on the random draw (so the kept drafts still follow q)."""
    x = random_logits(15, 6 * 4 * 12, 1, "normal").view(6, 4, 12) * 0.7
    raw = x.softmax(-1).amax(-1)
    for thr in (0.0, 0.2, 0.4):
        n_ref = (raw >= thr).long().cumprod(1).sum(1)
        d0, n0, q0 = sample_drafts(x, Sampling(), None, thr)
        assert torch.equal(d0, x.argmax(-1)) and torch.equal(n0, n_ref)
        assert q0 is None  # one-hot at d0 = processed_probs at temperature 0; greedy_accept reads d0
        assert torch.equal(processed_probs(x, Sampling()), F.one_hot(d0, 12).float())
        s = Sampling(temperature=1.0)
        cuts = {tuple(sample_drafts(x, s, torch.Generator().manual_seed(i), thr)[1].tolist())
                for i in range(5)}
        assert cuts == {tuple(n_ref.tolist())}
    assert len(set(n_ref.tolist())) > 1  # the cut really varied across rows


@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_p=0.9)])
def test_reference_ar_distribution_is_what_hf_samples(s):
    """The phase-2 reference (sampling_reference.ar_distribution, exact over all 8^3
    continuations of a tiny HF Qwen2) against HF generate(do_sample=True): 20,000 samples
    pass; the same samples are rejected against the distribution of another temperature."""
    hf, prompt, N = tiny_hf_model(), [1, 2, 3], 20_000
    probs, margin = ar_distribution(hf_next_logits(hf), prompt, 3, 8, s)
    assert margin > 1e-4  # no continuation sits at the top-p edge within float rounding
    torch.manual_seed(0)
    gc = GenerationConfig(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0, max_new_tokens=3,
                          min_new_tokens=3, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        seqs = hf.generate(torch.tensor([prompt] * N), generation_config=gc)[:, len(prompt):]
    stat, df = chi_square(histogram(seqs, 8), probs)
    assert stat < critical_value(df), (stat, critical_value(df))
    other, _ = ar_distribution(hf_next_logits(hf), prompt, 3, 8, Sampling(temperature=s.temperature * 1.5,
                                                                                top_p=s.top_p))
    wrong, df = chi_square(histogram(seqs, 8), other)
    assert wrong > 2 * critical_value(df), (wrong, critical_value(df))


@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5, top_p=0.9)])
def test_pick_with_one_generator_is_hf_generate_token_for_token(s):
    """An AR loop over HF's own logits with pick and one Generator seeded 0 draws exactly
    what HF generate(do_sample=True) draws after torch.manual_seed(0): same processed
    probabilities (bit for bit) and the same torch.multinomial call on the same stream."""
    hf, prompt, N = tiny_hf_model(), [1, 2, 3], 20_000
    ids, g = torch.tensor([prompt] * N), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.cat([ids, pick(hf(input_ids=ids).logits[:, -1], s, g)[:, None]], 1)
        torch.manual_seed(0)
        gc = GenerationConfig(do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              max_new_tokens=3, min_new_tokens=3, eos_token_id=None, pad_token_id=0)
        ref = hf.generate(torch.tensor([prompt] * N), generation_config=gc)
    assert torch.equal(ids, ref)
    assert len(set(map(tuple, ref[:, 3:].tolist()))) > 100  # really sampled
