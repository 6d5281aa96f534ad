"""Linear + cross-entropy that never stores the logits (issue 50; Liger-Kernel's fused linear
cross-entropy, Cut Cross-Entropy, arXiv 2411.09009, do the same on a GPU).

mars.py's loss applies the LM head to the n loss-carrying hidden states and takes the cross
entropy in float32: on Qwen2.5 (V = 151,936) at 4 x 1,024 targets the fp32 logits alone are
2.3 GiB, and autograd keeps them (or their log-probabilities) for the backward. `linear_cross_entropy`
computes the same per-target losses over row chunks: each chunk's logits live only inside the
chunk; the forward keeps the logsumexp of each row (n floats), and the backward recomputes each
chunk's logits once more to form softmax - one-hot. The price: the head's matmul runs twice in
the forward direction. Proven equal to F.cross_entropy (float64), its gradients included, with
ignored targets and chunk sizes that do and do not divide the rows (tests/test_fast_loss.py).

`linear_teacher_kl` does the same for L_AR = KL(teacher || model) (mars.teacher_kl, the teacher
given by its top k and rest mass): the forward keeps two logsumexps a row (of all logits, and of
those outside the teacher's top k), the backward forms q - t chunk by chunk (t = p on the top k,
r exp(z - lse_out) off it), proven equal to mars.teacher_kl and its autograd (float64).
"""

import torch

from mars import IGNORE  # a target that carries no loss (its loss and gradient are 0)


def _forward_dtype(h):
    """The dtype the head's matmul runs in: autocast's where it is on, else h's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def _head_backward(ctx, h, weight, wide, logits_grad):
    """The backward of a chunked head: for each chunk c of rows, its logits recomputed (the
    forward's) and logits_grad(c, logits) -> d loss / d logits (c, V), pushed through the matmul
    in the forward's dtype, as autograd would -> grad_h, grad_weight (each None where not needed)."""
    grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
    grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) if ctx.needs_input_grad[1] else None
    for i in range(0, h.shape[0], ctx.chunk):
        c = slice(i, i + ctx.chunk)
        g = logits_grad(c, _chunk_logits(h[c], weight, ctx.dtype))
        if grad_h is not None:
            grad_h[c] = (g.to(ctx.dtype) @ weight.to(ctx.dtype)).to(h.dtype)
        if grad_w is not None:
            grad_w += g.T @ h[c].to(g.dtype)
    return grad_h, None if grad_w is None else grad_w.to(weight.dtype)


def _chunk_logits(h, weight, dtype):
    """Logits of a row chunk computed in `dtype` (the forward's: autocast's, else h's), then
    float32 (float64 stays float64), as mars._ce_at promotes them. Autocast is off inside, so
    the backward, which runs outside autocast, recomputes the very logits the forward had."""
    with torch.autocast(h.device.type, enabled=False):
        logits = h.to(dtype) @ weight.to(dtype).T
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class LinearCrossEntropy(torch.autograd.Function):
    """Per-row CE of (h @ weight.T) against targets, chunk rows at a time (see the module)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk):
        dtype = _forward_dtype(h)
        n = h.shape[0]
        loss = h.new_zeros(n, dtype=torch.promote_types(dtype, torch.float32))
        lse = torch.empty_like(loss)
        for i in range(0, n, chunk):
            logits = _chunk_logits(h[i:i + chunk], weight, dtype)  # (c, V)
            t = targets[i:i + chunk]
            keep = t != IGNORE
            lse[i:i + chunk] = torch.logsumexp(logits, -1)
            picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
            loss[i:i + chunk] = torch.where(keep, lse[i:i + chunk] - picked, torch.zeros_like(picked))
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, targets, lse = ctx.saved_tensors

        def logits_grad(c, logits):  # softmax - one-hot, times the upstream gradient
            t, probs = targets[c], (logits - lse[c, None]).exp()  # the softmax, (c, V)
            keep = t != IGNORE
            # a scatter, not boolean indexing: static shapes
            probs.scatter_add_(1, t.clamp(min=0)[:, None], -keep[:, None].to(probs.dtype))
            return probs * torch.where(keep, grad_loss[c], 0)[:, None]

        return *_head_backward(ctx, h, weight, lse.dtype, logits_grad), None, None


def linear_cross_entropy(h, weight, targets, chunk=1024):
    """F.cross_entropy(h @ weight.T, targets, reduction="none", ignore_index=-100) in float32 (or
    wider), never holding more than `chunk` rows of logits: h (n, C), weight (V, C), targets (n,)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return LinearCrossEntropy.apply(h, weight, targets, chunk)


class LinearTeacherKL(torch.autograd.Function):
    """Per-row mars.teacher_kl of (h @ weight.T) against the teacher (p over its top-k ids,
    rest mass r), chunk rows at a time; rows with keep False give 0 and no gradient."""

    @staticmethod
    def forward(ctx, h, weight, t_logp, t_ids, t_rest, keep, chunk):
        dtype = _forward_dtype(h)
        n, wide = h.shape[0], torch.promote_types(dtype, torch.float32)
        p, r = t_logp.to(wide).exp(), t_rest.to(wide)  # mars.teacher_kl's normalisation of k + 1 masses
        if t_ids.shape[1] >= weight.shape[0]:  # k = V: nothing outside the top k
            r = torch.zeros_like(r)
        total = p.sum(1) + r
        p, r, ids = p / total[:, None], r / total, t_ids.long()
        kl, lse, lse_out = (h.new_zeros(n, dtype=wide) for _ in range(3))
        for i in range(0, n, chunk):
            c = slice(i, i + chunk)
            z = _chunk_logits(h[c], weight, dtype)  # (c, V)
            lse[c] = torch.logsumexp(z, -1)
            outside = torch.logsumexp(z.scatter(1, ids[c], float("-inf")), -1)  # log of Q's numerator
            lse_out[c] = torch.where(r[c] > 0, outside, torch.zeros_like(outside))
            top = (torch.xlogy(p[c], p[c]) - p[c] * (z.gather(1, ids[c]) - lse[c, None])).sum(1)
            rest = torch.xlogy(r[c], r[c]) - r[c] * (lse_out[c] - lse[c])  # r (log r - log Q)
            kl[c] = torch.where(keep[c], top + torch.where(r[c] > 0, rest, torch.zeros_like(rest)),
                                torch.zeros_like(top))
        ctx.save_for_backward(h, weight, p, ids, r, keep, lse, lse_out)
        ctx.chunk, ctx.dtype = chunk, dtype
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        h, weight, p, ids, r, keep, lse, lse_out = ctx.saved_tensors

        def logits_grad(c, z):  # q - t, times the upstream gradient
            q = (z - lse[c, None]).exp()  # the model's softmax, (c, V)
            off = r[c, None] * (z - lse_out[c, None]).exp()  # r q / Q, (c, V)
            t = torch.where(r[c, None] > 0, off, torch.zeros_like(off)).scatter(1, ids[c], 0.0)
            t = t.scatter_add(1, ids[c], p[c])  # p on the top k (a repeated id's p adds up)
            return (q - t) * torch.where(keep[c], grad_kl[c], 0)[:, None]  # d KL / d logits

        return *_head_backward(ctx, h, weight, lse.dtype, logits_grad), None, None, None, None, None


def linear_teacher_kl(h, weight, t_logp, t_ids, t_rest, keep, chunk=1024):
    """mars.teacher_kl(h @ weight.T, t_logp, t_ids, t_rest) per row in float32 (or wider), 0 where
    keep is False, never holding more than `chunk` rows of logits: h (n, C), weight (V, C), the
    teacher (n, k), (n, k), (n,), keep (n,) bool."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return LinearTeacherKL.apply(h, weight, t_logp, t_ids, t_rest, keep, chunk)
