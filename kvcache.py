"""A preallocated key/value cache with explicit per-row lengths (MARS_SPEC §6).

Layout: K and V are (n_layers, N, n_kv_heads, max_len, head_dim) tensors allocated
once, N rows. Row b's committed tokens occupy slots 0 .. lengths[b]-1; their position id is
their slot index (rows are right-padded, never left-padded, so a row's tokens start
at slot 0 and no slot inside the committed range is padding).

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

In bf16 (and fp16) attention reads a key span padded to a multiple of KEY_BLOCK slots, the
slots past `end` masked out. Why: the CPU's attention kernel sums a row over its keys in an
order that depends on how many keys it is given, and a bf16 output keeps the difference (on an
AMD EPYC, 25 of 60 random bf16 rows over 3-80 keys changed by an ulp when 8 more keys were
given, masked). An AR step reads max(lengths) + 1 keys, exact mode's verification
max(lengths) + T; padded to whole blocks, the row comes out bitwise the same
(tests/test_bf16.py). In fp32 the difference stays in a float32's last bits and the span is
`end`, as always.
"""

import torch

from util.precision import LOW_PRECISION

KEY_BLOCK = 64  # LOW_PRECISION: attention reads whole blocks of this many key slots


def round_up(n, block):
    return -(-n // block) * block


class KVCache:
    def __init__(self, n_layers, batch_size, n_kv_heads, head_dim, max_len,
                 dtype=torch.float32, device="cpu"):
        self.key_block = KEY_BLOCK if dtype in LOW_PRECISION else 1
        # room for the last padded span
        shape = (n_layers, batch_size, n_kv_heads, round_up(max_len, self.key_block), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.T = None  # tokens placed by `begin` for the next forward; None = nothing placed

    @classmethod
    def for_model(cls, model, batch_size, max_len):
        cfg = model.config
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim,
                   max_len, p.dtype, p.device)

    def begin(self, T):
        """Place the T new tokens of the next forward at slots lengths[b] .. lengths[b]+T-1,
        once for all layers (model.hidden calls it). Sets `end` = max(lengths) + T, the
        slots in use; `span`, the slots attention reads (`end` rounded up to the key block);
        and `at` = the common length when every row has the same one (a write is then a plain
        slice; batch 1 always), else None."""
        lo, hi = torch.aminmax(self.lengths)
        lo, hi = int(lo), int(hi)  # one device sync per forward, not one per layer
        if hi + T > self.max_len:
            raise ValueError(f"KV cache overflow: need {hi + T} slots, allocated max_len={self.max_len}")
        self.T, self.end, self.at = T, hi + T, lo if lo == hi else None
        self.span = round_up(self.end, self.key_block)
        self.slots = None if lo == hi else self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def write(self, layer, k_new, v_new):
        """Store k_new/v_new (N, nkv, T, hd) at the slots `begin(T)` placed; return the K/V
        of slots 0 .. span-1 (N, nkv, S, hd) for attention (build_mask masks those past end)."""
        if k_new.shape[2] != self.T:
            raise ValueError(f"write of {k_new.shape[2]} tokens, but begin() placed {self.T}")
        if self.at is not None:
            self.k[layer, :, :, self.at:self.end] = k_new
            self.v[layer, :, :, self.at:self.end] = v_new
        else:
            idx = self.slots[:, None, :, None].expand_as(k_new)  # (N, nkv, T, hd)
            self.k[layer].scatter_(2, idx, k_new)
            self.v[layer].scatter_(2, idx, v_new)
        return self.k[layer, :, :, :self.span], self.v[layer, :, :, :self.span]

    def commit(self, n):
        """Keep the first n[b] tokens of the last forward of row b (n: int or (N,) tensor)."""
        self.lengths += torch.as_tensor(n, dtype=torch.long, device=self.lengths.device)
        self.T = None

    def truncate(self, lengths):
        """Forget everything past `lengths` (N,) — e.g. rejected tokens."""
        self.lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).clone()
        self.T = None
