"""MARS training objective: block padding, the two-stream input, its attention mask, the loss.

MARS (MARS_SPEC §1) fine-tunes an AR model so that a `<|mask|>` placeholder predicts
the token several steps ahead, while keeping every AR convention: causal attention,
right-shifted logits, left-to-right order. Training needs no new parameter; all of
the method is in how one batch is laid out and which tokens may see which:

  pad_row            a templated row -> (ids, labels), EOS-padded to a multiple of B (§2)
  collate            rows -> right-padded (N, l) tensors (§2)
  noisy_stream       every loss-carrying token -> <|mask|> (§3)
  mars_attention_mask  the (2l, 2l) mask over [clean | noisy] (§3)
  two_stream_mask    the same mask as attention runs it: clean rows causal, noisy rows kept
  two_stream_batch   inputs and shared position ids of the 2l-token forward (§3)
  mars_loss          one forward, CE_noisy + w * CE_clean per target (§4)
  ar_loss            the plain AR SFT loss of the stage before MARS (§2)

Convention used everywhere (right shift, §3): `labels[:, i]` is the TARGET token at
index i, or -100; it is predicted by the output at index i-1 of the same stream.
"""

import functools

import torch
import torch.nn.functional as F

from model import TwoStreamMask

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


@functools.lru_cache(maxsize=64)
def two_stream_mask(l: int, block_size: int, bidirectional: bool = False, device=None):
    """mars_attention_mask as attention runs it (model.TwoStreamMask), built once per
    (l, B, bidirectional, device) and cached: not every step.

    The clean rows of the mask are plain causal over the clean stream and never see a
    noisy key (§3), so the clean stream's attention is exactly AR's (sdpa's own causal
    mask, l x l); only the noisy rows (l, 2l) are kept as a tensor. The full (2l, 2l)
    mask is never handed to attention.
    """
    return TwoStreamMask(mars_attention_mask(l, block_size, bidirectional, device)[l:].clone())


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
    """CE per target, fp32; the LM head runs only on the n gathered hidden states.

    On Qwen2.5 the full (N, 2l, 151936) logits would be the largest tensor of a
    training step, and prompt / padding outputs carry no loss anyway.
    """
    logits = model.lm_head(h[rows, src]).float()  # (n, V)
    return F.cross_entropy(logits, tokens, reduction="none")  # (n,)


def _per_sequence_mean(ce, rows, n_rows: int):
    """Mean over each row's targets, then over the rows that have any target (§4).

    A row with no loss token is left out of the batch average (no 0/0 NaN); a batch
    with none at all gives a zero that still belongs to the graph.
    """
    count = torch.zeros(n_rows, device=ce.device).index_add_(0, rows, torch.ones_like(ce))  # (N,)
    n_seq = (count > 0).sum().clamp(min=1)
    return (ce / count[rows]).sum() / n_seq


def mars_loss(model, ids, labels, mask_id: int, block_size: int, w: float = 1.0,
              bidirectional: bool = False, two_stream: bool = True):
    """The MARS loss (§3-§4) of a batch: (loss, l_mask, l_ar), loss = l_mask + w * l_ar.

    ids, labels (N, l), l a multiple of B (collate). One forward over [clean | noisy]
    with mars_attention_mask (run as two_stream_mask); both streams right-shifted. Per
    loss-carrying target t the loss is CE_noisy(t) + w * CE_clean(t), normalised per
    sequence by its number of loss tokens, then averaged over the batch. l_mask (noisy
    part) and l_ar (clean part, the AR signal that keeps the model an AR model) use the
    same normalisation.

    w = 0 is the "w/o L_AR" ablation: the clean stream still runs (noisy queries read
    its keys) but its LM head / CE is skipped, and l_ar is returned as NaN ("not
    computed"). The released code also multiplies each row's noisy loss by 1/t,
    t ~ U[1e-3, 1): a leftover of diffusion training that we do not apply.
    bidirectional = True is the "Block Diffusion style" ablation (§4).
    two_stream = False hands attention the full (2l, 2l) mask instead of two_stream_mask:
    the same loss and gradients, slower (the reference of tests/test_fast_paths.py).
    """
    N, l = ids.shape
    if l % block_size:
        raise ValueError(f"row length {l} is not a multiple of block_size {block_size} (use pad_row)")
    inputs, position_ids = two_stream_batch(ids, labels, mask_id)  # (N, 2l) each
    if two_stream:
        mask = two_stream_mask(l, block_size, bidirectional, ids.device)
    else:  # the reference: the full mask as one tensor, one masked attention over 2l tokens
        mask = mars_attention_mask(l, block_size, bidirectional, ids.device)  # (2l, 2l)
    h = model.hidden(inputs, position_ids, mask)  # (N, 2l, C)
    rows, src, tokens = _targets(labels)
    l_mask = _per_sequence_mean(_ce_at(model, h, rows, l + src, tokens), rows, N)
    if w == 0:
        return l_mask, l_mask, torch.full_like(l_mask, float("nan")).detach()
    l_ar = _per_sequence_mean(_ce_at(model, h, rows, src, tokens), rows, N)
    return l_mask + w * l_ar, l_mask, l_ar


def ar_loss(model, ids, labels):
    """Plain AR SFT loss (the stage before MARS, §2): the clean row alone, causal.

    Same right shift and per-sequence normalisation as mars_loss, so it equals
    mars_loss's l_ar on the same batch.
    """
    h = model.hidden(ids)  # (N, l, C), plain causal mask, positions 0..l-1
    rows, src, tokens = _targets(labels)
    return _per_sequence_mean(_ce_at(model, h, rows, src, tokens), rows, ids.shape[0])


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
