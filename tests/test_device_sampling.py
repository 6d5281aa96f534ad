"""Proofs for sampling on the device (fast/sample.py, fast/loop.py; issue 49), each able to fail:

  * the counter's uniforms are its rule written out with Python integers (no int64 overflow,
    the same numbers for seeds past 2^32 and negative ones), and they are uniform (chi-square
    over 20 bins, across steps, positions and rows);
  * `draw` is the inverse CDF: the first token whose cumulative sum exceeds u, never a token of
    probability 0, at u's smallest and largest values;
  * the device AR sampler's first three tokens follow the exact AR distribution of a tiny HF
    Qwen2 (tests/sampling_reference.py: all 8^3 continuations enumerated with HF's own warpers),
    chi-square at the 0.999 quantile over 20,000 rows, at temperature 1 and at 0.7 with top-p
    0.9; the same counts fail against the other setting's distribution;
  * the device AR and τ-window samplers are, token for token and forward for forward, a
    brute-force decode with the rule written out (float64: a full forward of the whole prefix
    per step, no cache; candidates by the inverse CDF of HF's processed distribution with the
    counter's numbers; τ on the raw probability; EOS and budget), ragged prompts, τ 1 and 0.05
    with drafts accepted, EOS in the middle of a chunk: so a row in a batch is the row alone
    with seed + b, and a request is reproducible from its seed;
  * exact mode sampled on the device (fast.sample.speculative) passes the same chi-square test
    (K = 2, T = 0.7, top-p 0.9) at fewer forwards than tokens, and the test rejects a wrong rule
    (accept every draft); a row in its batch is the row alone with seed + b, a seed reproduces;
  * a sampled step (window, exact) compiles whole (fullgraph=True, aot_eager) once for two
    requests with other seeds, and reads nothing back from the device (meta device).
"""

import copy

import pytest
import torch
from conftest import graphs_built
from sampling_reference import (
    ar_distribution,
    chi_square,
    critical_value,
    hf_next_logits,
    hf_probs,
    histogram,
    tiny_hf_model,
)
from test_fast_paths import tiny_model

import fast
import fast.cache
import fast.loop
from decoding import Generation
from fast.loop import State, generate_ar_device, generate_exact_device, generate_window_device, window_step
from fast.sample import counter_uniforms, draw
from model import Qwen2
from sampling import Sampling

M32 = 2**32 - 1


def mix(x):  # lowbias32 on Python integers: the products are exact, then cut to 32 bits
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniform(seed, step, j):
    return (mix(mix(mix(seed & M32 ^ 0x9E3779B9) ^ step & M32) ^ j) + 0.5) / 2**32


def test_counter_uniforms_are_the_rule_written_out():
    seeds = [0, 1, 7, 2**31 - 1, 2**32 + 3, 2**40 + 5, -1, -12345]
    for step in (0, 1, 2, 1000, 2**33 + 1):
        got = counter_uniforms(torch.tensor(seeds), torch.tensor(step), 6)
        want = torch.tensor([[uniform(s, step, j) for j in range(6)] for s in seeds], dtype=torch.float64)
        assert torch.equal(got, want)


def test_counter_uniforms_are_uniform():
    """20 equal bins, 60,000 numbers each way: across steps, positions and rows."""
    one, zero, many = torch.arange(1), torch.tensor(0), torch.arange(60_000)
    for seeds, steps, n in ((one, many, 1), (one, zero, 60_000), (many, zero, 1)):
        u = counter_uniforms(seeds, steps, n).flatten()  # steps (60,000,) broadcast against one seed
        assert 0 < u.min() and u.max() < 1
        stat, df = chi_square(torch.bincount((u * 20).long(), minlength=20), torch.full((20,), 0.05))
        assert stat < critical_value(df), stat


def test_draw_is_the_inverse_cdf():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    lo, hi = 0.5 / 2**32, 1 - 0.5 / 2**32  # the extreme uniforms
    for u, want in ((lo, 1), (0.2499, 1), (0.2501, 3), (0.7499, 3), (0.7501, 4), (hi, 4)):
        assert draw(probs, torch.tensor(u, dtype=torch.float64)).item() == want, u
    unnormalised = probs * 3  # the CDF is scaled by its total
    assert draw(unnormalised, torch.tensor(0.7501, dtype=torch.float64)).item() == 4


# ---------------------------------------------------------------- the distribution
PROMPT, V, L, N, CHUNK = [1, 2, 3], 8, 3, 20_000, 2_000
SETTINGS = {"T=1": Sampling(temperature=1.0), "T=0.7,top-p=0.9": Sampling(temperature=0.7, top_p=0.9)}


@pytest.fixture
def small_blocks(monkeypatch):
    """Static caches in key blocks of 16 slots, not 512: 20,000 rows of a tiny model attend over
    ~32 slots instead of 512 (30x less work). Masked slots add exact zeros (fast/cache.py), so no
    number changes; the 512-slot blocks are proven in tests/test_engine.py and test_bf16.py."""
    monkeypatch.setattr(fast.cache, "KEY_BLOCK", 16)
    monkeypatch.setattr(fast.loop, "KEY_BLOCK", 16)


@pytest.fixture(scope="module")
def v8(tmp_path_factory):
    """(HF tiny vocab-8 model, the engine over our Qwen2 with the same weights)."""
    path = tmp_path_factory.mktemp("v8")
    hf = tiny_hf_model(path)
    return hf, fast.make_fast(Qwen2.from_pretrained(str(path)).eval())


def test_the_device_ar_sampler_follows_the_ar_distribution(v8, small_blocks):
    hf, engine = v8
    counts, refs = {}, {}
    for name, s in SETTINGS.items():
        refs[name], margin = ar_distribution(hf_next_logits(hf), PROMPT, L, V, s)
        assert margin > 1e-4  # no continuation at the top-p edge
        rows = []
        for i in range(N // CHUNK):  # row b of chunk i has the seed i * CHUNK + b: 20,000 seeds
            s_i = Sampling(temperature=s.temperature, top_p=s.top_p, seed=i * CHUNK)
            rows += [g.ids for g in generate_ar_device(engine, [PROMPT] * CHUNK, L, sampling=s_i)]
        counts[name] = histogram(torch.tensor(rows), V)
    for name, other in (("T=1", "T=0.7,top-p=0.9"), ("T=0.7,top-p=0.9", "T=1")):
        stat, df = chi_square(counts[name], refs[name])
        assert df > 100 and stat < critical_value(df), (name, stat, critical_value(df))
        wrong, df = chi_square(counts[name], refs[other])
        assert wrong > critical_value(df), (name, "the test cannot tell the settings apart")


def accept_every_draft(p, q, d, n, u):
    """A deliberately WRONG rule: keep every real draft, then draw from p after the last one."""
    return n, draw(p[torch.arange(len(n)), n], u[:, d.shape[1]])


def test_device_exact_mode_samples_the_ar_distribution(v8, small_blocks, monkeypatch):
    """Exact mode on the device (fast.sample.speculative), K = 2 at temperature 0.7 with top-p 0.9
    (20,000 rows): its first three tokens pass the chi-square test against the exact AR
    distribution, at fewer forwards than tokens; with the wrong rule (accept every draft) the same
    test rejects it (4,000 rows). A budget of 3 tokens: the first step still verifies both drafts
    (the device loop forwards all K; the budget cuts what is emitted, after the rule). (K = 4 at
    20,000 rows costs 19 s here; its greedy tokens are tests/test_fast_loop.py's.)"""
    hf, engine = v8
    K, MASK_V8, s = 2, 7, SETTINGS["T=0.7,top-p=0.9"]  # id 7 plays <|mask|>, as in test_sampling_decoders.py

    def samples(n_rows):
        rows, tokens, forwards = [], 0, 0
        for i in range(n_rows // CHUNK):
            s_i = Sampling(temperature=s.temperature, top_p=s.top_p, seed=i * CHUNK)
            gens = generate_exact_device(engine, [PROMPT] * CHUNK, K, L, MASK_V8, sampling=s_i)
            rows += [g.ids for g in gens]
            tokens += sum(len(g.ids) for g in gens)
            forwards += sum(g.forwards for g in gens)
        return histogram(torch.tensor(rows), V), tokens, forwards

    ref, _ = ar_distribution(hf_next_logits(hf), PROMPT, L, V, s)
    counts, tokens, forwards = samples(N)
    stat, df = chi_square(counts, ref)
    assert df > 100 and stat < critical_value(df), (stat, critical_value(df))
    assert tokens > forwards  # drafts were accepted
    monkeypatch.setattr(fast.loop, "speculative", accept_every_draft)
    counts, _, _ = samples(2 * CHUNK)
    stat, df = chi_square(counts, ref)
    assert stat > critical_value(df), "the test cannot tell the wrong rule"


# ---------------------------------------------------------------- token for token
MASK, PROMPTS = 63, [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]


@torch.no_grad()
def brute_force(model, prompt, seed, s, B, tau, max_new, eos):
    """The τ rule with sampling, written out for one row (docs/spec.md §5): every step a full
    forward of [prefix | B-1 masks] (no cache), the candidates c_j by the inverse CDF of HF's
    processed distribution at position j with the uniform of (seed, step, j), c_0 and the
    leading run of raw softmax p(c_j) >= τ kept (c_0 alone at τ >= 1), cut after an EOS id and
    at the budget -> Generation(ids, forwards)."""
    seq, out, step = list(prompt), [], 0
    while True:
        logits = model(torch.tensor([seq + [MASK] * (B - 1)]))[0, len(seq) - 1:]  # (B, V) float64
        probs, raw = hf_probs(logits, s).double(), logits.float().softmax(-1)
        c = []
        for j in range(B):
            cdf = probs[j].cumsum(0)
            c.append(int((cdf <= uniform(seed, step, j) * cdf[-1]).sum()))  # the first cdf above u
        a = 1
        while tau < 1 and a < B and raw[a, c[a]] >= tau:
            a += 1
        step += 1
        for t in c[:a]:
            out.append(t)
            if t in eos or len(out) == max_new:
                return Generation(out, step)
        seq += c[:a]


@pytest.fixture(scope="module")
def pair():
    ref = tiny_model(3, 2, std=0.1).double().eval()  # spread distributions: draws differ from the argmax
    return ref, fast.make_fast(copy.deepcopy(ref))


S = Sampling(temperature=0.8, top_k=20, top_p=0.95, seed=11)


@pytest.mark.parametrize("tau", [1.0, 0.05])
def test_the_device_samplers_are_the_rule_brute_force(pair, tau):
    ref, engine = pair
    free = [brute_force(ref, p, S.seed + b, S, 4, tau, 20, ()) for b, p in enumerate(PROMPTS)]
    eos = {free[0].ids[4], free[1].ids[9]}
    for eos_ids, chunk in (((), 8), (eos, 3)):
        want = [brute_force(ref, p, S.seed + b, S, 4, tau, 20, eos_ids) for b, p in enumerate(PROMPTS)]
        assert generate_window_device(engine, PROMPTS, 4, tau, 20, MASK, eos_ids, chunk, sampling=S) == want
        if tau == 1.0:
            want = [brute_force(ref, p, S.seed + b, S, 1, 1.0, 20, eos_ids) for b, p in enumerate(PROMPTS)]
            assert generate_ar_device(engine, PROMPTS, 20, eos_ids, chunk, sampling=S) == want
    greedy = generate_window_device(engine, PROMPTS, 4, tau, 20, MASK)
    assert [g.ids for g in greedy] != [g.ids for g in free]  # sampling is not the argmax here
    if tau < 1:
        assert sum(len(g.ids) for g in free) > sum(g.forwards for g in free)  # drafts were accepted


def test_a_sampled_step_compiles_whole_once_for_two_seeds(pair, fresh_dynamo):
    ref, engine = pair
    step = torch.compile(window_step, fullgraph=True, backend="aot_eager", dynamic=False)
    before, got = graphs_built(), []
    for seed in (1, 2):
        s = Sampling(temperature=0.8, top_k=20, top_p=0.95, seed=seed)
        want = [brute_force(ref, p, seed + b, s, 4, 0.05, 12, ()) for b, p in enumerate(PROMPTS)]
        got.append(generate_window_device(engine, PROMPTS, 4, 0.05, 12, MASK, (), 4, step, sampling=s))
        assert got[-1] == want
    assert graphs_built() - before == 1 and got[0] != got[1]


def test_a_sampled_step_reads_nothing_back_from_the_device():
    model = fast.make_fast(tiny_model(3, 2).double().eval()).to("meta")
    st = State(model, 3, 512, 8, 4)
    st.mask_id, st.sampling = MASK, S
    window_step(model, st)


def test_device_exact_sampling_is_a_row_alone_and_reproducible(pair, fresh_dynamo):
    """Sampled exact mode on the device: a row in a batch draws what it draws alone with seed + b,
    the same seed gives the same tokens, another seed others; compiled whole (aot_eager) it gives
    the eager tokens with one graph for two seeds; a step reads nothing back (meta device)."""
    import dataclasses

    from exact import step_layout
    from fast.loop import exact_step

    ref, engine = pair
    run = lambda prompts, s, step=exact_step: generate_exact_device(engine, prompts, 2, 16, MASK, (), 4, step,
                                                                    sampling=s)
    batch = run(PROMPTS, S)
    alone = [run([p], dataclasses.replace(S, seed=S.seed + b))[0] for b, p in enumerate(PROMPTS)]
    assert batch == alone and run(PROMPTS, S) == batch
    other = run(PROMPTS, dataclasses.replace(S, seed=S.seed + 7))
    assert [g.ids for g in other] != [g.ids for g in batch]
    assert sum(len(g.ids) for g in batch) > sum(g.forwards for g in batch)  # drafts were accepted
    step = torch.compile(exact_step, fullgraph=True, backend="aot_eager", dynamic=False)
    before = graphs_built()
    assert run(PROMPTS, S, step) == batch
    assert run(PROMPTS, dataclasses.replace(S, seed=S.seed + 7), step) == other
    assert graphs_built() - before == 1
    model = fast.make_fast(tiny_model(3, 2).double().eval()).to("meta")
    st = State(model, 3, 512, 9, 3)
    st.mask_id, st.sampling, st.threshold = MASK, S, 0.0
    st.offsets, st.mask = step_layout(2, 2, "meta")
    st.q = torch.zeros(3, 2, model.config.vocab_size, device="meta")
    exact_step(model, st)
