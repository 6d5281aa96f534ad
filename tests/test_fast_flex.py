"""Proofs for fast/flex.py: the two-stream mask_mod is mars_attention_mask's rule on every
(query, key) pair of the rows training runs (fast.window.two_stream_window, trimmed or not,
several B and lengths, bidirectional too); its BlockMask skips no tile holding an allowed pair;
flex_attention over it equals model.attend with the dense mask, in float64 (forward only: on the
CPU flex has no backward)."""

import pytest
import torch

from fast.flex import flex_attend, two_stream_block_mask, two_stream_mask_mod
from fast.window import two_stream_window
from mars import IGNORE, mars_attention_mask
from model import attend


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
    inputs, _, _, start = two_stream_window(ids, labels, 15, B)
    N, T = inputs.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, 4, T, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(N, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = attend(q, k, v, dense(l, B, start, T - l, False)[:, None], 8 ** -0.5)  # the rule's dense mask
    ours = flex_attend(q, k, v, two_stream_block_mask(l, T - l, B, start, tile=8), 8 ** -0.5)
    assert torch.allclose(ours, ref, atol=1e-12, rtol=0)
    wrong = flex_attend(q, k, v, two_stream_block_mask(l, T - l, B + 1, start, tile=8), 8 ** -0.5)
    assert not torch.allclose(wrong, ref, atol=1e-6)  # another B's mask differs: the test can fail


# ---------------------------------------------------------------- flex in the training step
def dense_flex(q, k, v, block_mask, scale):
    """flex_attend with its BlockMask replaced by the dense mask of its own mask_mod (every pair
    evaluated): model.attend on that, which has a backward on the CPU."""
    N, T = q.shape[0], q.shape[2]
    b, i, j = torch.arange(N)[:, None, None], torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
    allowed = block_mask.mask_mod(b, 0, i, j)  # (N, T, T)
    return attend(q, k, v, allowed[:, None], scale)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("B, lengths, bidirectional", [(4, (13, 7, 20), False), (2, (9, 6), True),
                                                      (3, (16, 4, 10), False)])
def test_the_static_step_with_flex_is_the_reference_step(monkeypatch, B, lengths, bidirectional):
    """fast.train.mars_loss_static(flex=True) on a model whose attention use_flex swapped: with the
    real flex_attention (forward; the CPU has no flex backward) its loss is mars.mars_loss's, and
    with flex replaced by its dense mask its loss and every gradient are (float64); a model made
    by fast.window.use_two_stream alone reads the FlexMask's dense rows, the same loss. A block
    mask of the other rule (causal and bidirectional swapped) gives another loss: the check sees
    the mask."""
    import copy

    from test_fast_paths import MASK, PAD, REL64, close, loss_and_grads, ragged_batch, tiny_model

    import fast.flex
    from fast.flex import use_flex
    from fast.train import mars_loss_static, static_batch
    from fast.window import use_two_stream
    from mars import mars_loss

    ids, labels = ragged_batch(B, lengths, seed=B)
    model = tiny_model(0, 2).double()
    ref = loss_and_grads(model, lambda: mars_loss(model, ids, labels, MASK, B, 1.0, bidirectional))
    x, y, window = static_batch(ids, labels, PAD, B, 16)
    flexed = use_flex(copy.deepcopy(model))
    model = use_two_stream(model)
    assert {type(m).__name__ for m in flexed.modules()} >= {"FlexTwoStreamAttention"}
    with torch.no_grad():  # the real flex_attention
        real = mars_loss_static(flexed, x, y, window, MASK, B, 1.0, bidirectional, flex=True)[0]
        plain = mars_loss_static(model, x, y, window, MASK, B, 1.0, bidirectional, flex=True)[0]
    assert close(real, ref[0], REL64) and close(plain, ref[0], REL64)
    swapped = fast.flex.two_stream_block_mask
    monkeypatch.setattr(fast.flex, "two_stream_block_mask", lambda *a: swapped(*a[:4], not bidirectional))
    with torch.no_grad():
        wrong = mars_loss_static(flexed, x, y, window, MASK, B, 1.0, bidirectional, flex=True)[0]
    assert not close(wrong, ref[0], 1e-6)
    monkeypatch.setattr(fast.flex, "two_stream_block_mask", swapped)
    monkeypatch.setattr(fast.flex, "flex_attend", dense_flex)
    ours = loss_and_grads(flexed, lambda: mars_loss_static(flexed, x, y, window, MASK, B, 1.0, bidirectional,
                                                           flex=True))
    for a, b in zip(ours[:3], ref[:3]):
        assert close(a, b, REL64)
    for k in ref[3]:
        assert close(ours[3][k], ref[3][k], REL64), k
    calls = []
    monkeypatch.setattr(fast.flex, "flex_attend", lambda *a: calls.append(1) or dense_flex(*a))
    with torch.no_grad():
        mars_loss_static(flexed, x, y, window, MASK, B, 1.0, bidirectional, flex=True)
    assert len(calls) == flexed.config.num_hidden_layers  # every layer ran flex, none the dense path


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_static_step_with_flex_compiles_whole(fresh_dynamo):
    """fullgraph=True (aot_eager: dynamo's graph, no inductor) over the static loss with the
    BlockMask made inside it: no graph break, and the loss is the eager one."""
    from test_fast_paths import MASK, PAD, ragged_batch, tiny_model

    from fast.flex import use_flex
    from fast.train import mars_loss_static, static_batch

    ids, labels = ragged_batch(4, (13, 7, 20), seed=4)
    model = use_flex(tiny_model(0, 2).double())
    x, y, window = static_batch(ids, labels, PAD, 4, 16)
    step = torch.compile(mars_loss_static, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        got = step(model, x, y, window, MASK, 4, flex=True)[0]
        want = mars_loss_static(model, x, y, window, MASK, 4, flex=True)[0]
    assert torch.equal(got, want)


def test_train_py_refuses_flex_on_the_cpu_and_writes_nothing(data_dir, tmp_path):
    from train_run import args

    import train

    out = tmp_path / "flex"
    with pytest.raises(SystemExit, match="flex_attention=true needs CUDA"):
        train.main(args(data_dir, out, "--compile=true", "--flex_attention=true", "--device=cpu"))
    assert not out.exists()
