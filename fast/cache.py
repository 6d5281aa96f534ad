"""FastCache: kvcache.KVCache with the shapes the engine needs (docs/spec.md §6 unchanged).

Row invariance (bf16, fp16; see linear.py): attention reads the whole cache at every step, its
slot count a multiple of KEY_BLOCK, the slots a row may not see masked (`fixed_shapes`). Every
attention call of a decode then has one key count, whatever the rows' lengths and the step. A
key block past every row's end is fully masked and adds exact zeros, so the capacity itself
does not change a row either. In fp32 a cache that is not static reads the slots in use, as the reference.

Static (`static=True`, what a compiled step uses): no host sync in a forward. `begin` does not
read the lengths back (the decoder sized the cache so that nothing can overflow), attention
reads every slot, and writes go to each row's slots by index. Every step of a decoder then has
one shape, as torch.compile and a CUDA graph need (gpt-fast's preallocated cache written at
`input_pos`).
"""

import torch

from fast.attention import round_up
from kvcache import KVCache
from util.precision import LOW_PRECISION

KEY_BLOCK = 512  # the key block of the CPU's flash attention from 512 keys on, so every block is whole


class FastCache(KVCache):
    def __init__(self, n_layers, batch_size, n_kv_heads, head_dim, max_len, step=1,
                 dtype=torch.float32, device="cpu", static=False):
        self.fixed_shapes = dtype in LOW_PRECISION  # tiled kernels, every slot read (see above)
        self.static = static  # no host sync in a forward; every slot read (see above)
        # whole key blocks: one shape for every request up to 512 slots (a compiled step's too)
        block = KEY_BLOCK if self.fixed_shapes or static else 1
        room = round_up(max_len + step, block) - max_len
        super().__init__(n_layers, batch_size, n_kv_heads, head_dim, max_len, room, dtype, device)
        self.width = step  # a compiled step forwards exactly this many tokens (FastQwen2.hidden)
        self.commits = 0  # none yet: the next forward is the prefill, which runs eagerly
        if static and self.k.is_cuda:  # a CUDA graph writes into these very tensors
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)

    @classmethod
    def over(cls, k, v, lengths):
        """A static cache over existing tensors (the compiled step builds one from its inputs)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.lengths, cache.T = k, v, lengths, None
        cache.max_len, cache.step, cache.width, cache.commits = k.shape[3], 0, 0, 1
        cache.fixed_shapes, cache.static = k.dtype in LOW_PRECISION, True
        return cache

    def begin(self, T):
        if self.static:  # every slot read, writes by index: nothing read back from the device
            self.T, self.at, self.end = T, None, self.k.shape[3]
            self.slots = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)
            return
        super().begin(T)
        if self.fixed_shapes:
            self.end = self.k.shape[3]  # attention reads every slot (build_mask masks what a row may not see)

    def commit(self, n):
        super().commit(n)
        self.commits += 1
