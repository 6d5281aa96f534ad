"""Attention for the two streams of MARS training as FlexAttention (issue 50; for a GPU).

fast.window.two_stream_window lays a row out as [clean, l tokens | noisy window, W tokens]. Its mask
(mars.mars_attention_mask restricted to those tokens) is structured: causal in the clean
stream, causal inside each block of B in the noisy one, the clean tokens of earlier blocks.
`two_stream_mask_mod` writes that rule as a FlexAttention mask_mod over (query, key) indices,
so `create_block_mask` can skip the tiles no query may see (most of the noisy stream's clean
context at long rows) and flex_attention can run fused, with grouped kv heads, without the
dense (N, 1, W, l + W) mask that keeps sdpa off its flash kernels. One BlockMask serves every
layer of a micro-batch.

How training uses it (`train.py --compile=true --flex_attention=true`, CUDA only): `use_flex`
makes the model run the two-stream window (fast.window.use_two_stream) with FlexTwoStreamAttention
(same parameters), and fast.train.mars_loss_static hands the layers a FlexMask: two_stream_window's
TwoStreamMask with the BlockMask of the same rule beside it. The swapped attention runs
flex_attention on it; any other mask takes fast.window's path (a FlexMask's dense rows there).

On the CPU flex_attention has no backward (torch 2.13): there the dense path stays what trains;
tests/test_fast_flex.py proves the rule equal to the dense mask on every (query, key) pair, no
allowed pair in a skipped block, flex's forward equal to model.attend over the dense mask in
float64, the static loss with real flex (no gradients) equal to mars.mars_loss, and with flex
replaced by its dense mask the static loss and every gradient equal to mars.mars_loss's.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from fast.window import TwoStreamAttention, TwoStreamMask, use_two_stream


def two_stream_mask_mod(l, block_size, start, bidirectional=False):
    """The mask_mod of an (l + W)-token two-stream row: query q may attend key kv (True)
    by mars.mars_attention_mask's rule, a noisy index i >= l standing for noisy position
    start[b] + i - l of row b (start: (N,) window starts, as two_stream_window returns)."""
    def mask_mod(b, h, q, kv):
        q_noisy, k_noisy = q >= l, kv >= l
        q_pos = torch.where(q_noisy, q - l + start[b], q)  # position inside its own stream
        k_pos = torch.where(k_noisy, kv - l + start[b], kv)
        causal = k_pos <= q_pos
        q_blk, k_blk = q_pos // block_size, k_pos // block_size
        clean_clean = ~q_noisy & ~k_noisy & causal
        noisy_noisy = q_noisy & k_noisy & (q_blk == k_blk) & (causal | bidirectional)
        noisy_clean = q_noisy & ~k_noisy & (k_blk < q_blk)
        return clean_clean | noisy_noisy | noisy_clean  # clean -> noisy: never
    return mask_mod


def two_stream_block_mask(l, W, block_size, start, bidirectional=False, tile=128):
    """The BlockMask of a micro-batch's two-stream rows (one for every layer)."""
    mod = two_stream_mask_mod(l, block_size, start, bidirectional)
    return create_block_mask(mod, start.shape[0], None, l + W, l + W, device=start.device, BLOCK_SIZE=tile)


def flex_attend(q, k, v, block_mask, scale):
    """model.attend over a BlockMask: q (N, nh, T, hd), k, v (N, nkv, T, hd) -> (N, nh, T, hd)."""
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


@dataclass(frozen=True)
class FlexMask(TwoStreamMask):
    """A TwoStreamMask (its dense rows: what fast.window.TwoStreamAttention reads) with the
    BlockMask of the same rule over the whole (l + W)-token row (what FlexTwoStreamAttention runs)."""
    block_mask: object = None


class FlexTwoStreamAttention(TwoStreamAttention):
    """model.Attention (`use_flex` swaps its class in: same parameters) that runs a FlexMask's
    BlockMask with flex_attention in one call, and every other mask as TwoStreamAttention does."""

    def attention(self, q, k, v, mask):
        if isinstance(mask, FlexMask):
            return flex_attend(q, k, v, mask.block_mask, self.hd ** -0.5)
        return super().attention(q, k, v, mask)


def use_flex(model: nn.Module) -> nn.Module:
    """Make `model` (a model.Qwen2) run the two-stream window (fast.window.use_two_stream) with
    every attention a FlexTwoStreamAttention, in place (returns it)."""
    use_two_stream(model)
    for module in model.modules():
        if type(module) is TwoStreamAttention:
            module.__class__ = FlexTwoStreamAttention
    return model
