"""A preallocated key/value cache with explicit per-row lengths (docs/spec.md §6).

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

In bf16 (and fp16) attention reads the whole cache at every step, its slot count a multiple
of KEY_BLOCK, the slots a row may not see masked (`fixed_shapes`): every attention call of a
decode then has one key count, whatever the rows' lengths and the step, which is half of
what makes a decoding row's bits independent of the rows beside it and of the decoder
(model.py, "Row invariance"). A key block past every row's end is fully masked and adds
exact zeros, so the capacity itself does not change a row either. In fp32 attention reads the
slots in use, `end`: there the difference of two summation orders stays in a float32's
last bits.

A static cache (`static=True`, what a compiled decoding step uses: model.compile_decoding)
is the same layout with no host sync in a forward: `begin` does not read the lengths back
(the decoder sized the cache so that nothing can overflow), attention reads every slot, and
writes go to each row's slots by index. Every step of a decoder then has one shape, as
torch.compile and a CUDA graph need (gpt-fast's preallocated cache written at `input_pos`).
"""

import torch

from util.precision import LOW_PRECISION

KEY_BLOCK = 512  # LOW_PRECISION: the cache has a multiple of this many slots, all read
# (512: the key block of the CPU's flash attention from 512 keys on, so every block is whole)


def round_up(n, block):
    return -(-n // block) * block


class KVCache:
    def __init__(self, n_layers, batch_size, n_kv_heads, head_dim, max_len,
                 dtype=torch.float32, device="cpu", static=False):
        self.fixed_shapes = dtype in LOW_PRECISION  # tiled kernels, every slot read (see above)
        self.static = static  # no host sync in a forward; every slot read (see above)
        # whole key blocks: one shape for every request up to 512 slots (a compiled step's too)
        self.key_block = KEY_BLOCK if self.fixed_shapes or static else 1
        shape = (n_layers, batch_size, n_kv_heads, round_up(max_len, self.key_block), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.T = None  # tokens placed by `begin` for the next forward; None = nothing placed
        if static and self.k.is_cuda:  # a CUDA graph writes into these very tensors
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)

    @classmethod
    def for_model(cls, model, batch_size, max_len):
        """A cache for `model`'s layers and dtype; static when its decoding step is compiled."""
        cfg = model.config
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim,
                   max_len, p.dtype, p.device, static=getattr(model, "compiled_hidden", None) is not None)

    @classmethod
    def over(cls, k, v, lengths):
        """A static cache over existing tensors (the compiled step builds one from its inputs)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.lengths, cache.max_len, cache.T = k, v, lengths, k.shape[3], None
        cache.fixed_shapes, cache.static = k.dtype in LOW_PRECISION, True
        cache.key_block = KEY_BLOCK
        return cache

    def begin(self, T):
        """Place the T new tokens of the next forward at slots lengths[b] .. lengths[b]+T-1,
        once for all layers (model.hidden calls it). Sets `end` = max(lengths) + T, the
        slots in use; `span`, the slots attention reads (`end`, or every slot if fixed_shapes);
        and `at` = the common length when every row has the same one (a write is then a plain
        slice; batch 1 always), else None."""
        if self.static:  # every slot read, writes by index: nothing read back from the device
            self.T, self.at, self.span = T, None, self.k.shape[3]
            self.slots = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)
            return
        lo, hi = torch.aminmax(self.lengths)
        lo, hi = int(lo), int(hi)  # one device sync per forward, not one per layer
        if hi + T > self.max_len:
            raise ValueError(f"KV cache overflow: need {hi + T} slots, allocated max_len={self.max_len}")
        self.T, self.end, self.at = T, hi + T, lo if lo == hi else None
        self.span = self.k.shape[3] if self.fixed_shapes else self.end
        self.slots = None if lo == hi else self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def write(self, layer, k_new, v_new):
        """Store k_new/v_new (N, nkv, T, hd) at the slots `begin(T)` placed; return the K/V
        of slots 0 .. span-1 (N, nkv, S, hd) for attention (build_mask masks those past end)."""
        if k_new.shape[2] != self.T:
            raise ValueError(f"write of {k_new.shape[2]} tokens, but begin() placed {self.T}")
        if self.at is not None:
            self.k[layer, :, :, self.at:self.end] = k_new
            self.v[layer, :, :, self.at:self.end] = v_new
        else:  # row b's tokens to its own slots, by one index_put_ on the whole cache: a compiled
            # step does that in place (a scatter_ into one layer's view made it copy the cache)
            N, nkv, device = k_new.shape[0], k_new.shape[1], k_new.device
            where = (torch.full((1, 1, 1), layer, device=device),  # layer, row, kv head, slot -> (N, T, nkv)
                     torch.arange(N, device=device)[:, None, None],
                     torch.arange(nkv, device=device)[None, None], self.slots[..., None])
            self.k.index_put_(where, k_new.transpose(1, 2))  # the indexed part is (N, T, nkv, hd)
            self.v.index_put_(where, v_new.transpose(1, 2))
        return self.k[layer, :, :, :self.span], self.v[layer, :, :, :self.span]

    def commit(self, n):
        """Keep the first n[b] tokens of the last forward of row b (n: int or (N,) tensor)."""
        self.lengths += torch.as_tensor(n, dtype=torch.long, device=self.lengths.device)
        self.T = None

    def truncate(self, lengths):
        """Forget everything past `lengths` (N,) — e.g. rejected tokens."""
        self.lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).clone()
        self.T = None
