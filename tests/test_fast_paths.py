"""Proofs that the fast paths of the forward compute what the plain ones compute (the
engine's, fast/, against the reference in tests/test_engine.py and tests/test_compile.py).

  * MARS training (docs/spec.md §3-§4): the engine's forward (fast/window.py: the clean
    stream plain causal over l tokens, the noisy stream cut to the blocks the loss reads,
    its queries masked over [clean | kept noisy]) gives the loss and every parameter
    gradient of the textbook mars.mars_loss (one forward over all 2l tokens with the
    (2l, 2l) mask tensor), for several (l, B), trimmed or not, both ablations, w = 0 and
    1, ragged padding, the teacher's KL and the 1/t row weights. Why it may: the clean rows
    of the full mask are causal over the clean stream and empty over the noisy one; the
    window keeps whole blocks around every loss output. The engine is applied from
    outside (fast.window.use_two_stream swaps classes; a plain model refuses its mask).
  * Plain causal attention without a mask tensor (sdpa's own causal mask) equals the
    explicit lower-triangular mask.
  * With a KV cache, the causal mask built from arithmetic equals the general
    construction with an explicit causal mask, and "no mask" for one new token per row
    at a common length is the same as all-true.
  * The engine's packed weights (fast.linear.FastLinear, packed by fast.make_fast) are read
    only while decoding and while the weight is unchanged, and the packed fp32 logits through
    the engine's cache equal HF's float64 logits as closely as fp32 allows.
Tolerances are relative to the largest magnitude of the reference tensor. The two
training paths sum the same terms in a different order (two attention calls instead of
one, their key/value gradients added), so in fp32 they agree to rounding, not bit for
bit (measured up to 4.3e-7 relative at std 0.02: a 1e-6 bound would be a bound on the
machine). The proof runs in float64, on a peaked model (std 0.3, where fp32 rounding
reaches ~5e-6): they agree to 1e-12 (observed <= 1.3e-14), the algebra is exact.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_float64, make_hf_model

import fast
import fast.window
from fast.linear import FastLinear, pack
from fast.window import (
    TwoStreamAttention,
    full_mask,
    mars_loss_windowed,
    noisy_window,
    two_stream_window,
    use_two_stream,
)
from kvcache import KVCache
from mars import IGNORE, collate, mars_attention_mask, mars_loss, pad_row
from model import Attention, Qwen2, Qwen2Config, build_mask, init_weights

MASK, EOS, PAD = 63, 62, 61  # special ids of the 64-token vocab
REL = 1e-6  # |fast - reference| <= REL * max|reference|, per tensor, fp32 (measured 0: the same kernels)
REL64 = 1e-12  # the same in float64 (observed <= 1.3e-14: windowed vs textbook gradients, 80x)
REL_PACKED = 2e-5  # fp32 packed decoding vs HF in float64: measured <= 1.8e-6 on 8 random models (plain fp32
#                    F.linear <= 2.1e-6 on the same ones): an 11x margin for other CPUs' kernels


def tiny_model(seed, n_kv, std=0.3):
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_kv, max_position_embeddings=256,
                      rope_theta=10000.0)
    return init_weights(Qwen2(cfg), std=std, seed=seed)


def ragged_batch(B, lengths, seed):
    """Rows of the given lengths (prompt about a third of each), EOS-padded to a multiple of B
    and right-padded to the longest: ragged padding, loss on each row's tail."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(0, 60, (n,), generator=g).tolist()
        n_prompt = max(1, n // 3)
        rows.append(pad_row(ids, [False] * n_prompt + [True] * (n - n_prompt), B, EOS))
    return collate(rows, PAD)


def close(a, b, rel=REL):
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


def loss_and_grads(model, fn):
    """fn() -> (loss, l_mask, l_ar); backward of the loss -> those (detached) and every gradient."""
    model.zero_grad(set_to_none=True)
    loss, l_mask, l_ar = fn()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return loss.detach(), l_mask.detach(), l_ar.detach(), grads


def assert_same(ours, ref, w=1.0):
    """The engine's (loss, l_mask, l_ar, grads) are the reference's to REL64; every parameter
    has a gradient (so none is compared as 0 = 0)."""
    assert close(ours[0], ref[0], REL64) and close(ours[1], ref[1], REL64)
    assert torch.isnan(ours[2]) and torch.isnan(ref[2]) if w == 0 else close(ours[2], ref[2], REL64)
    for k in ref[3]:
        assert ref[3][k].abs().max().item() > 0, k
        assert close(ours[3][k], ref[3][k], REL64), k


@pytest.mark.parametrize("l,B", [(8, 4), (12, 4), (6, 2), (16, 8), (5, 1), (9, 3), (1, 1)])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_clean_rows_of_the_mask_are_plain_causal(l, B, bidirectional):
    """What lets the clean stream run as plain causal attention, apart from the noisy one."""
    full = mars_attention_mask(l, B, bidirectional)
    assert torch.equal(full[:l, :l], torch.ones(l, l, dtype=torch.bool).tril())  # clean q -> clean k
    assert not full[:l, l:].any()  # clean q -> noisy k: never


@pytest.mark.parametrize("B,lengths", [(4, (13, 7, 20)), (2, (9, 6)), (1, (6, 11)), (3, (16, 4, 10))])
def test_noisy_window_keeps_every_loss_output_and_its_block(B, lengths):
    ids, labels = ragged_batch(B, lengths, seed=B)
    N, l = ids.shape
    start, W = noisy_window(labels, B)
    assert W % B == 0 and W < l  # whole blocks, and fewer than all of them here
    for r in range(N):
        assert start[r] % B == 0 and 0 <= start[r] and start[r] + W <= l
        outputs = [i - 1 for i in range(1, l) if labels[r, i] != IGNORE]  # noisy outputs the loss reads
        assert start[r] <= min(outputs) and max(outputs) < start[r] + W
    inputs, positions, mask, start = two_stream_window(ids, labels, MASK, B)
    kept = torch.cat([torch.arange(l).expand(N, l), l + start[:, None] + torch.arange(W)], 1)  # (N, l + W)
    full = mars_attention_mask(l, B)
    for r in range(N):  # the kept tokens' rows and columns of the full mask, as they are
        assert torch.equal(mask.rows[r], full[kept[r, l:]][:, kept[r]])
        assert torch.equal(positions[r], kept[r] % l)
    assert full_mask(l, B, False, ids.device) is full_mask(l, B, False, ids.device)  # built once


@pytest.mark.parametrize("B,lengths", [(4, (13, 7, 20)), (2, (9, 6)), (8, (21, 5)), (1, (6, 11)),
                                       (3, (16, 4, 10))])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("w", [1.0, 0.0])
@pytest.mark.parametrize("trim", [False, True])
def test_windowed_loss_and_gradients_equal_the_textbook_loss(B, lengths, bidirectional, w, trim, monkeypatch):
    """fast.window.mars_loss_windowed = mars.mars_loss, the loss and every parameter gradient, in
    float64; the engine's two-call attention ran in every layer over l + W tokens (W = l
    untrimmed), and the other ablation's loss differs (the comparison sees the mask)."""
    ids, labels = ragged_batch(B, lengths, seed=B)
    assert (ids == PAD).any()  # really ragged
    N, l = ids.shape
    widths = []
    attend = fast.window.two_stream_attend
    monkeypatch.setattr(fast.window, "two_stream_attend",
                        lambda q, *a: widths.append(q.shape[2]) or attend(q, *a))
    for seed, n_kv in [(0, 2), (1, 4)]:  # grouped-query and plain multi-head attention
        model = tiny_model(seed, n_kv).double()
        engine = use_two_stream(copy.deepcopy(model))
        ref = loss_and_grads(model, lambda m=model: mars_loss(m, ids, labels, MASK, B, w, bidirectional))
        widths.clear()
        ours = loss_and_grads(engine, lambda m=engine: mars_loss_windowed(m, ids, labels, MASK, B, w,
                                                                          bidirectional, trim=trim))
        assert_same(ours, ref, w)
        W = noisy_window(labels, B)[1] if trim else l
        assert widths == [l + W] * model.config.num_hidden_layers  # W < l in 4 of the 5 cases
        if B > 1:  # inside a block the ablation changes what a noisy query sees: another loss
            other = mars_loss_windowed(engine, ids, labels, MASK, B, w, not bidirectional, trim=trim)[0]
            assert not close(other.detach(), ref[0], 1e-6)


def random_teacher(labels, V, k, seed):
    """A make_teacher-shaped top-k teacher, one row per target (mars._targets' order)."""
    n = int((labels[:, 1:] != IGNORE).sum())
    g = torch.Generator().manual_seed(seed)
    top = torch.log_softmax(2 * torch.randn(n, V, generator=g, dtype=torch.float64), -1).topk(k, -1)
    return {"logp": top.values, "ids": top.indices, "rest": 1 - top.values.exp().sum(-1)}


@pytest.mark.parametrize("B,lengths", [(4, (13, 7, 20)), (2, (9, 6)), (3, (16, 4, 10))])
@pytest.mark.parametrize("trim", [False, True])
@pytest.mark.parametrize("teacher,weighted,w", [(True, False, 1.0), (False, True, 1.0), (True, True, 0.5),
                                                (False, True, 0.0)])
def test_windowed_loss_with_a_teacher_and_row_weights_equals_the_textbook_loss(B, lengths, trim, teacher,
                                                                               weighted, w):
    """ar_target = "teacher" (L_AR the KL to a top-k teacher) and inv_t_weight (each row's L_mask
    times 1/t): the engine's loss and gradients are mars_loss's (float64); another teacher or
    other weights give another loss."""
    ids, labels = ragged_batch(B, lengths, seed=B)
    model = tiny_model(0, 2).double()
    engine = use_two_stream(copy.deepcopy(model))
    t = random_teacher(labels, model.config.vocab_size, 8, B) if teacher else None
    g = torch.Generator().manual_seed(B)
    weight = 1 / (0.01 + torch.rand(ids.shape[0], generator=g, dtype=torch.float64)) if weighted else None
    kw = dict(w=w, noisy_row_weight=weight, ar_teacher=t)
    ref = loss_and_grads(model, lambda: mars_loss(model, ids, labels, MASK, B, **kw))
    ours = loss_and_grads(engine, lambda: mars_loss_windowed(engine, ids, labels, MASK, B, trim=trim, **kw))
    assert_same(ours, ref, w)
    if teacher and w:
        shifted = {key: v.roll(1, 0) for key, v in t.items()}
        other = mars_loss_windowed(engine, ids, labels, MASK, B, **dict(kw, ar_teacher=shifted))
        assert not close(other[2].detach(), ref[2], 1e-6)
    if weighted:
        other = mars_loss_windowed(engine, ids, labels, MASK, B, **dict(kw, noisy_row_weight=weight.flip(0)))
        assert not close(other[1].detach(), ref[1], 1e-6)


def test_the_engine_is_applied_from_outside():
    """use_two_stream changes the classes of the model it is given and nothing else: the same
    parameter objects and state_dict keys, and with a tensor mask (the textbook mars_loss) the
    same numbers, bit for bit. A plain model refuses the windowed loss by name; the core's
    attention knows no two-stream mask."""
    ids, labels = ragged_batch(4, (13, 7, 20), seed=4)
    model = tiny_model(0, 2)
    params, keys = list(model.parameters()), list(model.state_dict())
    with torch.no_grad():
        ref = mars_loss(model, ids, labels, MASK, 4)
        with pytest.raises(TypeError, match="use_two_stream"):
            mars_loss_windowed(model, ids, labels, MASK, 4)
        engine = use_two_stream(model)
        assert engine is model and type(model).__name__ == "TwoStreamQwen2"
        assert all(type(m) is TwoStreamAttention for m in model.modules() if isinstance(m, Attention))
        assert all(a is b for a, b in zip(params, model.parameters())) and list(model.state_dict()) == keys
        ours = mars_loss(model, ids, labels, MASK, 4)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref) if not torch.isnan(b))
    _, _, mask, _ = two_stream_window(ids, labels, MASK, 4)
    with pytest.raises(AttributeError):
        build_mask(ids.shape[1], mask)  # model.py takes mask tensors only
    with pytest.raises(TypeError, match="model.Qwen2"):
        use_two_stream(torch.nn.Linear(2, 2))


def test_causal_without_mask_tensor_equals_tril_mask():
    model = tiny_model(0, 2, std=0.02)
    ids = torch.randint(0, 60, (3, 17), generator=torch.Generator().manual_seed(0))
    tril = torch.ones(17, 17, dtype=torch.bool).tril()
    grads = []
    for mask in (None, tril):
        model.zero_grad(set_to_none=True)
        h = model.hidden(ids, attn_mask=mask)
        h.square().sum().backward()
        grads.append((h.detach(), [p.grad.clone() for p in model.parameters()]))
    (h, g), (ref_h, ref_g) = grads
    assert close(h, ref_h)
    assert all(close(a, b) for a, b in zip(g, ref_g))


@pytest.mark.parametrize("lengths,T", [((5, 2, 9), 3), ((4, 4), 1), ((0, 3), 1), ((6, 6), 4)])
def test_cached_causal_mask_equals_explicit_causal_mask(lengths, T):
    cache = KVCache(1, len(lengths), 1, 8, 32)
    cache.lengths = torch.tensor(lengths)
    cache.begin(T)
    tril = torch.ones(T, T, dtype=torch.bool).tril()
    fast, general = build_mask(T, None, cache), build_mask(T, tril, cache)
    if fast is None:  # one new token, every row at the same length: it sees every key
        assert len(set(lengths)) == 1 and T == 1 and bool(general.all())
    else:
        assert torch.equal(fast, general)


def test_cached_forward_equals_uncached_uniform_and_ragged():
    """The cache's two write paths (a plain slice when all rows share a length, a scatter
    otherwise) give the uncached logits, one token at a time. The cached forward runs other
    matmul shapes, so in fp32 they differ by rounding (measured 3.6e-6); in float64 REL64 holds."""
    model = tiny_model(0, 2).to(torch.float64).eval()
    seqs = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(seqs)  # (2, 12, V)
        for first in ((4, 4), (3, 6)):  # uniform, ragged prefill lengths
            cache = model.new_cache(2, 16)
            T = max(first)
            model.hidden(seqs[:, :T], cache=cache)
            cache.commit(torch.tensor(first))
            for step in range(5):
                pos = torch.tensor(first) + step
                out = model(seqs[torch.arange(2), pos][:, None], cache=cache)[:, 0]  # (2, V)
                cache.commit(1)
                assert close(out, ref[torch.arange(2), pos], REL64)


# ------------------------------------------------ packed decoding weights (fast.linear, fast.make_fast)
# (that fast.make_fast keeps every name, value and the tie: tests/test_engine.py)
def test_packed_copy_is_read_when_decoding_only_and_while_the_weight_is_unchanged():
    """FastLinear.forward reads the packed copy under no_grad only, for at most packed_max_rows
    rows, and only while the weight is the one it was packed from. Shown with a copy packed from
    other values (zeros, under the weight's key): it gives the bias alone where it is read,
    F.linear's output where not."""
    torch.manual_seed(0)
    lin, x = FastLinear(16, 8), torch.randn(3, 16)
    pack(lin)
    assert lin.packed is not None
    key = lin.packed[0]
    lin.packed = (key, torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16), 8))
    with torch.no_grad():
        assert torch.equal(lin(x), lin.bias.expand(3, 8))  # decoding: the packed copy
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # gradients wanted: F.linear
    many = torch.randn(lin.packed_max_rows + 1, 16)  # more rows than a decoding step: F.linear
    with torch.no_grad():
        assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))
    with torch.no_grad():
        lin.weight.add_(0.5)  # an in-place change (an optimizer step): the copy is stale
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.weight.data = torch.randn(8, 16)  # a new tensor: stale too
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def decode_logits(model, seq, sizes):
    """Logits of seq (1, L) computed as decoding computes them: a prefill, then steps of
    `sizes` new tokens against the model's KV cache (the shapes of AR, τ-window and exact steps)."""
    cache = model.new_cache(1, seq.shape[1])
    out, at = [], seq.shape[1] - sum(sizes)
    with torch.no_grad():
        for T in [at, *sizes]:
            start = int(cache.lengths[0])
            out.append(model(seq[:, start:start + T], cache=cache))
            cache.commit(T)
    return torch.cat(out, 1)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_logits_equal_hf(tmp_path, tied):
    """The engine (fast.make_fast: packed weights, its cache): fp32 logits through the cache (a
    prefill, then steps of 1, 2, 5 and 9 new tokens: the shapes of AR, τ-window and exact steps)
    equal HF's float64 logits (conftest.hf_float64) to REL_PACKED relative, as the reference's
    fp32 logits do: oneDNN packs fp32 (not float64), so this proof is in fp32, and its bound is
    fp32 rounding with a margin. Every forward (<= 12 rows) reads the packed copies (checked)."""
    hf = make_hf_model(tmp_path, tie_word_embeddings=tied)
    sizes = [1, 2, 5, 9, 1]
    seq = torch.randint(0, 256, (1, 12 + sum(sizes)), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), hf_float64(hf):
        ref = hf(seq).logits
    assert 0.3 < ref.std().item() < 30  # a relative bound on logits of order 1
    reference = Qwen2.from_pretrained(str(tmp_path))
    assert close(decode_logits(reference, seq, sizes).double(), ref, REL_PACKED)
    model = fast.make_fast(Qwen2.from_pretrained(str(tmp_path)))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is FastLinear and m.packed is not None for m in linears)
    reads = []
    from_packed = fast.linear.from_packed

    def spy(packed, x, weight, bias):  # the packed matmul, when the copy is the weight's
        reads.append(packed is not None and packed[0] == fast.linear._weight_key(weight))
        return from_packed(packed, x, weight, bias)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fast.linear, "from_packed", spy)
        packed = decode_logits(model, seq, sizes).double()
    assert reads == [True] * 6 * len(linears)  # the prefill (12 rows) and 5 steps: every linear from its copy
    assert close(packed, ref, REL_PACKED)
