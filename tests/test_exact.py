"""Proofs for exact.py: exact mode is greedy AR at several tokens per forward
(issue "Exact mode"; docs/spec.md §3, §5, §6).

Claims, each against an independent reference:
  * the step mask is the rule written out with nested loops (mars.exact_attention_mask);
  * one step forward = many plain causal HF forwards: the real tokens' logits are HF's
    on [P, c_0, d_1..d_k], group G_j's are HF's on [P, c_0, d_1..d_j, masks]; and groups
    of K masks give what groups of B masks give (why a group holds K masks);
  * the output is HF `generate(do_sample=False)`, token for token: K in {1, 2, 4},
    B in {4, 8}, batch 1 and a batch of ragged prompts, with and without a draft
    threshold, on a 256-token vocabulary (drafts nearly always wrong) and an 8-token
    one (drafts often right by chance; the test asserts multi-token steps happened);
  * right drafts are accepted: an oracle model whose masks predict the HF continuation
    gives exactly 1+K tokens per forward, still HF's output; always-wrong drafts give
    exactly 1 token per forward;
  * the algorithm written out on HF (one plain causal forward to verify, one per draft
    group) accepts the same number of tokens at every step;
  * the cache keeps verified K/V only: after every step the committed slots equal a
    fresh prefill of the row's tokens, and a generating row has lengths = prompt +
    emitted - 1 (the pending c_0 is emitted, not cached);
  * EOS mid-step and max_new_tokens; bad settings are refused.
Every HF greedy path compared token for token, and every argmax and threshold the written-out
algorithm's counts read, is asserted far from a tie (tests/greedy_margin.py). The *_fast
cases decode through the engine (fast.make_fast: packed fp32 weights, its cache, the block
argmax) and assert that the weights were packed; tests/test_engine.py proves the engine equals
the reference in float64 for every decoder.
"""


import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import first_mid_step_token, hf_greedy, make_hf_model
from greedy_margin import GAP, assert_no_near_tie, top2_gap

import exact
import fast
from decoding import greedy_pick, pad_rows
from exact import exact_steps, generate_exact, step_input
from fast.argmax import block_argmax
from fast.linear import FastLinear
from mars import exact_attention_mask
from model import Qwen2

PROMPTS = [[5, 1, 6, 3, 4], [1, 2, 3, 4, 5, 6, 0, 1, 2], [4, 2]]  # ids < 7: valid in both vocabularies
N_NEW = 24
SETTINGS = [(K, B) for B in (4, 8) for K in (1, 2, 4)]
DRAFT_MARGIN = 1e-4  # |p - draft threshold|: fp32 logits differ by <= 5.4e-6, p so by < 1.1e-5 (9x)



def load(path, **cfg):
    """(HF reference, our model, mask id) with the same random weights; the last id plays <|mask|>.
    HF's greedy paths of PROMPTS, as long as any test reads them (the oracle's), have no near-tie
    (greedy_margin): a token-for-token mismatch with them is a bug, not fp32 rounding."""
    hf = make_hf_model(path, seed=0, **cfg)
    assert_no_near_tie(hf, PROMPTS, [hf_greedy(hf, [p], N_NEW + 10)[0] for p in PROMPTS])
    return hf, Qwen2.from_pretrained(str(path)).eval(), hf.config.vocab_size - 1


def engine(pair):
    """The pair with its model made the engine (fast.make_fast, as generate.py --fast opens a
    model): fp32 oneDNN matmuls from packed weights, its cache, its block argmax, the decoders
    unchanged. Asserts every linear got its packed copy (as tests/test_fast_paths.py does): on a torch
    without oneDNN these cases would otherwise repeat the plain ones and claim what they did not run."""
    hf, model, mask_id = pair
    model = fast.make_fast(copy.deepcopy(model))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is FastLinear and m.packed is not None for m in linears), "not packed"
    assert greedy_pick(model) is block_argmax  # the decoders' greedy pick is the engine's
    return hf, model, mask_id


@pytest.fixture(scope="module")
def v256(tmp_path_factory):
    return load(tmp_path_factory.mktemp("v256"))


@pytest.fixture(scope="module")
def v256_fast(v256):
    return engine(v256)


@pytest.fixture(scope="module")
def v8_fast(v8):
    return engine(v8)


@pytest.fixture(scope="module")
def v8(tmp_path_factory):
    """An 8-token vocabulary: a mask guesses the next-but-one token right quite often."""
    return load(tmp_path_factory.mktemp("v8"), vocab_size=8)


def run(model, prompts, mask_id, K, B=8, **kw):
    """exact_steps to the end -> (ids per row, Steps)."""
    kw = dict(max_new_tokens=N_NEW) | kw
    steps = list(exact_steps(model, prompts, block_size=B, drafts=K, mask_id=mask_id, **kw))
    return [[t for s in steps for t in s.tokens[b]] for b in range(len(prompts))], steps


# ---------------------------------------------------------------- the step mask
def mask_written_out(K, g):
    """The rule of exact.py's docstring, one (query, key) pair at a time."""
    toks = [("real", i, None) for i in range(1 + K)]
    toks += [("mask", j, m) for j in range(1 + K) for m in range(g)]
    out = torch.zeros(len(toks), len(toks), dtype=torch.bool)
    for q, (kind_q, a_q, m_q) in enumerate(toks):
        for k, (kind_k, a_k, m_k) in enumerate(toks):
            if kind_q == "real" and kind_k == "real":
                out[q, k] = a_k <= a_q  # causal among c_0, d_1..d_K
            elif kind_q == "mask" and kind_k == "real":
                out[q, k] = a_k <= a_q  # G_j sees c_0, d_1..d_j
            elif kind_q == "mask" and kind_k == "mask":
                out[q, k] = a_k == a_q and m_k <= m_q  # own group, causal
            # a real token never sees a mask
    return out


@pytest.mark.parametrize("K", [0, 1, 2, 4])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_mask_is_the_rule_written_out(K, g):
    assert torch.equal(exact_attention_mask(K, g), mask_written_out(K, g))


def test_draft_threshold_keeps_the_leading_run():
    def masks(*ps):  # one mask per p: token i+1 gets probability p, the other 3 share the rest
        probs = torch.tensor([[(1 - p) / 3] * 4 for p in ps])
        for i, p in enumerate(ps):
            probs[i, (i + 1) % 4] = p
        return probs.log()
    logits = torch.stack([masks(0.9, 0.4, 0.8), masks(0.4, 0.9, 0.9), masks(0.6, 0.6, 0.6)])  # (3, 3, 4)
    assert exact.draft(logits, 0.5)[0] == [[1], [], [1, 2, 3]]  # stop at the first p < 0.5
    assert exact.draft(logits, 0.0)[0] == [[1, 2, 3]] * 3
    assert exact.draft(logits, 1.0)[0] == [[], [], []]


# ---------------------------------------------------------------- one step = many causal forwards
@torch.no_grad()
def one_step(model, prompts, c0, drafts, g, mask_id):
    """Prefill `prompts`, then run one step forward -> per-token logits (N, T, V)."""
    cache = model.new_cache(len(prompts), 64)
    model.hidden(pad_rows(prompts, 0, "cpu"), cache=cache)
    cache.commit(torch.tensor([len(p) for p in prompts]))
    tokens, positions, mask = step_input(c0, drafts, g, cache.lengths, mask_id)
    return model(tokens, positions, mask, cache)


@torch.no_grad()
def test_step_equals_separate_causal_forwards_and_group_size_k_is_enough(v256):
    hf, model, mask_id = v256
    K, B = 3, 8
    prompts, c0, drafts = PROMPTS[:2], [7, 9], [[11, 12, 13], [14]]  # ragged: 3 drafts and 1
    by_g = {g: one_step(model, prompts, c0, drafts, g, mask_id) for g in (K, B)}
    for g, logits in by_g.items():
        k = 3  # the most drafts of a row: 1+k real tokens, then 1+k groups of g masks
        for b, (p, c, d) in enumerate(zip(prompts, c0, drafts)):
            ref = hf(torch.tensor([p + [c] + d])).logits[0, len(p):]  # outputs at c_0, d_1..
            torch.testing.assert_close(logits[b, : 1 + len(d)], ref, atol=1e-4, rtol=0)
            for j in range(1 + len(d)):
                ref = hf(torch.tensor([p + [c] + d[:j] + [mask_id] * g])).logits[0, len(p) + 1 + j:]
                start = 1 + k + j * g
                torch.testing.assert_close(logits[b, start:start + g], ref, atol=1e-4, rtol=0)
    # masks past the K-th cannot change the first K outputs of a group
    small, big = by_g[K], by_g[B]
    torch.testing.assert_close(small[:, :4], big[:, :4], atol=1e-5, rtol=0)  # real tokens
    for j in range(4):
        torch.testing.assert_close(small[:, 4 + j * K: 4 + (j + 1) * K], big[:, 4 + j * B: 4 + j * B + K],
                                   atol=1e-5, rtol=0)


# ---------------------------------------------------------------- output = HF greedy
@pytest.mark.parametrize("threshold", [0.0, 0.5])
@pytest.mark.parametrize("K,B", SETTINGS)
@pytest.mark.parametrize("vocab", ["v256", "v8", "v256_fast", "v8_fast"])
def test_equals_hf_greedy(request, vocab, K, B, threshold):
    hf, model, mask_id = request.getfixturevalue(vocab)
    ref = [hf_greedy(hf, [p], N_NEW)[0] for p in PROMPTS]
    counts = []
    for p, r in zip(PROMPTS, ref):
        ids, steps = run(model, [p], mask_id, K, B, draft_threshold=threshold)
        assert ids == [r], (p, K, B, threshold)
        counts += [s.counts[0] for s in steps]
        assert steps[-1].forwards == len(steps)  # one forward per step, the prefill included
    ids, steps = run(model, PROMPTS, mask_id, K, B, draft_threshold=threshold)  # ragged batch
    assert ids == ref
    assert max(counts) <= 1 + K
    if vocab.startswith("v8"):
        assert max(counts) > 1, "no draft was ever accepted: the test would be vacuous"


# ---------------------------------------------------------------- right drafts are accepted
class Oracle(torch.nn.Module):
    """Our model, except that a <|mask|> at position p outputs the token at p+1 of
    `seqs[row]` (the prompt + HF's greedy continuation), plus `shift` (shift 1: always
    wrong). Real tokens keep the model's outputs, so the AR output is unchanged.
    hidden() appends one channel holding the oracle's token (-1 at a real token);
    lm_head() turns it into a one-hot logit row."""

    def __init__(self, model, seqs, mask_id, shift):
        super().__init__()
        assert all(mask_id not in s for s in seqs)  # else a real token would be taken for a mask
        self.model, self.config, self.seqs = model, model.config, seqs
        self.mask_id, self.shift = mask_id, shift

    def new_cache(self, batch_size, max_len, step=1):
        return self.model.new_cache(batch_size, max_len, step)

    def hidden(self, idx, position_ids=None, attn_mask=None, cache=None):
        B, T = idx.shape
        if position_ids is None:  # the prefill: slot index after the cached tokens
            position_ids = torch.arange(T)[None] + (cache.lengths[:, None] if cache is not None else 0)
        target = torch.full((B, T), -1.0)
        for b, t in zip(*(idx == self.mask_id).nonzero(as_tuple=True)):
            p = int(position_ids[b, t]) + 1
            target[b, t] = (self.seqs[b][p] + self.shift) % self.config.vocab_size
        h = self.model.hidden(idx, position_ids, attn_mask, cache)
        return torch.cat([h, target[..., None]], -1)

    def lm_head(self, h):
        logits, target = self.model.lm_head(h[..., :-1]), h[..., -1].long()
        one_hot = F.one_hot(target.clamp(min=0), logits.shape[-1]).float() * 100
        return torch.where((target >= 0)[..., None], one_hot, logits)


def oracle(pair, shift, K=4):
    """(Oracle over the pair's model, HF's greedy output per prompt)."""
    hf, model, mask_id = pair
    future = [hf_greedy(hf, [p], N_NEW + 2 * K + 2)[0] for p in PROMPTS]  # room for drafts past the end
    seqs = [p + f for p, f in zip(PROMPTS, future)]
    return Oracle(model, seqs, mask_id, shift), [f[:N_NEW] for f in future]


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("threshold", [0.0, 0.9])
def test_right_drafts_give_1_plus_k_tokens_per_forward(v256, K, threshold):
    model, refs = oracle(v256, shift=0, K=K)
    expected = [1]  # the prefill emits c_0; then every step all K drafts + the bonus
    while sum(expected) < N_NEW:
        expected.append(min(1 + K, N_NEW - sum(expected)))
    ids, steps = run(model, PROMPTS, model.mask_id, K, draft_threshold=threshold)
    assert ids == refs
    assert [s.counts for s in steps] == [[c] * 3 for c in expected]
    assert steps[-1].forwards == len(expected)


def test_wrong_drafts_give_exactly_one_token_per_forward(v256):
    model, refs = oracle(v256, shift=1)
    ids, steps = run(model, PROMPTS, model.mask_id, 4)
    assert ids == refs
    assert [s.counts for s in steps] == [[1, 1, 1]] * N_NEW and steps[-1].forwards == N_NEW


def test_eos_mid_step_stops_the_row_and_drops_the_rest(v256):
    hf = v256[0]
    model, refs = oracle(v256, shift=0)
    _, steps = run(model, PROMPTS[:1], model.mask_id, 4)
    eos, i = first_mid_step_token(steps)
    ids, steps = run(model, PROMPTS, model.mask_id, 4, eos_ids=[eos])
    assert ids[0] == refs[0][: i + 1] and steps[-1].done == [True] * 3
    assert ids == [hf_greedy(hf, [p], N_NEW, eos_id=eos)[0] for p in PROMPTS]  # other rows as alone


def test_max_new_tokens_one_is_the_prefill_alone(v256):
    model, refs = oracle(v256, shift=0)
    got = generate_exact(model, PROMPTS, block_size=4, drafts=4, max_new_tokens=1, mask_id=model.mask_id)
    assert [(g.ids, g.forwards) for g in got] == [(r[:1], 1) for r in refs]


# ---------------------------------------------------------------- the algorithm written out
def argmax_far_from_a_tie(row):
    """The argmax of one logit row, asserting its top-2 gap exceeds GAP (greedy_margin): an
    argmax the counts depend on must not be one fp32 rounding could flip."""
    assert top2_gap(row) > GAP, f"near-tie: top-2 gap {top2_gap(row):.1e}"
    return int(row.argmax())


@torch.no_grad()
def reference_exact(hf, prompt, K, threshold, max_new, mask_id):
    """Exact mode written out on HF, one prompt, plain causal forwards only.
    -> (ids, tokens emitted per forward, drafts offered per step). Every argmax and threshold
    comparison the result depends on is asserted far from a tie (GAP, DRAFT_MARGIN)."""
    def drafts_after(seq):  # K masks after the accepted tokens; mask m is read at len(seq)+m
        out = []
        for row in hf(torch.tensor([seq + [mask_id] * K])).logits[0, len(seq):].float():
            p = float(row.softmax(-1).max())
            assert threshold == 0 or abs(p - threshold) >= DRAFT_MARGIN, f"near-tie: p={p}"
            if p < threshold:
                break
            out.append(argmax_far_from_a_tie(row))
        return out

    c0 = argmax_far_from_a_tie(hf(torch.tensor([prompt])).logits[0, -1])
    seq, d, ids, counts, offered = list(prompt), drafts_after(prompt), [c0], [1], []
    while len(ids) < max_new:
        offered.append(len(d))
        logits = hf(torch.tensor([seq + [c0] + d])).logits[0, len(seq):]  # outputs at c_0, d_1..
        ar = [int(row.argmax()) for row in logits]
        a = 0
        while a < len(d) and d[a] == ar[a]:
            a += 1
        for row in logits[:a + 1]:  # the verified argmaxes: compared with d_1..d_a, then emitted
            argmax_far_from_a_tie(row)
        new = (d[:a] + [ar[a]])[: max_new - len(ids)]
        ids, counts = ids + new, counts + [len(new)]
        seq = seq + [c0] + d[:a]
        c0, d = ar[a], drafts_after(seq)
    return ids, counts, offered


@pytest.mark.parametrize("K,threshold", [(2, 0.0), (4, 0.0), (4, 0.5)])
def test_accepted_counts_equal_the_algorithm_written_out(v8, K, threshold):
    hf, model, mask_id = v8
    refs = [reference_exact(hf, p, K, threshold, N_NEW, mask_id) for p in PROMPTS]
    for p, (ref, ref_counts, _) in zip(PROMPTS, refs):
        assert ref == hf_greedy(hf, [p], N_NEW)[0]
        ids, steps = run(model, [p], mask_id, K, draft_threshold=threshold)
        assert ids == [ref] and [s.counts[0] for s in steps] == ref_counts
    ids, steps = run(model, PROMPTS, mask_id, K, draft_threshold=threshold)  # batched: rows accept apart
    for b, (ref, ref_counts, _) in enumerate(refs):
        assert ids[b] == ref and [s.counts[b] for s in steps[: len(ref_counts)]] == ref_counts
    counts = [c for _, cs, _ in refs for c in cs]
    offered = [k for _, _, ks in refs for k in ks]
    assert max(counts) > 1
    if threshold > 0:  # the threshold did cut drafts, and not all of them
        assert min(offered) < K and max(offered) > 0


# ---------------------------------------------------------------- the cache keeps verified K/V only
@pytest.mark.parametrize("threshold", [0.0, 0.5])
@torch.no_grad()
def test_cache_holds_only_verified_tokens(v8, monkeypatch, threshold):
    """After every step each row's cache holds exactly the K/V a fresh prefill of its verified
    tokens gives. In float64 (two computations of the same values: rounding is not the
    question; in fp32 the two shapes differ by ~2e-6)."""
    _, model, mask_id = v8
    model, caches = copy.deepcopy(model).double(), []

    def spy(*args, **kw):  # the decoder's cache, kept to be read after every step
        caches.append(Qwen2.new_cache(model, *args, **kw))
        return caches[-1]

    monkeypatch.setattr(model, "new_cache", spy)
    out, multi = [[] for _ in PROMPTS], False
    for step in exact_steps(model, PROMPTS, block_size=4, drafts=4, max_new_tokens=N_NEW,
                            mask_id=mask_id, draft_threshold=threshold):
        cache = caches[0]
        for b, p in enumerate(PROMPTS):
            out[b] += step.tokens[b]
            multi |= len(step.tokens[b]) > 1
            L = int(cache.lengths[b])
            if not step.done[b]:
                assert L == len(p) + len(out[b]) - 1  # everything emitted but the pending c_0
            fresh = Qwen2.new_cache(model, 1, L)
            model.hidden(torch.tensor([(p + out[b])[:L]]), cache=fresh)
            torch.testing.assert_close(cache.k[:, b, :, :L], fresh.k[:, 0, :, :L], atol=1e-12, rtol=0)
            torch.testing.assert_close(cache.v[:, b, :, :L], fresh.v[:, 0, :, :L], atol=1e-12, rtol=0)
    assert multi and all(step.done)


# ---------------------------------------------------------------- settings
BAD = [(dict(drafts=5), "drafts must be in"), (dict(drafts=0), "drafts must be in"),
       (dict(draft_threshold=1.5), "draft_threshold"),
       (dict(draft_threshold=float("nan")), "draft_threshold"),
       (dict(max_new_tokens=0), "max_new_tokens")]


@pytest.mark.parametrize("kw,msg", BAD)
def test_bad_settings_are_refused(v256, kw, msg):
    _, model, mask_id = v256
    args = dict(block_size=4, drafts=2, max_new_tokens=4, mask_id=mask_id) | kw
    with pytest.raises(ValueError, match=msg):
        generate_exact(model, PROMPTS, **args)
