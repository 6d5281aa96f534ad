"""Proofs for fast/flex.py: the two-stream mask_mod is mars_attention_mask's rule on every
(query, key) pair of the rows training runs (two_stream_window, trimmed or not, several B and
lengths, bidirectional too); its BlockMask skips no tile holding an allowed pair; flex_attention
over it equals model.attend with the dense mask, in float64 (forward only: on the CPU flex has
no backward)."""

import pytest
import torch

from fast.flex import flex_attend, two_stream_block_mask, two_stream_mask_mod
from mars import IGNORE, mars_attention_mask, two_stream_window
from model import attend, build_mask


def rows_of(lengths, prompt, l):
    """ids and labels (N, l) of rows with the given reply lengths after `prompt` prompt tokens."""
    N = len(lengths)
    ids = torch.arange(N * l).reshape(N, l) % 20 + 1
    labels = torch.full((N, l), IGNORE)
    for r, n in enumerate(lengths):
        labels[r, prompt:prompt + n] = ids[r, prompt:prompt + n]
    return ids, labels


def dense(l, B, start, W, bidirectional):
    """The two_stream_window mask written from mars_attention_mask: rows and columns of the
    clean stream and of each row's kept noisy positions."""
    full = mars_attention_mask(l, B, bidirectional)
    out = []
    for s in start.tolist():
        keep = torch.cat([torch.arange(l), l + s + torch.arange(W)])
        out.append(full[keep][:, keep])
    return torch.stack(out)  # (N, l + W, l + W)


CASES = [(2, [3, 5], 2, 12), (4, [9, 1], 4, 24), (4, [16, 7, 2], 8, 32), (3, [4], 0, 9)]


@pytest.mark.parametrize("B, lengths, prompt, l", CASES)
@pytest.mark.parametrize("trim", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_mask_mod_is_the_two_stream_mask_on_every_pair(B, lengths, prompt, l, trim, bidirectional):
    ids, labels = rows_of(lengths, prompt, l)
    inputs, _, mask, start = two_stream_window(ids, labels, 15, B, bidirectional, trim)
    T = inputs.shape[1]
    W = T - l
    q, kv = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mod = two_stream_mask_mod(l, B, start, bidirectional)
    got = torch.stack([mod(torch.tensor(b), 0, q, kv) for b in range(len(lengths))])
    want = dense(l, B, start, W, bidirectional)
    assert torch.equal(got, want)
    rows = mask.rows if mask.rows.dim() == 3 else mask.rows.expand(len(lengths), -1, -1)
    assert torch.equal(got[:, l:], rows)  # the noisy rows attention is handed today


@pytest.mark.parametrize("B, lengths, prompt, l", CASES)
def test_no_allowed_pair_falls_in_a_skipped_block(B, lengths, prompt, l):
    ids, labels = rows_of(lengths, prompt, l)
    inputs, _, _, start = two_stream_window(ids, labels, 15, B)
    T = inputs.shape[1]
    bm = two_stream_block_mask(l, T - l, B, start, tile=8)
    kept = bm.to_dense()[:, 0].repeat_interleave(8, 1).repeat_interleave(8, 2)[:, :T, :T].bool()
    want = dense(l, B, start, T - l, False)
    assert not (want & ~kept).any()
    assert (~kept).any() or T <= 8  # and something is skipped, else the test proves nothing


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_dense_attention_in_float64():
    B, l = 4, 32
    ids, labels = rows_of([13, 6], 5, l)
    inputs, _, mask, start = two_stream_window(ids, labels, 15, B)
    N, T = inputs.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, 4, T, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(N, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = attend(q, k, v, build_mask(T, mask), 8 ** -0.5)
    ours = flex_attend(q, k, v, two_stream_block_mask(l, T - l, B, start, tile=8), 8 ** -0.5)
    assert torch.allclose(ours, ref, atol=1e-12, rtol=0)
    wrong = flex_attend(q, k, v, two_stream_block_mask(l, T - l, B + 1, start, tile=8), 8 ** -0.5)
    assert not torch.allclose(wrong, ref, atol=1e-6)  # another B's mask differs: the test can fail
