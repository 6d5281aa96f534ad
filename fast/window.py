"""The MARS training forward as the engine runs it: the two-stream window (docs/spec.md §3-§4).

mars.mars_loss is the textbook forward: [clean | noisy], 2l tokens, one (2l, 2l) mask tensor.
Part of that work feeds no loss. The clean queries' rows of the mask are plain causal over
the clean stream and see no noisy key, so they need no mask tensor; and a noisy query sees
noisy keys of its own block only, so the noisy blocks before a row's first target (the
prompt) and after its last (padding) are read by nothing the loss uses. The engine runs:

  noisy_window        per row, the whole noisy blocks the loss reads: start (N,) and width W
  two_stream_window   inputs and positions [clean, l | noisy window, W] (N, l + W), and the
                      TwoStreamMask: mars_attention_mask's rows of the kept noisy queries only
  TwoStreamAttention  attention in two calls: the clean queries plain causal over the clean
                      keys (no mask tensor, as plain AR), the noisy queries with their rows
  use_two_stream      swaps these into a model.Qwen2, in place: its Attention modules, and the
                      model's attention_mask, which hands a TwoStreamMask to every layer as is
  mars_loss_windowed  mars.mars_loss over that forward (its loss: mars.summed_loss)

Every kept token sees exactly what it sees in the 2l-token forward (the window keeps whole
blocks), so the loss and every gradient are mars_loss's: proven in float64, trimmed or not,
both ablations, w = 0, the teacher's KL and the 1/t row weights (tests/test_fast_paths.py).
train.py runs it by default (Settings.fast_loss; --fast_loss=false runs mars.mars_loss), and
fast/train.py's static step builds on it. The core imports nothing from here.
"""

import functools
from dataclasses import dataclass

import torch

from mars import IGNORE, mars_attention_mask, noisy_stream, summed_loss, two_stream_batch
from model import CAUSAL, Attention, Qwen2, attend


@dataclass(frozen=True)
class TwoStreamMask:
    """The mask of an input [clean stream, l tokens | noisy tokens] (two_stream_window): its
    first l queries are plain causal over the first l keys and see no key after them (the
    clean rows of mars_attention_mask), so only the noisy queries' rows are held."""
    rows: torch.Tensor  # (T - l, T) or (N, T - l, T) bool, True = may attend: the noisy queries' rows


def two_stream_attend(q, k, v, mask, scale):
    """model.attend over a TwoStreamMask, in two calls: the clean queries causal over the clean
    keys (sdpa's own causal mask), the noisy queries over all T keys with mask.rows; the
    (T, T) mask is never made. q (N, nh, T, hd), k, v (N, nkv, T, hd) -> (N, nh, T, hd)."""
    l = q.shape[2] - mask.rows.shape[-2]
    rows = mask.rows if mask.rows.dim() == 2 else mask.rows[:, None]  # (T - l, T) or (N, 1, T - l, T)
    clean = attend(q[:, :, :l], k[:, :, :l], v[:, :, :l], CAUSAL, scale)  # (N, nh, l, hd)
    return torch.cat([clean, attend(q[:, :, l:], k, v, rows, scale)], dim=2)


class TwoStreamAttention(Attention):
    """model.Attention (use_two_stream swaps its class in: same parameters) that runs a
    TwoStreamMask in two calls, and every other mask as the reference does."""

    def attention(self, q, k, v, mask):
        if isinstance(mask, TwoStreamMask):
            return two_stream_attend(q, k, v, mask, self.hd ** -0.5)
        return super().attention(q, k, v, mask)


class TwoStreamQwen2(Qwen2):
    """model.Qwen2 whose attention_mask hands a TwoStreamMask on unchanged (model.build_mask
    takes tensors only); every other mask is the reference's."""

    def attention_mask(self, T, attn_mask=None, cache=None):
        if not isinstance(attn_mask, TwoStreamMask):
            return super().attention_mask(T, attn_mask, cache)
        if cache is not None:
            raise ValueError("a TwoStreamMask is a training mask: it takes no KV cache")
        return attn_mask


def use_two_stream(model: Qwen2) -> TwoStreamQwen2:
    """Make `model` (a model.Qwen2) run the two-stream window, in place (returns it): every
    Attention a TwoStreamAttention, the model a TwoStreamQwen2. Parameters, names and values
    stay; with any other mask it computes what the reference computes."""
    if not isinstance(model, TwoStreamQwen2):
        if type(model) is not Qwen2:
            raise TypeError(f"use_two_stream takes a model.Qwen2, not a {type(model).__name__}")
        model.__class__ = TwoStreamQwen2
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = TwoStreamAttention
    return model


def require_two_stream(model):
    """Refuse, by name, a model that cannot run a TwoStreamMask (model.build_mask would fail
    on it with a less helpful message)."""
    if not isinstance(model, TwoStreamQwen2):
        raise TypeError(f"a {type(model).__name__} does not run the two-stream window: "
                        "fast.window.use_two_stream(model) first")


def noisy_window(labels, block_size: int):
    """The noisy blocks the loss reads: start (N,) and width W, whole blocks (§3-§4).

    A noisy query reads noisy keys of its own block only, and a noisy output carries loss
    only where a target follows it (output i-1 of target i). So the noisy blocks before a
    row's first such output (prompt) and after its last (padding) are read by nothing the
    loss uses: they are left out. Row r keeps noisy positions start[r] .. start[r]+W-1,
    W = the widest row's span, each window block-aligned and inside [0, l).
    """
    N, l = labels.shape
    src = torch.arange(l - 1, device=labels.device).expand(N, l - 1)  # output index of target src+1
    has = labels[:, 1:] != IGNORE
    lo = torch.where(has, src, l).amin(1) // block_size * block_size  # (N,); l: no target
    hi = (torch.where(has, src, -1).amax(1) // block_size + 1) * block_size
    W = max(int((hi - lo).max()), block_size)  # a read of the device: fast/train.py sizes it on the host
    return torch.minimum(lo, torch.full_like(lo, l - W)), W


@functools.lru_cache(maxsize=64)
def full_mask(l: int, block_size: int, bidirectional: bool, device):
    """mars_attention_mask, built once per (l, B, bidirectional, device): not every step."""
    return mars_attention_mask(l, block_size, bidirectional, device)


def two_stream_window(ids, labels, mask_id: int, block_size: int, bidirectional: bool = False,
                      trim: bool = True, window=None):
    """The forward's input [clean | noisy (window)]: inputs and position ids (N, l + W), the
    TwoStreamMask and the window starts (N,).

    The mask is mars_attention_mask's, restricted to the tokens kept (its rows and columns at
    those positions), so every kept token sees exactly what it sees in the full 2l-token
    forward: the window keeps whole blocks, and a noisy query sees no noisy key outside its
    block. trim = False keeps the whole noisy stream (W = l, start 0): two_stream_batch's
    layout, the mask's noisy rows (l, 2l). window = (start, W): a window the caller computed
    (noisy_window's, or a wider one that holds it, whole blocks inside [0, l)), else
    noisy_window's own.
    """
    N, l = ids.shape
    full = full_mask(l, block_size, bidirectional, ids.device)  # (2l, 2l)
    if not trim:
        inputs, position_ids = two_stream_batch(ids, labels, mask_id)  # (N, 2l) each
        start = torch.zeros(N, dtype=torch.long, device=ids.device)
        return inputs, position_ids, TwoStreamMask(full[l:]), start
    start, W = noisy_window(labels, block_size) if window is None else window
    kept = start[:, None] + torch.arange(W, device=ids.device)  # (N, W) noisy positions kept
    clean = torch.arange(l, device=ids.device).expand(N, l)
    cols = torch.cat([clean, l + kept], dim=1)  # (N, l + W) index into [clean | noisy]
    rows = full[(l + kept)[:, :, None], cols[:, None, :]]  # (N, W, l + W)
    inputs = torch.cat([ids, noisy_stream(ids, labels, mask_id).gather(1, kept)], dim=1)  # (N, l + W)
    return inputs, torch.cat([clean, kept], dim=1), TwoStreamMask(rows), start


def mars_loss_windowed(model, ids, labels, mask_id: int, block_size: int, w: float = 1.0,
                       bidirectional: bool = False, noisy_row_weight=None, ar_teacher=None,
                       trim: bool = True, window=None):
    """mars.mars_loss (§3-§4) with its forward run as two_stream_window: (loss, l_mask, l_ar),
    the same loss and gradients; `model` made ready by use_two_stream. trim = False keeps
    the whole noisy stream; window: see two_stream_window."""
    N, l = ids.shape
    if l % block_size:
        raise ValueError(f"row length {l} is not a multiple of block_size {block_size} (use mars.pad_row)")
    require_two_stream(model)
    inputs, position_ids, mask, start = two_stream_window(ids, labels, mask_id, block_size, bidirectional,
                                                          trim, window)
    h = model.hidden(inputs, position_ids, mask)  # (N, l + W, C)
    N, T, C = h.shape
    kept = start[:, None] + torch.arange(T - l, device=ids.device)  # (N, W): the noisy positions kept
    # the window back at its place in the noisy stream, (N, l, C); the zeros outside it are
    # outputs no loss reads (summed_loss reads the outputs before targets only)
    h_noisy = h.new_zeros(N, l, C).scatter(1, kept[:, :, None].expand(N, T - l, C), h[:, l:])
    return summed_loss(model, h[:, :l], h_noisy, labels, w, noisy_row_weight, ar_teacher)
