"""A preallocated key/value cache with explicit per-row lengths (MARS_SPEC §6).

Layout: K and V are (n_layers, B, n_kv_heads, max_len, head_dim) tensors allocated
once. Row b's committed tokens occupy slots 0 .. lengths[b]-1; their position id is
their slot index (rows are right-padded, never left-padded, so a row's tokens start
at slot 0 and no slot inside the committed range is padding).

A forward pass with T new tokens *writes* their K/V at slots lengths[b] ..
lengths[b]+T-1 of each row (model.Attention calls `write`), and attention sees the
committed prefix plus those T slots. Nothing is committed as a side effect: the
caller then says how many of the T tokens to keep with `commit(n)` (n per row).
That single rule gives every cache mode of the spec:

  * AR decoding: forward 1 token, commit 1.
  * sliding window: forward [accepted-not-yet-cached | B masks], commit only the
    accepted real tokens; the masks' K/V lie beyond `lengths` and are overwritten
    by the next write (they are never visible: attention stops at lengths+T).
  * block cache: inner steps forward the block's slots and commit nothing (the
    prefix cache stays fixed); one final forward of the filled block commits it.
"""

import torch


class KVCache:
    def __init__(self, n_layers, batch_size, n_kv_heads, head_dim, max_len,
                 dtype=torch.float32, device="cpu"):
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, batch_size, max_len):
        cfg = model.config
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim,
                   max_len, p.dtype, p.device)

    def write(self, layer, k_new, v_new):
        """Store k_new/v_new (B, nkv, T, hd) at slots lengths[b].. of each row; return the
        K/V of slots 0 .. max(lengths)+T-1 (B, nkv, S, hd) for attention."""
        T = k_new.shape[2]
        end = int(self.lengths.max()) + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: need {end} slots, allocated max_len={self.max_len}")
        slots = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)  # (B, T)
        idx = slots[:, None, :, None].expand_as(k_new)
        self.k[layer].scatter_(2, idx, k_new)
        self.v[layer].scatter_(2, idx, v_new)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def commit(self, n):
        """Keep the first n[b] tokens of the last forward of row b (n: int or (B,) tensor)."""
        self.lengths += torch.as_tensor(n, dtype=torch.long, device=self.lengths.device)

    def truncate(self, lengths):
        """Forget everything past `lengths` (B,) — e.g. rejected tokens."""
        self.lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).clone()
