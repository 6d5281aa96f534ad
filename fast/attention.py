"""TiledAttention: attention over a bf16/fp16 KV cache at one shape per call (row invariance,
see linear.py).

Every attention over such a cache runs tiles of exactly QUERY_TILE query rows against the
whole cache, whose slot count is a multiple of cache.KEY_BLOCK (slots a row may not see are
masked; a fully masked key block adds exact zeros). What this assumes of the kernel is only
that attention treats each (batch row, head) as its own problem and every query row of a call
alike. The g query heads that share a kv head become query rows of that head (grouped-query
attention without copying K/V).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fast.linear import padded
from model import Attention

QUERY_TILE = 32  # the CPU's flash attention splits queries in blocks of 32 below 192 queries


def round_up(n, block):
    return -(-n // block) * block


@dataclass(frozen=True)
class TiledMask:
    """The mask of a tiled attention call, made once per forward for every layer (FastQwen2)."""
    additive: torch.Tensor  # (N, 1, n, S): 0 where query row may attend, -inf elsewhere


def tiled_mask(mask, g, dtype):
    """mask (N, 1, T, S) bool -> TiledMask (N, 1, n, S) in `dtype`, row j*T + t the mask of
    query t (for each of the g query heads that share a kv head), n = g*T rounded up to
    QUERY_TILE rows; 0 where a row may attend and -inf elsewhere, the additive mask sdpa makes
    of a bool one (so the same arithmetic)."""
    T = mask.shape[2]
    allowed = padded(mask.repeat(1, 1, g, 1), round_up(g * T, QUERY_TILE), 2)  # (N, 1, n, S) bool
    additive = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
    return TiledMask(additive.masked_fill(~allowed, float("-inf")))


def attend_tiled(q, k, v, mask, scale):
    """model.attend at one shape per call: q (N, nh, T, hd) over the whole cache k, v (N, nkv,
    S, hd), mask a TiledMask; the g*T query rows of each kv head go to sdpa QUERY_TILE at a time."""
    N, nh, T, hd = q.shape
    m = mask.additive
    nkv, n = k.shape[1], m.shape[2]  # n: g*T query rows, padded to whole tiles by tiled_mask
    g = nh // nkv
    assert n == round_up(g * T, QUERY_TILE), "the mask is tiled_mask's for these queries"
    rows = padded(q.reshape(N, nkv, g * T, hd), n, 2)  # row j*T + t: query t of head kv*g + j
    y = torch.cat([F.scaled_dot_product_attention(rows[:, :, i:i + QUERY_TILE], k, v, scale=scale,
                                                  attn_mask=m[:, :, i:i + QUERY_TILE])
                   for i in range(0, n, QUERY_TILE)], 2)  # (N, nkv, n, hd)
    return y[:, :, :g * T].reshape(N, nh, T, hd)


class TiledAttention(Attention):
    """model.Attention (`make_fast` swaps its class in: same parameters) whose attention call
    is tiled when FastQwen2 handed it a TiledMask (a bf16/fp16 cache), else the reference's."""

    def attention(self, q, k, v, mask):
        if isinstance(mask, TiledMask):
            return attend_tiled(q, k, v, mask, self.hd ** -0.5)
        return super().attention(q, k, v, mask)
