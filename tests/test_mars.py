"""Proofs for mars.py (docs/spec.md §2-§4). The references are independent of the code
under test: the spec's rules written out as Python loops, and Hugging Face
transformers' Qwen2 run on plain causal inputs (one separate pass per block / target)."""

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_float64, make_hf_model

from mars import (
    ar_loss,
    collate,
    inverse_t_weights,
    mars_attention_mask,
    mars_loss,
    noisy_stream,
    pad_row,
    two_stream_batch,
)
from model import Qwen2

MASK, EOS, PAD = 255, 254, 253  # special ids inside the tiny model's 256-token vocab
TOL = 1e-5  # fp32 losses against HF (measured <= 4.8e-7: a 21x margin)
TOL64 = 1e-10  # float64 logits and losses against HF, both sides float64 (conftest.hf_float64)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(hf, ours): the same random tiny Qwen2 in transformers and in model.py, fp32."""
    path = tmp_path_factory.mktemp("tiny")
    hf = make_hf_model(path, seed=0)
    return hf, Qwen2.from_pretrained(str(path)).eval()


@pytest.fixture(scope="module")
def models64(tmp_path_factory):
    """The same pair in float64, for the proofs of "the same computation" (run HF inside
    conftest.hf_float64). Ours is loaded with dtype=float64: RoPE tables in fp32, as HF's."""
    path = tmp_path_factory.mktemp("tiny64")
    hf = make_hf_model(path, seed=0)
    return hf.double(), Qwen2.from_pretrained(str(path), dtype=torch.float64).eval()


def make_row(n_prompt, n_response, seed):
    """(ids, loss_mask) of a row: real prompt tokens, then loss-carrying response tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (n_prompt + n_response,), generator=g).tolist()
    return ids, [False] * n_prompt + [True] * n_response


def make_batch(block_size, shapes=((5, 6), (3, 2))):
    """Rows with a prompt and a response whose lengths (11, 5) are not multiples of B,
    EOS-padded by pad_row and right-padded by collate."""
    rows = [pad_row(*make_row(p, r, seed), block_size, EOS) for seed, (p, r) in enumerate(shapes)]
    return collate(rows, PAD)


def masked_by_rule(ids, labels):
    """§3 written out: a copy of (N, l) ids with <|mask|> wherever a label carries loss."""
    out = ids.clone()
    for r in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            if labels[r, i] != -100:
                out[r, i] = MASK
    return out


def hf_logits(hf, ids, mask4d=None):
    """HF logits (T, V) of one plain 1-D input; mask4d: optional additive (1, 1, T, T)."""
    with torch.no_grad():
        return hf(ids[None], attention_mask=mask4d).logits[0]


# ----------------------------------------------------------------------------- §3 mask
def brute_force_mask(l, B, bidirectional=False):
    """The four cases of §3, written out over every (query, key) pair."""
    m = torch.zeros(2 * l, 2 * l, dtype=torch.bool)
    for q in range(2 * l):
        for k in range(2 * l):
            q_noisy, k_noisy = q >= l, k >= l
            pos_q, pos_k = q % l, k % l
            blk_q, blk_k = pos_q // B, pos_k // B
            if not q_noisy and not k_noisy:
                m[q, k] = pos_k <= pos_q
            elif q_noisy and k_noisy:
                m[q, k] = blk_k == blk_q and (bidirectional or pos_k <= pos_q)
            elif q_noisy and not k_noisy:
                m[q, k] = blk_k < blk_q
            else:  # clean query, noisy key
                m[q, k] = False
    return m


@pytest.mark.parametrize("l,B", [(8, 4), (12, 4), (6, 2), (16, 8), (5, 1), (4, 4), (1, 1), (9, 3)])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_mask_equals_rule_written_out(l, B, bidirectional):
    assert torch.equal(mars_attention_mask(l, B, bidirectional), brute_force_mask(l, B, bidirectional))


def test_mask_drawing_in_docstring_is_the_mask():
    rows = re.findall(r"^\s*(?:clean|noisy)?\s*\d\s+([x.](?: [x.]){3})\s+([x.](?: [x.]){3})",
                      mars_attention_mask.__doc__, flags=re.M)
    drawn = torch.tensor([[c == "x" for c in (a + b).replace(" ", "")] for a, b in rows])
    assert torch.equal(drawn, mars_attention_mask(4, 2))


# ----------------------------------------------------------------------------- §2 data layout
def test_pad_row_pads_with_loss_carrying_eos_at_the_end():
    ids, labels = pad_row([10, 11, 12, 13, 14], [False, False, True, True, True], 4, EOS)
    assert ids == [10, 11, 12, 13, 14, EOS, EOS, EOS]  # row kept from index 0, pads after
    assert labels == [-100, -100, 12, 13, 14, EOS, EOS, EOS]


def test_pad_row_multiple_of_block_is_unchanged_and_blocks_anchor_at_index_0():
    ids, labels = pad_row([1, 2, 3, 4, 5, 6, 7, 8], [False] * 6 + [True] * 2, 4, EOS)
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert labels == [-100] * 6 + [7, 8]
    # 6 prompt tokens, B = 4: nothing shifts the response to a block start, so the
    # first response block (indices 4..7) is half prompt
    assert labels[4:8] == [-100, -100, 7, 8]


def test_collate_right_pads_with_pad_id_and_no_loss():
    ids, labels = collate([([1, 2, 3, 4], [-100, 2, 3, 4]), ([5, 6], [-100, 6])], PAD)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, PAD, PAD]]
    assert labels.tolist() == [[-100, 2, 3, 4], [-100, 6, -100, -100]]
    assert ids.dtype == labels.dtype == torch.long


def test_noisy_stream_masks_exactly_the_loss_positions():
    ids, labels = make_batch(4)
    assert torch.equal(noisy_stream(ids, labels, MASK), masked_by_rule(ids, labels))
    assert (ids == EOS).any() and (ids == PAD).any()  # EOS pads get masked, batch pads do not


def test_two_stream_batch_layout():
    ids, labels = make_batch(4)
    inputs, pos = two_stream_batch(ids, labels, MASK)
    l = ids.shape[1]
    assert torch.equal(inputs[:, :l], ids)
    assert torch.equal(inputs[:, l:], masked_by_rule(ids, labels))
    assert pos.tolist() == [list(range(l)) * 2] * ids.shape[0]


def test_mars_loss_is_one_forward_over_both_streams_with_the_full_mask(models):
    """The textbook forward of §3, what a student steps through: mars_loss calls model.hidden
    once, on [clean | noisy] (N, 2l) with position ids 0..l-1 in each stream and the (2l, 2l)
    mask of the rule written out, as a tensor."""
    _, ours = models
    ids, labels = make_batch(4)
    calls, hidden = [], ours.hidden
    with pytest.MonkeyPatch.context() as m, torch.no_grad():
        m.setattr(ours, "hidden", lambda *a: calls.append(a) or hidden(*a))
        mars_loss(ours, ids, labels, MASK, 4)
    [(inputs, pos, mask)] = calls
    want_inputs, want_pos = two_stream_batch(ids, labels, MASK)
    assert torch.equal(inputs, want_inputs) and torch.equal(pos, want_pos)
    assert torch.equal(mask, brute_force_mask(ids.shape[1], 4))


# ----------------------------------------------------------------------------- §3 one pass = many passes
def two_stream_logits(model, ids, labels, B, bidirectional=False):
    """Full logits (N, 2l, V) of the MARS forward, built only from mars.py's pieces."""
    inputs, pos = two_stream_batch(ids, labels, MASK)
    with torch.no_grad():
        return model(inputs, pos, mars_attention_mask(ids.shape[1], B, bidirectional))


@pytest.mark.parametrize("B", [2, 4, 5])
def test_two_streams_equal_separate_plain_passes(models64, B):
    """Noisy block k == HF on [clean x_<kB, masked block k]; clean == HF on the clean row.
    float64 (measured <= 1e-14; in fp32 the op orders differ by up to 2.9e-6)."""
    hf, ours = models64
    ids, labels = make_batch(B)
    noisy = masked_by_rule(ids, labels)
    N, l = ids.shape
    logits = two_stream_logits(ours, ids, labels, B)
    with hf_float64(hf):
        for r in range(N):
            assert (logits[r, :l] - hf_logits(hf, ids[r])).abs().max() <= TOL64
            for k in range(l // B):
                ref_in = torch.cat([ids[r, :k * B], noisy[r, k * B:(k + 1) * B]])
                ref = hf_logits(hf, ref_in)[k * B:]
                assert (logits[r, l + k * B:l + (k + 1) * B] - ref).abs().max() <= TOL64, (r, k)


# ----------------------------------------------------------------------------- §4 loss
def hf_row_ar_losses(hf, ids, labels):
    """HF's own causal-LM loss (it shifts internally), one row at a time."""
    with torch.no_grad():
        return [hf(ids[r:r + 1], labels=labels[r:r + 1]).loss for r in range(ids.shape[0])]


def brute_force_l_mask(hf, ids, labels, B, row_weight=None):
    """For each loss target t: HF on [clean x_<kB, masked x_kB..x_{t-1}] (k = block of
    t-1), CE of x_t at the last output; mean per row (times row_weight[r] if given),
    then over the rows."""
    noisy = masked_by_rule(ids, labels)
    per_row = []
    for r in range(ids.shape[0]):
        ces = []
        for t in range(1, ids.shape[1]):
            if labels[r, t] == -100:
                continue
            k = (t - 1) // B
            ref_in = torch.cat([ids[r, :k * B], noisy[r, k * B:t]])
            last = hf_logits(hf, ref_in)[-1]
            ces.append(F.cross_entropy(last[None], labels[r, t:t + 1]))
        per_row.append(torch.stack(ces).mean() * (1 if row_weight is None else row_weight[r]))
    return torch.stack(per_row).mean()


@pytest.mark.parametrize("B", [2, 4])
def test_loss_parts_equal_hf_references(models, B):
    hf, ours = models
    ids, labels = make_batch(B)
    with torch.no_grad():
        loss, l_mask, l_ar = mars_loss(ours, ids, labels, MASK, B, w=1.0)
        plain = ar_loss(ours, ids, labels)
    hf_ar = torch.stack(hf_row_ar_losses(hf, ids, labels)).mean()
    assert abs(l_ar - hf_ar) <= TOL
    assert abs(plain - hf_ar) <= TOL
    assert abs(l_mask - brute_force_l_mask(hf, ids, labels, B)) <= TOL
    assert abs(loss - (l_mask + l_ar)) <= TOL


def test_batch_loss_is_mean_of_rows_alone_and_ignores_padding(models):
    """Per-sequence normalisation, no leakage across rows, batch padding is inert."""
    _, ours = models
    B = 4
    ids, labels = make_batch(B)  # row 1 (length 8) is batch-padded to 12
    with torch.no_grad():
        batch = mars_loss(ours, ids, labels, MASK, B)
        # each row alone (same seeds as make_batch), row 1 without batch padding
        rows = [pad_row(*make_row(5, 6, 0), B, EOS), pad_row(*make_row(3, 2, 1), B, EOS)]
        alone = [mars_loss(ours, *collate([row], PAD), MASK, B) for row in rows]
        scrambled = ids.clone()
        scrambled[1, 8:] = torch.tensor([7, 99, 3, 42])  # other tokens in the batch padding
        after = mars_loss(ours, scrambled, labels, MASK, B)
    for part in range(3):
        assert abs(batch[part] - (alone[0][part] + alone[1][part]) / 2) <= TOL
        assert batch[part] == after[part]


def test_row_without_loss_tokens_is_skipped(models):
    _, ours = models
    B = 4
    with_loss = pad_row(*make_row(5, 6, 0), B, EOS)
    no_loss = ([1, 2, 3, 4], [-100] * 4)
    with torch.no_grad():
        both = mars_loss(ours, *collate([with_loss, no_loss], PAD), MASK, B)
        alone = mars_loss(ours, *collate([with_loss], PAD), MASK, B)
        empty = mars_loss(ours, *collate([no_loss], PAD), MASK, B)
    for part in range(3):
        assert abs(both[part] - alone[part]) <= TOL
        assert empty[part] == 0
    assert torch.isfinite(both[0])


def grad_of_output(module, loss_fn, model):
    """d loss / d (output of `module`), captured with hooks; parameter grads are cleared."""
    grads = []

    def keep_grad(mod, inp, out):
        out.register_hook(grads.append)

    handle = module.register_forward_hook(keep_grad)
    try:
        loss_fn().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return grads[0]


@pytest.mark.parametrize("w", [1.0, 0.0])
def test_only_outputs_before_loss_targets_receive_gradient(models, w):
    """Prompt and padding outputs carry no loss: d loss / d hidden is non-zero exactly at
    output i-1 of every loss target i (noisy stream; clean stream too when w > 0)."""
    _, ours = models
    B = 4
    ids, labels = make_batch(B)
    N, l = ids.shape
    grad_h = grad_of_output(ours.model.norm, lambda: mars_loss(ours, ids, labels, MASK, B, w=w)[0], ours)
    carries = grad_h.abs().amax(-1) > 0  # (N, 2l)
    want = torch.zeros(N, 2 * l, dtype=torch.bool)
    for r in range(N):
        for i in range(1, l):
            if labels[r, i] != -100:
                want[r, l + i - 1] = True
                want[r, i - 1] = w > 0
    assert torch.equal(carries, want)


def test_batch_padding_tokens_get_no_gradient(models):
    _, ours = models
    B = 4
    ids, labels = make_batch(B)
    grad_e = grad_of_output(ours.model.embed_tokens, lambda: mars_loss(ours, ids, labels, MASK, B)[0], ours)
    pad = (ids == PAD).repeat(1, 2)  # (N, 2l): the batch padding of both streams
    assert pad.any()
    assert grad_e[pad].abs().max() == 0
    assert grad_e[~pad].abs().max() > 0  # the hook did see the loss's gradient


# ----------------------------------------------------------------------------- §4 ablations
def test_without_l_ar_loss_is_l_mask(models):
    _, ours = models
    B = 4
    ids, labels = make_batch(B)
    with torch.no_grad():
        full = mars_loss(ours, ids, labels, MASK, B, w=1.0)
        half = mars_loss(ours, ids, labels, MASK, B, w=0.5)
        none = mars_loss(ours, ids, labels, MASK, B, w=0.0)
    assert none[0] == none[1] == full[1]
    assert torch.isnan(none[2])
    assert abs(half[0] - (full[1] + 0.5 * full[2])) <= TOL


def test_inverse_t_weights_follow_the_released_rule():
    """1/t with t = 1e-3 + (1 - 1e-3) u, u ~ U[0, 1) per row (§4): the same draw of u gives
    the same weights, and a million draws have the law's range and mean."""
    u = torch.rand(5, generator=torch.Generator().manual_seed(3))
    want = 1 / (1e-3 + (1 - 1e-3) * u.double())
    got = inverse_t_weights(5, torch.Generator().manual_seed(3)).double()
    assert torch.allclose(got, want, rtol=1e-6, atol=0)  # fp32 rounding of one affine map and a division
    many = inverse_t_weights(10**6, torch.Generator().manual_seed(4)).double()
    assert many.min() >= 1 and many.max() <= 1000 * (1 + 1e-6)
    # E[1/t] = ln(1000) / 0.999 = 6.9147; sd of 1/t is ~31, so of the mean of 1e6 draws ~0.031
    assert abs(many.mean() - torch.log(torch.tensor(1000.0)) / 0.999) < 0.2
    # P(1/t > 100) = P(t < 0.01) = 0.009 / 0.999; sd of the fraction ~1e-4
    assert abs((many > 100).double().mean() - 0.009 / 0.999) < 1e-3


@pytest.mark.parametrize("w", [0.0, 1.0])
def test_inverse_t_weighted_loss_is_the_rule_written_out_on_hf(models64, w):
    """noisy_row_weight multiplies each row's noisy mean (HF, one pass per target) before
    the batch average; the clean part is untouched. float64, where rounding is not the question."""
    hf64, ours64 = models64
    B = 4
    ids, labels = make_batch(B)
    weight = inverse_t_weights(ids.shape[0], torch.Generator().manual_seed(1)).double()
    with torch.no_grad():
        loss, l_mask, l_ar = mars_loss(ours64, ids, labels, MASK, B, w=w, noisy_row_weight=weight)
        plain = mars_loss(ours64, ids, labels, MASK, B, w=1.0)
    assert l_mask.dtype == torch.float64
    with hf_float64(hf64):  # HF's fp32 RMSNorm and softmax would put 1e-8 of rounding here
        want = brute_force_l_mask(hf64, ids, labels, B, weight)
    assert abs(l_mask - want) <= 1e-12 * want
    assert abs(loss - (l_mask + (w * plain[2] if w else 0))) <= 1e-12
    assert abs(l_mask - plain[1]) > 0.1  # the weights (1.32 and 3.57 here) do change the loss


def block_diffusion_mask(prefix, B):
    """Additive HF mask (1, 1, T, T) for [clean prefix | block]: the prefix causal, the
    block sees the whole prefix and the whole block (bidirectional)."""
    T = prefix + B
    allow = torch.ones(T, T, dtype=torch.bool).tril()
    allow[prefix:, prefix:] = True
    return torch.where(allow, 0.0, torch.finfo(torch.float32).min)[None, None]


def test_bidirectional_changes_only_noisy_logits_and_equals_block_diffusion_passes(models64):
    """float64 (measured <= 1e-14 against HF; in fp32 up to 3.2e-6)."""
    hf, ours = models64
    B = 4
    ids, labels = make_batch(B)
    noisy = masked_by_rule(ids, labels)
    N, l = ids.shape
    causal = two_stream_logits(ours, ids, labels, B)
    bidir = two_stream_logits(ours, ids, labels, B, bidirectional=True)
    assert (bidir[:, :l] - causal[:, :l]).abs().max() <= TOL64  # clean stream untouched
    assert (bidir[:, l:] - causal[:, l:]).abs().max() > 1e-2
    with hf_float64(hf):
        for r in range(N):
            for k in range(l // B):
                ref_in = torch.cat([ids[r, :k * B], noisy[r, k * B:(k + 1) * B]])
                ref = hf_logits(hf, ref_in, block_diffusion_mask(k * B, B))[k * B:]
                assert (bidir[r, l + k * B:l + (k + 1) * B] - ref).abs().max() <= TOL64, (r, k)
    with torch.no_grad():
        l_ar_causal = mars_loss(ours, ids, labels, MASK, B)[2]
        l_ar_bidir = mars_loss(ours, ids, labels, MASK, B, bidirectional=True)[2]
    assert abs(l_ar_bidir - l_ar_causal) <= TOL64
