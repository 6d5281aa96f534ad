"""A static, sync-free MARS training step (issue 50): mars.mars_loss with fixed shapes.

fast.window.mars_loss_windowed runs mars.mars_loss over the two-stream window: it finds the
loss-carrying targets with `nonzero`, sizes the noisy window with `int(...)` and applies the LM
head to exactly the n targets, so every micro-batch has its own shapes and two host syncs, and
torch.compile breaks its graph there. Here the same loss is computed with shapes fixed by the
batch alone (the model made ready by fast.window.use_two_stream):

  * `static_batch` pads the rows to a length on a ladder (`bucket` tokens times a power of
    two) and sizes the noisy window on the host, before the batch is copied to the device
    (noisy_window's start and W, W rounded up the same ladder): no device sync, and few shapes
    over a run: at most (k + 1)(k + 2)/2 (rows, window) pairs for rows up to bucket x 2^k tokens
    (21 at 512 tokens and bucket 16), each one graph of the compiled step;
  * every output of both streams goes through the LM head with its target, the ignored ones
    carrying IGNORE (zero loss, zero gradient), by fast.loss.linear_cross_entropy, which never
    holds the logits of more than a chunk of rows;
  * the per-sequence mean from per-row counts, with no index_add over gathered rows.

Padding a row with padding (label IGNORE) changes no loss and no gradient (pads come after
every real token, and a noisy block of pads is read by nothing), nor does a wider window: so
this is the reference's loss, proven equal with its gradients in float64 (tests/test_fast_train.py).
What it costs: the head runs on the prompt's outputs too. L_AR may be the KL to a teacher
(ar_target = "teacher": `static_teacher` lays make_teacher's rows out on the outputs, on the host,
and fast.loss.linear_teacher_kl takes it in chunks), and each row's L_mask may carry a weight (the
1/t of inv_t_weight). `static_layout` is what train.py's step_batch runs on the host for it.
"""

import math

import torch
import torch.nn.functional as F

from fast.loss import linear_cross_entropy, linear_teacher_kl
from fast.window import noisy_window, require_two_stream, two_stream_window
from mars import IGNORE


def ladder(n, unit):
    """The smallest unit x 2^k >= n: the bucketed sizes, few of them (log2 of the range)."""
    size = unit
    while size < n:
        size *= 2
    return size


def static_batch(ids, labels, pad_id, block_size, bucket=16):
    """Rows (N, l) on the host, l a multiple of B (mars.collate) -> (ids, labels) padded to L =
    ladder(l) over units of lcm(bucket, B), and the noisy window (start (N,), W) for
    mars_loss_static, W = ladder(noisy_window's W), <= L."""
    N, l = ids.shape
    if l % block_size:
        raise ValueError(f"row length {l} is not a multiple of block_size {block_size} (use mars.pad_row)")
    unit = math.lcm(bucket, block_size)
    L = ladder(l, unit)
    ids = F.pad(ids, (0, L - l), value=pad_id)
    labels = F.pad(labels, (0, L - l), value=IGNORE)
    start, W = noisy_window(labels, block_size)  # host tensors: int() here reads no device
    W = min(ladder(W, unit), L)
    return ids, labels, (torch.minimum(start, torch.full_like(start, L - W)), W)


def targets_of(labels):
    """The target of every output i (§3's right shift: labels[:, i + 1]; IGNORE for the last),
    (N, l), and each row's number of targets, (N,)."""
    target = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return target, (target != IGNORE).sum(1)


def per_sequence_mean(ce, count, row_weight=None):
    """mars._per_sequence_mean from a (N, T) loss with zeros where there is no target and the
    (N,) target counts: each row's mean (times its row_weight (N,), if given), averaged over the
    rows that have a target."""
    has = count > 0
    mean = ce.sum(1) / count.clamp(min=1) * has  # (N,)
    if row_weight is not None:
        mean = mean * row_weight.to(mean.dtype)
    return mean.sum() / has.sum().clamp(min=1)


def static_teacher(teacher, labels):
    """make_teacher's rows (one per target, mars._targets' order: row by row, left to right) laid
    out on a static_batch's outputs, on the host: (N*L, k) log-probs and ids, (N*L,) rest mass,
    output i of row b holding the teacher of its target labels[b, i+1]; an output without a
    target holds a one-hot teacher at id 0 (finite, and its loss is masked anyway)."""
    target, _ = targets_of(labels)
    has = (target != IGNORE).flatten()  # (N*L,): row-major, the order of mars._targets
    n, k = has.shape[0], teacher["ids"].shape[1]
    logp = torch.full((n, k), float("-inf"), dtype=teacher["logp"].dtype)
    logp[:, 0] = 0.0
    ids = torch.zeros(n, k, dtype=teacher["ids"].dtype)
    rest = torch.zeros(n, dtype=teacher["rest"].dtype)
    logp[has], ids[has], rest[has] = teacher["logp"].cpu(), teacher["ids"].cpu(), teacher["rest"].cpu()
    return {"logp": logp, "ids": ids, "rest": rest}


def clean_loss(h, weight, labels, teacher, chunk):
    """L_AR per output of the clean stream h (N, l, C): CE on its target (§4), or with a
    static_teacher the KL to it (mars.teacher_kl), 0 where there is no target -> (N, l)."""
    N, l, C = h.shape
    target, _ = targets_of(labels)
    if teacher is None:
        ce = linear_cross_entropy(h.reshape(-1, C), weight, target.reshape(-1), chunk)
    else:
        ce = linear_teacher_kl(h.reshape(-1, C), weight, teacher["logp"], teacher["ids"], teacher["rest"],
                               (target != IGNORE).reshape(-1), chunk)
    return ce.view(N, l)


def mars_loss_static(model, ids, labels, window, mask_id, block_size, w=1.0, bidirectional=False,
                     noisy_row_weight=None, ar_teacher=None, chunk=1024, flex=False):
    """mars.mars_loss of a static_batch (its window: static_batch's): (loss, l_mask, l_ar), on a
    model made ready by fast.window.use_two_stream. ar_teacher: a static_teacher (L_AR the KL to
    it), else CE on the tokens; noisy_row_weight (N,): mars_loss's. flex: hand the layers a
    fast.flex.FlexMask (the attention fast.flex.use_flex swapped in runs it with flex_attention;
    a TwoStreamAttention reads its dense rows)."""
    N, l = ids.shape
    require_two_stream(model)
    inputs, position_ids, mask, start = two_stream_window(ids, labels, mask_id, block_size, bidirectional,
                                                          window=window)
    W = inputs.shape[1] - l
    if flex:
        from fast.flex import FlexMask, two_stream_block_mask

        mask = FlexMask(mask.rows, two_stream_block_mask(l, W, block_size, start, bidirectional))
    h = model.hidden(inputs, position_ids, mask)  # (N, l + W, C)
    C, weight = h.shape[-1], model.lm_head.weight
    target, count = targets_of(labels)  # (N, l), (N,)
    kept = start[:, None] + torch.arange(W, device=ids.device)  # (N, W): the noisy positions in the window
    noisy = linear_cross_entropy(h[:, l:].reshape(-1, C), weight, target.gather(1, kept).reshape(-1), chunk)
    l_mask = per_sequence_mean(noisy.view(N, W), count, noisy_row_weight)
    if w == 0:
        return l_mask, l_mask, torch.full_like(l_mask, float("nan")).detach()
    l_ar = per_sequence_mean(clean_loss(h[:, :l], weight, labels, ar_teacher, chunk), count)
    return l_mask + w * l_ar, l_mask, l_ar


def ar_loss_static(model, ids, labels, ar_teacher=None, chunk=1024):
    """mars.ar_loss (plain AR SFT, §2) of a static_batch: every output with its target (or its
    static_teacher's KL)."""
    _, count = targets_of(labels)
    ce = clean_loss(model.hidden(ids), model.lm_head.weight, labels, ar_teacher, chunk)
    return per_sequence_mean(ce, count)


def static_layout(batch, device, pad_id, block_size, bucket=16):
    """A micro-batch made on the host, train.step_batch's {"ids", "labels", "ar_teacher"}, laid
    out for the static step, then copied to `device`: the rows bucketed and the noisy window sized
    (static_batch, adding "window"), the teacher laid out on the outputs (static_teacher), all on
    the host, so the step reads nothing back; on CUDA the copy is from pinned memory and does not
    wait for the device."""
    ids, labels, (start, W) = static_batch(batch["ids"], batch["labels"], pad_id, block_size, bucket)
    teacher = batch["ar_teacher"]
    teacher = None if teacher is None else static_teacher(teacher, labels)
    pin = device.type == "cuda"
    to = lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=True)  # noqa: E731
    return {"ids": to(ids), "labels": to(labels), "window": (to(start), W),
            "ar_teacher": None if teacher is None else {k: to(v) for k, v in teacher.items()}}
