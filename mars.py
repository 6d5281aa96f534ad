"""MARS training objective: block padding, the two-stream input, its attention mask, the loss.

MARS (docs/spec.md §1) fine-tunes an AR model so that a `<|mask|>` placeholder predicts
the token several steps ahead, while keeping every AR convention: causal attention,
right-shifted logits, left-to-right order. Training needs no new parameter; all of
the method is in how one batch is laid out and which tokens may see which:

  pad_row            a templated row -> (ids, labels), EOS-padded to a multiple of B (§2)
  collate            rows -> right-padded (N, l) tensors (§2)
  noisy_stream       every loss-carrying token -> <|mask|> (§3)
  mars_attention_mask  the (2l, 2l) mask over [clean | noisy] (§3)
  two_stream_batch   inputs and shared position ids of the 2l-token forward (§3)
  mars_loss          the forward: [clean | noisy], the (2l, 2l) mask, one model.hidden call (§3-§4)
  summed_loss        its loss from the two streams' outputs: CE_noisy + w * CE_clean per target (§4)
  teacher_kl         KL(teacher || model) from the teacher's top-k + the rest's mass: an
                     L_AR target beyond the paper (mars_loss(ar_teacher=...), issue 21)
  inverse_t_weights  the released "w/o L_AR" runs' 1/t weight of each row's noisy loss (§4)
  ar_loss            the plain AR SFT loss of the stage before MARS (§2)

Convention used everywhere (right shift, §3): `labels[:, i]` is the TARGET token at
index i, or -100; it is predicted by the output at index i-1 of the same stream.

This is the textbook form a student steps through. What it leaves to the engine: fast/window.py
runs the same loss over a shorter forward (the clean stream plain causal, only the noisy blocks
the loss reads), fast/train.py with the static shapes of a compiled step; both are proven to
give this file's loss and gradients, and train.py picks one (Settings.fast_loss).
"""

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a position that carries no loss (HF / PyTorch convention)


# ----------------------------------------------------------------------------- data layout (§2)
def pad_row(ids: list[int], loss_mask: list[bool], block_size: int, eos_id: int):
    """One templated row -> (ids, labels), EOS-padded to a multiple of `block_size` (§2).

    labels[i] = ids[i] where loss_mask[i] else -100 (the target at index i, read from
    output i-1). Blocks are anchored at index 0 of the row, so the first response
    block usually starts inside the prompt. The EOS pads CARRY loss: they teach masks
    that fall past the end of the answer to say EOS. So a row with any loss token
    keeps at least one after padding. (A row with no loss token at all still gets
    loss-carrying pads, as the rule says; the data pipeline should not produce one.)
    """
    if len(ids) != len(loss_mask):
        raise ValueError(f"ids ({len(ids)}) and loss_mask ({len(loss_mask)}) differ in length")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    labels = [t if m else IGNORE for t, m in zip(ids, loss_mask)]
    n_pad = -len(ids) % block_size
    return list(ids) + [eos_id] * n_pad, labels + [eos_id] * n_pad


def collate(rows, pad_id: int, device=None):
    """[(ids, labels), ...] -> ids (N, l), labels (N, l) LongTensors (§2).

    Rows are right-padded with `pad_id` (label -100, no loss) to the longest row. Each
    row is already a multiple of B (pad_row), so l is too and the batch padding fills
    whole blocks.
    """
    l = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), l), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), l), IGNORE, dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(rows):
        if len(row_ids) != len(row_labels):
            raise ValueError(f"row {r}: ids and labels differ in length")
        ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        labels[r, :len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
    return ids.to(device), labels.to(device)


# ----------------------------------------------------------------------------- two streams (§3)
def noisy_stream(ids, labels, mask_id: int):
    """The noisy stream (§3): every loss-carrying position -> `<|mask|>` (100% masking).

    Prompt tokens and padding (label -100) stay real, so a noisy query inside the
    first response block still reads the real prompt tokens of its own block.
    """
    return torch.where(labels != IGNORE, torch.full_like(ids, mask_id), ids)


def mars_attention_mask(l: int, block_size: int, bidirectional: bool = False, device=None):
    """The (2l, 2l) boolean MARS mask over [clean | noisy], True = query may attend key (§3).

    With pos = index inside its stream and blk = pos // B:
      clean q -> clean k : pos_k <= pos_q                      (ordinary causal)
      noisy q -> noisy k : blk_k == blk_q and pos_k <= pos_q   (causal, own block only)
      noisy q -> clean k : blk_k < blk_q                       (clean tokens of earlier blocks)
      clean q -> noisy k : never
    `bidirectional=True` drops pos_k <= pos_q in noisy -> noisy: the "Block Diffusion
    style" ablation (§4). Layout [clean | noisy] is the paper's; the released code
    uses [noisy | clean], which is the same mask with the two halves swapped.

    l = 4, B = 2 (rows = queries, columns = keys, x = may attend):

                 clean     noisy
                0 1 2 3   0 1 2 3
      clean 0   x . . .   . . . .
            1   x x . .   . . . .
            2   x x x .   . . . .
            3   x x x x   . . . .
      noisy 0   . . . .   x . . .     block 0: no clean context
            1   . . . .   x x . .
            2   x x . .   . . x .     block 1: clean block 0 + own block, causal
            3   x x . .   . . x x
    """
    i = torch.arange(2 * l, device=device)
    noisy = i >= l
    pos = i % l
    blk = pos // block_size
    nq, nk = noisy[:, None], noisy[None, :]  # (2l, 1), (1, 2l)
    causal = pos[None, :] <= pos[:, None]  # pos_k <= pos_q
    same_blk = blk[None, :] == blk[:, None]
    earlier_blk = blk[None, :] < blk[:, None]  # blk_k < blk_q
    clean_clean = ~nq & ~nk & causal
    noisy_noisy = nq & nk & same_blk & (causal | bidirectional)
    noisy_clean = nq & ~nk & earlier_blk
    return clean_clean | noisy_noisy | noisy_clean  # clean q -> noisy k: never


def two_stream_batch(ids, labels, mask_id: int):
    """inputs (N, 2l) = [clean | noisy] and position ids (N, 2l) = [0..l-1 | 0..l-1] (§3).

    A noisy token shares its RoPE position with its clean twin.
    """
    N, l = ids.shape
    inputs = torch.cat([ids, noisy_stream(ids, labels, mask_id)], dim=1)  # (N, 2l)
    position_ids = torch.arange(l, device=ids.device).repeat(2)[None].expand(N, 2 * l)
    return inputs, position_ids


# ----------------------------------------------------------------------------- loss (§4)
def _targets(labels):
    """Every loss-carrying target i >= 1: (row, i-1 = output that predicts it, token).

    Right shift (§3): the target at index i is read from output i-1, so a label at
    index 0 has no output to come from and is ignored (it is always prompt anyway).
    """
    tgt = labels[:, 1:]  # (N, l-1); tgt[:, p] is predicted by output p
    rows, src = (tgt != IGNORE).nonzero(as_tuple=True)  # (n,), (n,)
    return rows, src, tgt[rows, src]


def _ce_at(model, h, rows, src, tokens):
    """CE per target, in fp32 or wider; the LM head runs only on the n gathered hidden states.

    On Qwen2.5 the full (N, 2l, 151936) logits would be the largest tensor of a
    training step, and prompt / padding outputs carry no loss anyway.
    """
    logits = model.lm_head(h[rows, src])  # (n, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    return F.cross_entropy(logits, tokens, reduction="none")  # (n,)


def teacher_kl(logits, t_logp, t_ids, t_rest):
    """KL(teacher || model) per target (n,), the teacher given by its top k: beyond the paper.

    docs/spec.md §4's L_AR is CE on the row's tokens; this is the other L_AR target
    (Settings.ar_target = "teacher", issue 21): the frozen base's next-token distribution,
    kept as its k largest log-probabilities t_logp (n, k) at ids t_ids (n, k) and the mass
    t_rest (n,) of the other V - k tokens. With S the top-k set, p the teacher, q the model,
    r = t_rest and Q = q(not S) (both distributions coarsened to k + 1 outcomes):
        KL = sum_{i in S} p_i (log p_i - log q_i) + r (log r - log Q)
    It equals the full-vocabulary KL when k = V (r = 0; 0 log 0 = 0) and is below it
    otherwise; its gradient in the logits is q - t, t = p on S and r q / Q off S. The k + 1
    teacher masses are renormalised to sum to 1 (float16 storage rounds them).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (n, V)
    logq = torch.log_softmax(logits, -1)
    p, r = t_logp.to(logq.dtype).exp(), t_rest.to(logq.dtype)  # (n, k), (n,)
    if t_ids.shape[1] >= logq.shape[1]:  # k = V: no token outside the top k, whatever rounding left in r
        r = torch.zeros_like(r)
    total = p.sum(1) + r
    p, r = p / total[:, None], r / total
    ids = t_ids.long()
    # log Q as the logsumexp of the ids outside S, not log(1 - q(S)), which cancels in fp32;
    # a row with r = 0 (k = V) has no rest term: its logits stay finite, and so its backward
    outside = torch.where((r > 0)[:, None], logq.scatter(1, ids, float("-inf")), torch.zeros_like(logq))
    logq_rest = torch.logsumexp(outside, 1)  # (n,)
    top = (torch.xlogy(p, p) - p * logq.gather(1, ids)).sum(1)
    return top + torch.where(r > 0, torch.xlogy(r, r) - r * logq_rest, torch.zeros_like(r))


def _clean_at(model, h, rows, src, tokens, teacher=None):
    """L_AR's term per target: CE on the tokens (§4), or teacher_kl when a teacher is given
    ({"logp", "ids", "rest"}, one row per target in _targets' order: row by row, left to right)."""
    if teacher is None:
        return _ce_at(model, h, rows, src, tokens)
    return teacher_kl(model.lm_head(h[rows, src]), teacher["logp"], teacher["ids"], teacher["rest"])


def _per_sequence_mean(ce, rows, n_rows: int, row_weight=None):
    """Mean over each row's targets, then over the rows that have any target (§4);
    row_weight (N,), optional, multiplies each row's mean before the batch average.

    A row with no loss token is left out of the batch average (no 0/0 NaN); a batch
    with none at all gives a zero that still belongs to the graph.
    """
    count = torch.zeros(n_rows, dtype=ce.dtype, device=ce.device).index_add_(0, rows, torch.ones_like(ce))
    n_seq = (count > 0).sum().clamp(min=1)
    per_target = ce / count[rows]
    if row_weight is not None:
        per_target = per_target * row_weight.to(per_target.dtype)[rows]
    return per_target.sum() / n_seq


def inverse_t_weights(n_rows: int, generator=None, device=None, eps: float = 1e-3):
    """(n_rows,) weights 1/t, t ~ U[eps, 1) drawn per row: the released code's "w/o L_AR"
    objective (MARSTrainerNoSFT, docs/spec.md §4) multiplies each row's noisy loss by it.
    A leftover of diffusion training, where t is the masking rate; MARS masks 100 %, so
    here it only rescales rows at random: mean ln(1/eps) / (1 - eps) ~ 6.9, at most 1/eps.
    """
    t = eps + (1 - eps) * torch.rand(n_rows, generator=generator, device=device)
    return 1 / t


def mars_loss(model, ids, labels, mask_id: int, block_size: int, w: float = 1.0,
              bidirectional: bool = False, noisy_row_weight=None, ar_teacher=None):
    """The MARS loss (§3-§4) of a batch: (loss, l_mask, l_ar), loss = l_mask + w * l_ar.

    ids, labels (N, l), l a multiple of B (collate). The forward of §3 as drawn: the input
    [clean | noisy] (2l tokens, position ids 0..l-1 in each stream), the (2l, 2l)
    mars_attention_mask, one model.hidden call; then summed_loss: per loss-carrying target
    t, CE_noisy(t) + w * CE_clean(t), both streams right-shifted, normalised per sequence by
    its number of loss tokens, then averaged over the batch (§4).

    w = 0 is the "w/o L_AR" ablation: the clean stream still runs (noisy queries read
    its keys) but its LM head / CE is skipped, and l_ar is returned as NaN ("not
    computed"). The released code also multiplies each row's noisy loss by 1/t,
    t ~ U[1e-3, 1): pass noisy_row_weight = inverse_t_weights(N) for that objective
    (None, the default, is the spec's unweighted loss); l_mask is then the weighted one.
    bidirectional = True is the "Block Diffusion style" ablation (§4).
    ar_teacher = {"logp", "ids", "rest"} (one row per target, _targets' order) makes l_ar
    KL(teacher || model) on the clean stream instead of CE (teacher_kl; beyond the paper);
    the noisy stream keeps CE on the tokens.
    """
    N, l = ids.shape
    if l % block_size:
        raise ValueError(f"row length {l} is not a multiple of block_size {block_size} (use pad_row)")
    inputs, position_ids = two_stream_batch(ids, labels, mask_id)  # (N, 2l) each: [clean | noisy]
    mask = mars_attention_mask(l, block_size, bidirectional, ids.device)  # (2l, 2l), True = may attend
    h = model.hidden(inputs, position_ids, mask)  # (N, 2l, C): both streams, one forward
    return summed_loss(model, h[:, :l], h[:, l:], labels, w, noisy_row_weight, ar_teacher)


def summed_loss(model, h_clean, h_noisy, labels, w: float = 1.0, noisy_row_weight=None, ar_teacher=None):
    """The loss of §4 from the final hidden states of the two streams, h_clean and h_noisy
    (N, l, C) each: (loss, l_mask, l_ar), see mars_loss. Target i of a row is read from
    output i-1 of each stream (right shift, §3); the LM head runs on those outputs only.
    """
    N = labels.shape[0]
    rows, src, tokens = _targets(labels)  # (n,) each: target src + 1 of row `rows`, read at output src
    l_mask = _per_sequence_mean(_ce_at(model, h_noisy, rows, src, tokens), rows, N, noisy_row_weight)
    if w == 0:
        return l_mask, l_mask, torch.full_like(l_mask, float("nan")).detach()
    l_ar = _per_sequence_mean(_clean_at(model, h_clean, rows, src, tokens, ar_teacher), rows, N)
    return l_mask + w * l_ar, l_mask, l_ar


def ar_loss(model, ids, labels, ar_teacher=None):
    """Plain AR SFT loss (the stage before MARS, §2): the clean row alone, causal.

    Same right shift and per-sequence normalisation as mars_loss, so it equals
    mars_loss's l_ar on the same batch (with the same ar_teacher: KL instead of CE).
    """
    h = model.hidden(ids)  # (N, l, C), plain causal mask, positions 0..l-1
    rows, src, tokens = _targets(labels)
    clean = _clean_at(model, h, rows, src, tokens, ar_teacher)
    return _per_sequence_mean(clean, rows, ids.shape[0])


# ----------------------------------------------------------------------------- exact mode (exact.py)
def exact_attention_mask(n_drafts: int, group_size: int, device=None):
    """The (T, T) mask of one exact-mode step, T = (1+K)(1+g), True = query may attend key.

    The new tokens are [c_0, d_1..d_K | G_0 | G_1 | .. | G_K]: K+1 real tokens (the
    pending token c_0 and K drafts), then K+1 groups of g masks. With r = index of a
    real token and (j, m) = (group, index inside it) of a mask:
      real q -> real k : r_k <= r_q                   (ordinary causal)
      mask q -> real k : r_k <= j_q                   (G_j sees c_0, d_1..d_j)
      mask q -> mask k : j_k == j_q and m_k <= m_q    (causal, own group only)
      real q -> mask k : never
    It is the training mask of §3 read one group at a time: G_j is a noisy block whose
    clean context ends at d_j. The cached prefix is visible to every token (build_mask).

    K = 2, g = 2 (rows = queries, columns = keys, x = may attend):

                    c0 d1 d2   G0   G1   G2
                               0 1  0 1  0 1
      c0            x  .  .    . .  . .  . .
      d1            x  x  .    . .  . .  . .
      d2            x  x  x    . .  . .  . .
      G0 mask 0     x  .  .    x .  . .  . .
         mask 1     x  .  .    x x  . .  . .
      G1 mask 0     x  x  .    . .  x .  . .
         mask 1     x  x  .    . .  x x  . .
      G2 mask 0     x  x  x    . .  . .  x .
         mask 1     x  x  x    . .  . .  x x
    """
    n_real = 1 + n_drafts
    i = torch.arange(n_real * (1 + group_size), device=device)
    real = i < n_real
    grp = torch.where(real, i, (i - n_real) // group_size)  # real: its index r; mask: its group j
    rq, rk = real[:, None], real[None, :]  # (T, 1), (1, T)
    causal = i[None, :] <= i[:, None]  # inside a group the masks are laid out in order
    real_real = rq & rk & causal
    mask_real = ~rq & rk & (grp[None, :] <= grp[:, None])  # r_k <= j_q
    mask_mask = ~rq & ~rk & (grp[None, :] == grp[:, None]) & causal
    return real_real | mask_real | mask_mask  # real q -> mask k: never
