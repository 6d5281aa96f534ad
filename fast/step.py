"""FastQwen2 and `make_fast`: the reference model with the engine's modules, cache and step.

`make_fast(model, compile=...)` swaps, in place, the classes of a loaded model.Qwen2 and of its
modules for the engine's (same parameters, names, values and head tie; what `transformers`
loads is saved as before): FastLinear (linear.py), TiledAttention (attention.py), and the
model itself for FastQwen2, which overrides three methods of the reference and brings a fourth:

  new_cache       a FastCache (cache.py): whole key blocks; static when the step is compiled
  attention_mask  build_mask's, made once per forward as a TiledMask over a bf16/fp16 cache
  hidden          with compile: a decoding step (any forward over a cache after the prefill)
                  padded to the cache's `width` (the decoder's widest step) and run through
                  one compiled graph per width, batch and dtype; the prefill runs eagerly
  argmax          the greedy pick by block maxima (argmax.py): the decoders read a model's
                  through decoding.greedy_pick (a reference model has none: sampling.argmax)

`switch_step` turns the compiled step on or off (compile_step compiles it and turns it on).
The decoders are the reference's (generate.py, exact.py) or loop.py's. A padded step's extra
tokens sit at the end and are seen by no real token (the causal or exact-mode mask), so the
real tokens' outputs are the unpadded forward's; their K/V lie past the rows' lengths and are
overwritten by the next step.
"""

import functools

import torch
import torch.nn as nn

from fast.argmax import block_argmax
from fast.attention import TiledAttention, tiled_mask
from fast.cache import FastCache
from fast.linear import FastLinear, pack, row_tile
from model import Attention, Qwen2, build_mask


class FastQwen2(Qwen2):
    compiled = None  # the compiled decoding step (switch_step), None: every forward eager
    argmax = staticmethod(block_argmax)  # the greedy pick: sampling.argmax's answer, faster

    def new_cache(self, batch_size, max_len, step=1, static=None):
        """static: whether forwards read nothing back (default: when the step is compiled)."""
        cfg, p = self.config, self.lm_head.weight
        static = self.compiled is not None if static is None else static
        return FastCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim,
                         max_len, step, p.dtype, p.device, static=static)

    def attention_mask(self, T, attn_mask=None, cache=None):
        mask = build_mask(T, attn_mask, cache)
        if isinstance(cache, FastCache) and cache.fixed_shapes:  # row invariance: tiled attention
            if mask is None:  # build_mask's "every key visible" (a 1-token step into the last slot)
                mask = cache.k.new_ones(cache.lengths.shape[0], 1, T, cache.end, dtype=torch.bool)
            g = self.config.num_attention_heads // self.config.num_key_value_heads
            return tiled_mask(mask, g, cache.k.dtype)
        return mask

    def hidden(self, idx, position_ids=None, attn_mask=None, cache=None):
        if self.compiled is None or cache is None or cache.commits == 0:
            return super().hidden(idx, position_ids, attn_mask, cache)
        N, T = idx.shape
        W = cache.width
        if T > W:
            raise ValueError(f"a decoding step of {T} tokens, but the cache was made for steps of {W}")
        if T < W:  # pad at the end: no real token sees the padding (see the module docstring)
            idx = torch.cat([idx, idx.new_zeros(N, W - T)], 1)
            if position_ids is not None:
                position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(N, W - T)], 1)
            if attn_mask is not None:
                attn_mask = padded_mask(attn_mask, W)
        return self.compiled(self, idx, position_ids, attn_mask, cache.k, cache.v, cache.lengths)[:, :T]


def padded_mask(mask, W):
    """A (..., T, T) bool mask inside a (..., W, W) one: a padding token sees itself only."""
    out = _eye(W, mask.device).expand(*mask.shape[:-2], W, W).clone()
    out[..., :mask.shape[-2], :mask.shape[-1]] = mask
    return out


@functools.cache
def _eye(W, device):
    return torch.eye(W, dtype=torch.bool, device=device)


def static_hidden(model, idx, position_ids, attn_mask, k, v, lengths):
    """The reference's hidden over a static cache made of the cache's own tensors (what
    compile_step compiles: tensors in, so a new request's cache is no new input to guard on)."""
    return Qwen2.hidden(model, idx, position_ids, attn_mask, FastCache.over(k, v, lengths))


def compile_step(model: FastQwen2, mode: str | None = None) -> FastQwen2:
    """Compile the model's decoding step with torch.compile (in place; returns the model).

    mode: torch.compile's; default "reduce-overhead" on CUDA (CUDA graphs: one launch per
    step) and inductor's default on the CPU, where the matmuls of packed weights stay the eager
    step's oneDNN calls (op mars::packed_linear, which inductor keeps opaque) and inductor fuses
    the rest; the cache is written in place (KVCache.write's index_put_, no copy of it).
    (`options={"freezing": True}` of torch 2.13 left the graph as it was here, and inductor's
    own fp32 prepacking, MKL's, is slower than oneDNN's at 9 rows: not used.) The arithmetic is
    the eager step's, fused: in fp32 it may round apart (tests/test_compile.py measures how
    far); in bf16 the row-invariance tiles are in the graph. On the CPU, `emulate_precision_casts`
    keeps the eager step's roundings to bf16 between ops that fusion would otherwise skip
    (SmolLM2, 12 prompts, 48 tokens, AMD EPYC with AVX512-BF16: 10/12 replies = eager with it,
    8/12 without; results/SPEED.md). Not on CUDA, where it also turns off Triton's fused
    multiply-adds, unmeasured there."""
    switch_step(model, compiled(static_hidden, model.lm_head.weight.device, mode))
    return model


def switch_step(model: FastQwen2, step):
    """Decode through `step` from now on (what compile_step compiled, or static_hidden itself,
    run eagerly), or, with None, every forward eagerly -> the step it replaces, to switch back.
    A cache is static when made while a step is on (new_cache), so switch before the decoder
    makes its cache."""
    before, model.compiled = model.compiled, step
    return before


def compiled(fn, device, mode=None, fullgraph=False):
    """torch.compile(fn) as the engine compiles a decoding step on `device` (compile_step's
    choices: CUDA graphs on a GPU, inductor with emulate_precision_casts on the CPU)."""
    row_tile(device)  # asked before tracing: the CPU check is no graph to compile
    mode = mode or ("reduce-overhead" if device.type == "cuda" else "default")
    # torch.compile takes a mode or options, not both: the mode's options, and ours
    options = dict(torch._inductor.list_mode_options(mode), emulate_precision_casts=device.type == "cpu")
    # one graph per decoder, batch size and dtype, all of one function: past dynamo's default of
    # 8 a new shape would run eagerly, silently (bench_decode's 2 dtypes x 4 decoders x 2 batch
    # sizes did); 64 graphs per function, as many as the 256 in all allow
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=False, fullgraph=fullgraph, options=options)


def make_fast(model: Qwen2, compile: bool = False) -> FastQwen2:
    """The engine over `model`, in place (returns it, now a FastQwen2): every nn.Linear a
    FastLinear (packed for oneDNN on the CPU, row tiles in bf16/fp16), every Attention a
    TiledAttention, its greedy pick by block maxima (FastQwen2.argmax); with `compile`, the
    decoding step compiled (compile_step). Only the model changes, no name of a core module.
    Decode in the model's dtype: cast it before (model.to)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
        elif type(module) is Attention:
            module.__class__ = TiledAttention
    model.__class__ = FastQwen2
    pack(model)
    if compile:
        compile_step(model)
    return model
