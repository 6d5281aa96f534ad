"""A preallocated key/value cache with explicit per-row lengths (docs/spec.md §6).

Layout: K and V are (n_layers, N, n_kv_heads, slots, head_dim) tensors allocated once, N
rows. Row b's committed tokens occupy slots 0 .. lengths[b]-1; their position id is their
slot index (rows are right-padded, never left-padded, so a row's tokens start at slot 0 and
no slot inside the committed range is padding).

A forward pass with T new tokens *writes* their K/V at slots lengths[b] ..
lengths[b]+T-1 of each row (model.hidden calls `begin(T)` once to place them, then
each layer's Attention calls `write`), and attention sees the committed prefix plus
those T slots. Nothing is committed as a side effect: the caller then says how many of
the T tokens to keep with `commit(n)` (n per row).
That single rule gives every cache mode of the spec:

  * AR decoding: forward 1 token, commit 1.
  * sliding window: forward [accepted-not-yet-cached | B masks], commit only the
    accepted real tokens; the masks' K/V lie beyond `lengths` and are overwritten
    by the next write (they are never visible: attention stops at lengths+T).
  * block cache: inner steps forward the block's slots and commit nothing (the
    prefix cache stays fixed); one final forward of the filled block commits it.

The cache holds max_len committed tokens per row plus `step` slots: room for the widest
forward the decoder runs (its masks and drafts are written past the committed tokens).
"""

import torch


class KVCache:
    def __init__(self, n_layers, batch_size, n_kv_heads, head_dim, max_len, step=1,
                 dtype=torch.float32, device="cpu"):
        self.max_len, self.step = max_len, step
        shape = (n_layers, batch_size, n_kv_heads, max_len + step, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.T = None  # tokens placed by `begin` for the next forward; None = nothing placed

    def begin(self, T):
        """Place the T new tokens of the next forward at slots lengths[b] .. lengths[b]+T-1,
        once for all layers (model.hidden calls it). Sets `end` = max(lengths) + T, the slots
        attention reads, and `at` = the common length when every row has the same one (a
        write is then a plain slice; batch 1 always), else None with `slots` (N, T) per row."""
        lo, hi = torch.aminmax(self.lengths)
        lo, hi = int(lo), int(hi)  # one device sync per forward, not one per layer
        if hi + T > self.k.shape[3]:
            raise ValueError(f"KV cache overflow: need {hi + T} slots, allocated {self.k.shape[3]} "
                             f"(max_len={self.max_len} + step={self.step})")
        self.T, self.end, self.at = T, hi + T, lo if lo == hi else None
        self.slots = None if lo == hi else self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def write(self, layer, k_new, v_new):
        """Store k_new/v_new (N, nkv, T, hd) at the slots `begin(T)` placed; return the K/V
        of slots 0 .. end-1 (N, nkv, S, hd) for attention (build_mask masks what a row may
        not see)."""
        if k_new.shape[2] != self.T:
            raise ValueError(f"write of {k_new.shape[2]} tokens, but begin() placed {self.T}")
        if self.at is not None:
            self.k[layer, :, :, self.at:self.at + self.T] = k_new
            self.v[layer, :, :, self.at:self.at + self.T] = v_new
        else:  # row b's tokens to its own slots, by one index_put_ on the whole cache
            N, nkv, device = k_new.shape[0], k_new.shape[1], k_new.device
            where = (torch.full((1, 1, 1), layer, device=device),  # layer, row, kv head, slot -> (N, T, nkv)
                     torch.arange(N, device=device)[:, None, None],
                     torch.arange(nkv, device=device)[None, None], self.slots[..., None])
            self.k.index_put_(where, k_new.transpose(1, 2))  # the indexed part is (N, T, nkv, hd)
            self.v.index_put_(where, v_new.transpose(1, 2))
        return self.k[layer, :, :, :self.end], self.v[layer, :, :, :self.end]

    def commit(self, n):
        """Keep the first n[b] tokens of the last forward of row b (n: int or (N,) tensor)."""
        self.lengths += torch.as_tensor(n, dtype=torch.long, device=self.lengths.device)
        self.T = None
