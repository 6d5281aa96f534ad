"""Proofs for fast/loss.py: the chunked linear + cross-entropy is F.cross_entropy on the full
logits, its loss and its gradients (float64, where rounding is not the question), with ignored
targets, chunk sizes that do and do not divide the rows, and an upstream gradient that weighs
each row differently (as mars.py's per-sequence mean does)."""

import pytest
import torch
import torch.nn.functional as F

from fast.loss import IGNORE, linear_cross_entropy


def case(n=37, C=12, V=50, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, C, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, C, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (n,), generator=g)
    t[::5] = IGNORE  # some rows carry no loss
    upstream = torch.rand(n, generator=g, dtype=dtype)  # per-row weights, as a per-sequence mean gives
    return h, w, t, upstream


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 64])  # 5 divides neither 37 nor ...; 37 = n; 64 > n
def test_chunked_loss_and_gradients_equal_full_cross_entropy(chunk):
    h, w, t, up = case()
    ref = F.cross_entropy(h @ w.T, t, reduction="none", ignore_index=IGNORE)
    gh, gw = torch.autograd.grad((ref * up).sum(), (h, w))
    ours = linear_cross_entropy(h, w, t, chunk)
    oh, ow = torch.autograd.grad((ours * up).sum(), (h, w))
    assert torch.allclose(ours, ref, atol=1e-12, rtol=0)
    assert torch.allclose(oh, gh, atol=1e-12, rtol=0)
    assert torch.allclose(ow, gw, atol=1e-12, rtol=0)
    assert (ours[t == IGNORE] == 0).all() and (oh[t == IGNORE] == 0).all()


def test_a_wrong_gradient_is_caught():
    """The comparison can fail: a gradient that forgets the one-hot differs from the reference."""
    h, w, t, up = case()
    ref = F.cross_entropy(h @ w.T, t, reduction="none", ignore_index=IGNORE)
    gh = torch.autograd.grad((ref * up).sum(), h)[0]
    wrong = torch.autograd.grad((torch.logsumexp(h @ w.T, -1) * (t != IGNORE) * up).sum(), h)[0]
    assert not torch.allclose(wrong, gh, atol=1e-6)


FP32_LOSS_ATOL = 1e-5  # measured: at most 1.4e-6 over seeds 0-19 (fp32 rounding of the matmul and lse)


def test_float32_rows_are_reduced_in_float32():
    h, w, t, _ = case(dtype=torch.float32)
    ours = linear_cross_entropy(h, w, t, 8)
    assert ours.dtype == torch.float32
    ref = F.cross_entropy((h @ w.T).double(), t, reduction="none", ignore_index=IGNORE)
    assert torch.allclose(ours.double(), ref, atol=FP32_LOSS_ATOL, rtol=0)


BF16_LOSS_ATOL = 2e-5  # measured: 3.8e-6 over seeds 0-9 (n 40, C 64, V 300)
BF16_GRAD_REL = 1e-5  # grad_h, relative to its largest entry: measured 1.1e-6; a backward that
#                       recomputes the logits in fp32 against the bf16 forward's logsumexp: ~5e-3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_under_bf16_autocast_the_backward_recomputes_the_forwards_logits(seed):
    """train.py runs the forward under autocast and .backward() outside it: the chunked loss and
    its gradient are autograd's through the same bf16 logits (F.cross_entropy on them)."""
    h, w, t, up = case(n=40, C=64, V=300, seed=seed, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = h @ w.T  # bf16
    ref = F.cross_entropy(logits.float(), t, reduction="none", ignore_index=IGNORE)
    gh = torch.autograd.grad((ref * up).sum(), h)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(h, w, t, 16)
    oh = torch.autograd.grad((ours * up).sum(), h)[0]  # outside autocast, as train.py
    assert (ours - ref).abs().max() <= BF16_LOSS_ATOL
    assert (oh - gh).abs().max() <= BF16_GRAD_REL * gh.abs().max()


# ---------------------------------------------------------------- L_AR = KL(teacher || model), chunked
def teacher_rows(n, k, V, seed):
    """A teacher's top k and rest mass per row (float64), a row with r = 0 (k = V would give it,
    here its rest mass is dropped) and a row of repeated ids with p 1, 0, .. (an EOS pad's, as
    data.batches.make_teacher writes it)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(2 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    top = logp.topk(k, -1)
    t_logp, t_ids, t_rest = top.values.clone(), top.indices.clone(), 1 - top.values.exp().sum(-1)
    t_rest[1] = 0.0
    t_logp[2], t_ids[2], t_rest[2] = torch.full((k,), float("-inf")), torch.full((k,), 3), 0.0
    t_logp[2, 0] = 0.0
    return t_logp, t_ids, t_rest


@pytest.mark.parametrize("chunk", [1, 3, 5, 1024])
@pytest.mark.parametrize("k", [8, 64])
def test_chunked_teacher_kl_is_teacher_kl_with_its_gradients(chunk, k):
    """linear_teacher_kl = mars.teacher_kl on the head's logits, per row, and autograd's
    gradients through it for h and the weight (float64), with rows carrying no target (keep
    False: 0, no gradient), chunks that do and do not divide the 7 rows, r = 0 and repeated ids."""
    from fast.loss import linear_teacher_kl
    from mars import teacher_kl

    n, C, V = 7, 16, 96
    g = torch.Generator().manual_seed(k + chunk)
    h0 = torch.randn(n, C, generator=g, dtype=torch.float64)
    w0 = torch.randn(V, C, generator=g, dtype=torch.float64)
    t_logp, t_ids, t_rest = teacher_rows(n, k, V, seed=k)
    keep = torch.tensor([True, True, True, False, True, True, False])
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    want = torch.where(keep, teacher_kl(h @ w.T, t_logp, t_ids, t_rest), 0)
    (want * torch.arange(1, n + 1)).sum().backward()  # unequal weights: each row's gradient counts
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    got = linear_teacher_kl(h2, w2, t_logp, t_ids, t_rest, keep, chunk)
    (got * torch.arange(1, n + 1)).sum().backward()
    assert torch.allclose(got, want.detach(), rtol=1e-12, atol=1e-14)
    assert torch.allclose(h2.grad, h.grad, rtol=1e-10, atol=1e-13)
    assert torch.allclose(w2.grad, w.grad, rtol=1e-10, atol=1e-13)
    assert (got[~keep] == 0).all() and (h2.grad[~keep] == 0).all()
    assert (want[keep] > 0).all()  # every kept row has a real KL to match
