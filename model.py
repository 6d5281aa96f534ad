"""Qwen2 / Qwen2.5 decoder, written by hand, loading Hugging Face safetensors directly.

This is the plain autoregressive model that MARS fine-tunes. MARS adds no
parameter, head or module (docs/spec.md §1-§3): everything the method needs from the
model is the freedom to pass

  * explicit position ids  (the noisy stream re-uses the clean stream's positions, §3),
  * an explicit boolean attention mask (the two-stream mask of §3, the exact-mode
    verify/draft mask, padding), True = "may attend",
  * a KV cache (kvcache.KVCache) that holds already-processed tokens (§6).

Numerics follow transformers' Qwen2 so that logits agree to ~1e-6 in fp32:
RMSNorm in fp32 then cast back before the weight; rotate-half RoPE with inv_freq
in fp32 and cos/sin cast to the activation dtype; q/k/v with bias, o without;
softmax in fp32 (scaled_dot_product_attention); residual adds in the model dtype.
Parameter names are HF's (model.layers.N.self_attn.q_proj, ...), so a
checkpoint loads by name and what we save loads in transformers.

Which config.json files load (`Qwen2Config.from_hf_dict`): `qwen2` (Qwen2 / Qwen2.5);
`a2d-qwen2`, the authors' released MARS checkpoints, which are plain Qwen2 weights under
another name; and `llama` without rope scaling or biases (e.g. SmolLM2, converted by
scripts/convert_gguf.py). A Llama model is a Qwen2 model without the q/k/v biases: we
build it with no bias tensors (`attention_bias=False`) rather than with zero ones, so
it has exactly the checkpoint's parameters and saves back as a `llama` config.json.
"""

import itertools
import math
import os
import weakref
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from kvcache import KVCache, round_up
from util.atomic import atomic_write, write_json
from util.files import BadFileError, check_fields, open_safetensors, read_json_object
from util.precision import LOW_PRECISION, cpu_bf16_units, dtype_name, onednn_packs_bf16

# config.json model_type -> whether q/k/v carry biases (the only difference we model)
MODEL_TYPES = {"qwen2": True, "a2d-qwen2": True, "llama": False}
# the config.json keys without a default; each, and the kv heads and positions, is an int >= 1
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class Qwen2Config:
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads (as in every Qwen2.5 config)
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    attention_bias: bool = True  # q/k/v biases: Qwen2 has them, Llama not (saved as model_type llama)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config") -> "Qwen2Config":
        """Read the fields we use from an HF config.json dict; refuse what we cannot run."""
        model_type = d.get("model_type", "qwen2")
        if model_type not in MODEL_TYPES:
            raise BadFileError(source, f"unsupported model_type {model_type!r} "
                                       f"(implemented: {', '.join(MODEL_TYPES)})")
        d = dict(d)
        _check_supported(d, model_type, source)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in d and "rope_theta" in rope:  # transformers >= 5 nests it
            d["rope_theta"] = rope["rope_theta"]
        names = {f.name for f in fields(cls)}
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise BadFileError(source, f"missing key(s) {missing}")
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        check_fields(source, kw, cls, positive=REQUIRED + ("num_key_value_heads", "max_position_embeddings"))
        kw["attention_bias"] = MODEL_TYPES[model_type]
        kw.setdefault("num_key_value_heads", d["num_attention_heads"])
        # a key config.json leaves out means what transformers' Qwen2Config / LlamaConfig
        # says (the same for both), not the 0.5B defaults above: an untied checkpoint must
        # not be silently tied
        kw.setdefault("tie_word_embeddings", False)
        kw.setdefault("rope_theta", 10000.0)
        try:
            return cls(**kw)
        except ValueError as e:  # __post_init__: the heads do not group
            raise BadFileError(source, e) from None

    @classmethod
    def from_json(cls, path: str) -> "Qwen2Config":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        return cls.from_hf_dict(read_json_object(path), source=path)

    def to_hf_dict(self) -> dict:
        d = asdict(self)
        # both spellings, so transformers 4.x and 5.x read the same theta
        d.update(hidden_act="silu", attention_dropout=0.0,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        if self.attention_bias:
            del d["attention_bias"]  # Qwen2 always has the biases; its config has no such key
            d.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                     use_sliding_window=False, sliding_window=None)
        else:
            d.update(model_type="llama", architectures=["LlamaForCausalLM"], mlp_bias=False)
        return d


def _check_supported(d: dict, model_type: str, source: str):
    """Refuse the config.json settings that change the computation and that we do not build."""
    if d.get("use_sliding_window"):
        raise BadFileError(source, "use_sliding_window=true is not supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise BadFileError(source, f"unsupported rope type {rope!r}")
    if d.get("hidden_act", "silu") != "silu":
        raise BadFileError(source, f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
    if model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise BadFileError(source, f"{key}=true is not supported for a llama model "
                                           "(only Llama without biases)")
        if d.get("pretraining_tp", 1) != 1:
            raise BadFileError(source, f"pretraining_tp={d['pretraining_tp']} is not supported")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in fp32 (fp64 stays fp64), cast back *before* the weight multiply (HF order)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: Qwen2Config, device=None):
    """RoPE's inverse frequencies theta^(-2i/hd), i < hd/2, in fp32 (HF's default rope)."""
    hd = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=device) / hd))


def rope_cos_sin(position_ids, inv_freq, dtype):
    """cos/sin tables for rotate-half RoPE. position_ids (N, T) -> (N, 1, T, hd) each."""
    freqs = position_ids[..., None].float() * inv_freq  # (N, T, hd/2), fp32
    emb = torch.cat((freqs, freqs), dim=-1)  # (N, T, hd)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Linear(nn.Linear):
    """nn.Linear, plus an optional second copy of the weight packed for oneDNN's CPU matmul
    (`pack_for_decoding`). The packed copy is used only where no gradient is wanted (decoding),
    on CPU inputs of the weight's dtype (fp32 or bf16), and only while the weight is the one it
    was packed from (same storage, no in-place change since): otherwise, and always in
    training, this is F.linear.

    Row invariance (bf16, fp16; see "Row invariance" below): without gradients the rows go
    through the matmul in tiles of exactly ROW_TILE rows, so every call has one shape."""

    packed = None  # (weight key, packed tensor), set by pack_for_decoding
    # oneDNN keeps a buffer of the output's size for every row count it has run, so the packed
    # copy serves small row counts only (a bounded set: ROW_TILE in bf16); prefills and
    # teacher-forced forwards of fp32 models take F.linear, whose cost per row is low there
    packed_max_rows = 64

    def forward(self, x):
        if torch.is_grad_enabled() or x.dtype not in LOW_PRECISION:
            return self.product(x)
        rows = x.reshape(-1, x.shape[-1])  # (M, C_in)
        return in_tiles(self.product, rows, row_tile(x.device)).reshape(*x.shape[:-1], -1)

    def product(self, x):
        p = self.packed
        if p is not None and not torch.is_grad_enabled() and x.dtype == self.weight.dtype and x.is_cpu \
                and x.numel() <= self.packed_max_rows * x.shape[-1]:
            if torch.compiler.is_compiling():  # one opaque call in the graph (inductor cannot trace oneDNN's)
                return packed_linear(x, self.weight, self.bias, self.slot)
            return from_packed(p, x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def from_packed(packed, x, weight, bias):
    """x @ weight.T + bias from `packed` (a Linear's packed copy, or None), or F.linear if `weight`
    is not the one it was packed from (another storage, or changed in place since)."""
    if packed is None or packed[0] != _weight_key(weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed[1], bias, "none", [], "")


_SLOTS = itertools.count()
PACKED = weakref.WeakValueDictionary()  # slot -> a Linear with a packed copy (a compiled step names it so)


def _packed_linear(x, weight, bias, slot):
    """Linear.product's packed matmul as one opaque call of a compiled step (inductor cannot
    trace oneDNN's packed op; its own fp32 prepacking, MKL's, is 1.6x slower at 9 rows here):
    the packed copy of Linear PACKED[slot], or F.linear if `weight` is not the one it was packed
    from. A plain library op: torch.library.custom_op's wrapper costs ~100 us a call."""
    m = PACKED.get(slot)
    return from_packed(None if m is None else m.packed, x, weight, bias)


_LIB = torch.library.Library("mars", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, int slot) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("mars::packed_linear", lambda x, weight, bias, slot:
                            x.new_empty(*x.shape[:-1], weight.shape[0]), lib=_LIB)
packed_linear = torch.ops.mars.packed_linear


def _weight_key(w):
    """What identifies a weight's values cheaply: its storage and in-place version counter."""
    return w.data_ptr(), w._version


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias  # Qwen2: q/k/v biases; Llama: none
        self.q_proj = Linear(cfg.hidden_size, self.n_head * self.hd, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.o_proj = Linear(self.n_head * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache=None):
        N, T, _ = x.shape
        q = self.q_proj(x).view(N, T, self.n_head, self.hd).transpose(1, 2)  # (N, nh, T, hd)
        k = self.k_proj(x).view(N, T, self.n_kv, self.hd).transpose(1, 2)  # (N, nkv, T, hd)
        v = self.v_proj(x).view(N, T, self.n_kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            # the new K/V go into the cache slots right after each row's committed
            # tokens; we attend over the cached prefix plus these new slots
            k, v = cache.write(self.layer_idx, k, v)  # (N, nkv, S, hd)
        if cache is not None and cache.fixed_shapes:  # LOW_PRECISION decoding: row invariance
            y = attend_tiled(q, k, v, mask, self.hd ** -0.5)  # (N, nh, T, hd)
        else:
            y = attend(q, k, v, mask, self.hd ** -0.5)
        return self.o_proj(y.transpose(1, 2).reshape(N, T, self.n_head * self.hd))


CAUSAL = "causal"  # build_mask's mask for plain causal attention over T == S tokens: no mask tensor


@dataclass(frozen=True)
class TwoStreamMask:
    """The mask of an input [first stream, l tokens | second stream] whose first l queries
    are plain causal over the first l keys and see no key after them: the clean stream of
    MARS training (docs/spec.md §3, built by mars.two_stream_window). Attention then runs as two
    calls, causal over the first l tokens (no mask tensor, as plain AR), and the second
    stream's queries against all T keys with the explicit `rows`; the (T, T) mask is never
    materialised. Equal to the full mask as a tensor (tests/test_fast_paths.py)."""
    rows: torch.Tensor  # (T - l, T) or (N, T - l, T) bool: the mask rows of the second stream


# ------------------------------------------------------------------ row invariance
# A bf16 (or fp16) output keeps 8 significant bits, so two summation orders of the same row,
# equal to ~1e-7 in fp32, round apart now and then, and the next layers carry that ulp on.
# Matmul and attention kernels pick their summation order by the shape of the call (oneDNN:
# AMX tiles, AVX-512 or AVX2 code and how to split a sum over threads; cuBLAS and the CUDA
# attention kernels: tiles and split-K), so the same row could come out differently alone
# (an AR step), among a batch, or among exact mode's drafts. Exact mode is exact only if it
# does not (exact.py). So in LOW_PRECISION, without gradients, decoding calls each kernel at
# ONE shape whatever the batch, the decoder or the step:
#   * every Linear: tiles of exactly `row_tile` rows (the rows of all batch rows together,
#     the last tile padded): 16 on a CPU with bf16 units, where the packed matmul streams
#     the weights once for up to 16 rows at about one row's cost; 1 (each row alone) on a
#     CPU that emulates bf16, where every row costs its own arithmetic anyway; 128 on CUDA;
#   * every attention over a KV cache: tiles of exactly QUERY_TILE query rows against the
#     whole cache, whose slot count is a multiple of kvcache.KEY_BLOCK (slots a row may not
#     see are masked; a fully masked key block adds exact zeros).
# What this assumes of a kernel is only that it gives every row of one call the same
# arithmetic (true of a matmul: a row is one sum per output, whatever its neighbours), and
# that attention treats each (batch row, head) as its own problem. tests/test_bf16.py proves
# the construction with kernels made to sum differently at every shape.
ROW_TILE = {"cpu": 16, "cpu without bf16 units": 1, "cuda": 128}
QUERY_TILE = 32  # the CPU's flash attention splits queries in blocks of 32 below 192 queries


_cpu_row_tile = []  # the CPU's row tile, asked once: the answer holds for the process


def row_tile(device):
    """Rows per matmul call in LOW_PRECISION decoding on `device` (one number per machine)."""
    if device.type == "cuda":
        return ROW_TILE["cuda"]
    if not _cpu_row_tile:
        _cpu_row_tile.append(ROW_TILE["cpu" if cpu_bf16_units()[0] else "cpu without bf16 units"])
    return _cpu_row_tile[0]


def padded(x, n, dim):
    """x and copies of its first row along `dim`, n rows in all (the tiles' padding)."""
    shape = x.shape[:dim] + (n - x.shape[dim],) + x.shape[dim + 1:]
    return torch.cat([x, x.narrow(dim, 0, 1).expand(shape)], dim)


def in_tiles(f, x, n):
    """f over the rows of x (M, C) in calls of exactly n rows, the last tile padded -> (M, C')."""
    M = x.shape[0]
    x = padded(x, -(-M // n) * n, 0)
    return torch.cat([f(t) for t in x.split(n)])[:M]


def tiled_mask(mask, g, dtype):
    """attend_tiled's mask, made once per forward for every layer: mask (N, 1, T, S) bool ->
    (N, 1, n, S) in `dtype`, row j*T + t the mask of query t (for each of the g query heads
    that share a kv head), n = g*T rounded up to QUERY_TILE rows; 0 where a row may attend and
    -inf elsewhere, the additive mask sdpa makes of a bool one (so the same arithmetic)."""
    T = mask.shape[2]
    allowed = padded(mask.repeat(1, 1, g, 1), round_up(g * T, QUERY_TILE), 2)  # (N, 1, n, S) bool
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, float("-inf"))


def attend_tiled(q, k, v, mask, scale):
    """`attend` at one shape per call (LOW_PRECISION decoding over a KV cache, see above): q (N,
    nh, T, hd) over the whole cache k, v (N, nkv, S, hd), mask (N, 1, n, S) from `tiled_mask`.
    The g query heads that share a kv head become query rows of that head (grouped-query
    attention without copying K/V), and those g*T rows go to sdpa QUERY_TILE at a time."""
    N, nh, T, hd = q.shape
    nkv, n = k.shape[1], mask.shape[2]  # n: g*T query rows, padded to whole tiles by tiled_mask
    g = nh // nkv
    assert mask.dtype != torch.bool and n == round_up(g * T, QUERY_TILE), "the mask is tiled_mask's"
    rows = padded(q.reshape(N, nkv, g * T, hd), n, 2)  # row j*T + t: query t of head kv*g + j
    y = torch.cat([F.scaled_dot_product_attention(rows[:, :, i:i + QUERY_TILE], k, v, scale=scale,
                                                  attn_mask=mask[:, :, i:i + QUERY_TILE])
                   for i in range(0, n, QUERY_TILE)], 2)  # (N, nkv, n, hd)
    return y[:, :, :g * T].reshape(N, nh, T, hd)


def attend(q, k, v, mask, scale):
    """Attention of q (N, nh, T, hd) over k, v (N, nkv, S, hd) -> (N, nh, T, hd), each kv
    head shared by nh / nkv query heads (grouped-query attention). The softmax runs in
    fp32 inside sdpa. mask: a bool tensor (N or 1, 1, T, S), True = may attend; None =
    every key; CAUSAL (T == S, sdpa's own causal mask); or a TwoStreamMask."""
    if isinstance(mask, TwoStreamMask):
        l = q.shape[2] - mask.rows.shape[-2]
        rows = mask.rows if mask.rows.dim() == 2 else mask.rows[:, None]  # (1 or N, 1, T - l, T)
        first = attend(q[:, :, :l], k[:, :, :l], v[:, :, :l], CAUSAL, scale)  # (N, nh, l, hd)
        return torch.cat([first, attend(q[:, :, l:], k, v, rows, scale)], dim=2)
    if k.shape[1] != q.shape[1] and isinstance(mask, torch.Tensor) and q.is_cuda:
        # CUDA's fused kernels that take a mask do not take grouped heads (sdpa would fall
        # back to its slow math path): share the kv heads by copying them instead
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    causal = isinstance(mask, str)  # CAUSAL
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask, is_causal=causal,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `Qwen2Model`: embeddings, layers, final norm (named to match the checkpoint)."""

    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def build_mask(T, attn_mask=None, cache=None):
    """The mask handed to attention (see `attend`) for T new tokens.

    `attn_mask` relates the T tokens of this call to each other, (T, T) or (N, T, T) bool,
    True = may attend, or a TwoStreamMask; None means plain causal. With a cache (placed
    by cache.begin), every committed cached token of the row is visible as well, and the
    new tokens sit at slots lengths[b] .. lengths[b]+T-1, so the mask is placed at that
    offset per row: (N, 1, T, S), S = cache.span.
    """
    if cache is None:
        if attn_mask is None:
            return CAUSAL
        if isinstance(attn_mask, TwoStreamMask):
            return attn_mask
        return attn_mask[None, None] if attn_mask.dim() == 2 else attn_mask[:, None]
    if isinstance(attn_mask, TwoStreamMask):
        raise ValueError("a TwoStreamMask is a training mask: it takes no KV cache")
    lengths, S = cache.lengths, cache.span  # (N,), int (span: end; the whole cache in bf16)
    if attn_mask is None and T == 1 and cache.at is not None and S == cache.end and not cache.fixed_shapes:
        return None  # one new token per row, all rows at the same slot: it sees every key
    j = torch.arange(S, device=lengths.device)
    if attn_mask is None:  # causal from each row's length: new token t sees slots <= lengths[b] + t
        last = lengths[:, None] + torch.arange(T, device=lengths.device)  # (N, T)
        return (j <= last[:, :, None])[:, None]  # (N, 1, T, S)
    if attn_mask.dim() == 2:
        attn_mask = attn_mask[None]
    rel = j[None, :] - lengths[:, None]  # (N, S) slot index relative to the new tokens
    new = attn_mask.expand(lengths.shape[0], T, T)
    in_new = (rel >= 0) & (rel < T)
    picked = torch.gather(new, 2, rel.clamp(0, T - 1)[:, None, :].expand(-1, T, -1))  # (N, T, S)
    mask = (rel < 0)[:, None, :] | (in_new[:, None, :] & picked)
    return mask[:, None]


class Qwen2(nn.Module):
    """HF's `Qwen2ForCausalLM`: a backbone plus an LM head (tied to the embeddings or not)."""

    def __init__(self, cfg: Qwen2Config):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.gradient_checkpointing = False
        self.compiled_hidden = None  # set by compile_decoding: decoding steps run through it

    def hidden(self, idx, position_ids=None, attn_mask=None, cache=None):
        """Final-norm hidden states (N, T, C); the LM head is applied by the caller.

        idx (N, T) token ids; position_ids (N, T), default: slot index (after the
        cached tokens with a cache); attn_mask, see build_mask; cache: kvcache.KVCache
        (written at each row's length, never committed here: the caller decides
        which new tokens to keep, docs/spec.md §6).
        """
        N, T = idx.shape
        if cache is not None:
            cache.begin(T)  # where the T new tokens go, once for the mask and every layer's write
        if position_ids is None:
            position_ids = torch.arange(T, device=idx.device)[None].expand(N, T)
            if cache is not None:
                position_ids = position_ids + cache.lengths[:, None]
        mask = build_mask(T, attn_mask, cache)
        if cache is not None and cache.fixed_shapes:  # row invariance: attend_tiled's mask
            mask = tiled_mask(mask, self.config.num_attention_heads // self.config.num_key_value_heads,
                              cache.k.dtype)
        x = self.model.embed_tokens(idx)  # (N, T, C)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache)
        return self.model.norm(x)

    def forward(self, idx, position_ids=None, attn_mask=None, cache=None):
        """Logits (N, T, V) for every position."""
        return self.lm_head(self.hidden(idx, position_ids, attn_mask, cache))

    def step(self, idx, position_ids=None, attn_mask=None, cache=None):
        """`hidden` for one decoding step over a KV cache: the compiled step when
        compile_decoding ran (its cache is then static), else `hidden` itself. Decoders call
        this for every forward of a fixed shape, and `hidden` for the prefill."""
        if self.compiled_hidden is None:
            return self.hidden(idx, position_ids, attn_mask, cache)
        return self.compiled_hidden(self, idx, position_ids, attn_mask, cache.k, cache.v, cache.lengths)

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu"):
        """Load an HF-layout directory (config.json + model.safetensors or a sharded
        model.safetensors.index.json). The module is built on the meta device and the
        tensors are assigned straight from the files: no random copy in memory."""
        cfg = Qwen2Config.from_json(os.path.join(path, "config.json"))
        with torch.device("meta"):
            model = cls(cfg)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight")
        state = {}
        by_file = {}
        for key, file in _weight_files(path).items():
            by_file.setdefault(file, []).append(key)
        for file, keys in by_file.items():
            with open_safetensors(file, device) as f:
                for key in keys:
                    if key == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints store the head too; it is the embedding
                    if key not in expected:
                        raise KeyError(f"{file}: unexpected key {key!r} (not a parameter of the "
                                       f"{cfg.to_hf_dict()['model_type']} model config.json describes)")
                    t = f.get_tensor(key)
                    if t.shape != expected[key]:
                        raise ValueError(f"{file}: tensor {key!r} has shape {tuple(t.shape)}, "
                                         f"expected {tuple(expected[key])} from config.json")
                    state[key] = t.to(dtype)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise KeyError(f"{path}: missing weight(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(cfg, device)  # buffers are not in the files
        return model

    def save_pretrained(self, path):
        """config.json + model.safetensors in HF layout (a tied head is stored once)."""
        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        # safetensors writes by file name; the temp file is reopened only to be fsynced
        atomic_write(os.path.join(path, "model.safetensors"),
                     lambda f: save_file(state, f.name, metadata={"format": "pt"}), mode="wb")
        d = self.config.to_hf_dict()
        d["torch_dtype"] = dtype_name(next(self.parameters()).dtype)
        write_json(os.path.join(path, "config.json"), d)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # a tied matrix counts once


def _weight_files(path):
    """Map every tensor name to the safetensors file that holds it."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        with open_safetensors(single) as f:
            return {k: single for k in f.keys()}
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise BadFileError(index, "no 'weight_map' object of tensor name -> file name")
        out = {}
        for key, name in weight_map.items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index}: shard {name!r} (for {key!r}) not found")
            out[key] = file
        return out
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                            "(only safetensors weights are loaded)")


def pack_for_decoding(model: Qwen2, rows: int = ROW_TILE["cpu"]) -> Qwen2:
    """Give every fp32 or bf16 CPU `Linear` a copy of its weight packed once for oneDNN's matmul
    (the ops torch.compile's CPU prepacking uses when the row count varies); in place, returns
    the model; checkpoint.load_checkpoint calls it. `rows`: the row count oneDNN lays it out for.

    Why: from the packed copy the 1-20 rows of a decoding step cost about one row's time, one
    row less than through F.linear (SmolLM2, 2 threads: results/SPEED.md, issue 22 and 30).
    Parameters, names, values and the head tie stay; training, gradients and a weight changed
    since packing use F.linear. The price: a second copy of every weight matrix, and oneDNN's
    buffers per row count (~220 MB for SmolLM2; larger forwards than `Linear.packed_max_rows`
    take F.linear). Results differ from F.linear's by rounding only (tests/test_fast_paths, test_bf16).
    bf16 weights stay unpacked where oneDNN refuses them (a CPU without AVX512BW/VL/DQ or
    AVX-NE-CONVERT, or capped below them by ONEDNN_MAX_CPU_ISA): they decode through F.linear."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return model
    dtypes = (torch.float32, torch.bfloat16) if onednn_packs_bf16() else (torch.float32,)
    with torch.no_grad():
        for module in model.modules():
            w = module.weight if isinstance(module, Linear) else None
            if w is not None and w.dtype in dtypes and w.is_cpu:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
                module.packed = (_weight_key(w), packed)
                module.slot = next(_SLOTS)
                PACKED[module.slot] = module
    return model


def static_hidden(model, idx, position_ids, attn_mask, k, v, lengths):
    """model.hidden over a static cache made of the cache's own tensors (what compile_decoding
    compiles: tensors in, so a new request's cache is no new input to guard on)."""
    return model.hidden(idx, position_ids, attn_mask, KVCache.over(k, v, lengths))


def compile_decoding(model: Qwen2, mode: str | None = None) -> Qwen2:
    """Compile the model's decoding step with torch.compile (in place; returns the model).

    Every decoder (generate.py, exact.py) then runs each forward of a fixed shape through the
    compiled step, over a static KV cache (kvcache.py): one graph per decoder and batch,
    compiled on first use, no recompile after. mode: torch.compile's; default "reduce-overhead"
    on CUDA (CUDA graphs: one launch per step) and inductor's default on the CPU, where the
    matmuls of packed weights stay the eager step's oneDNN calls (op mars::packed_linear, which
    inductor keeps opaque) and inductor fuses the rest; the cache is written in place
    (KVCache.write's index_put_, no copy of it). (`options={"freezing": True}` of torch 2.13 left
    the graph as it was here, and inductor's own fp32 prepacking, MKL's, is slower than
    oneDNN's at 9 rows: not used.) Prefills (any length) stay eager. The arithmetic is the eager
    step's, fused: in fp32 it may round apart (tests/test_compile.py measures how far); in bf16
    the row-invariance tiles are in the graph. On the CPU, `emulate_precision_casts` keeps the
    eager step's roundings to bf16 between ops that fusion would otherwise skip (the fp32
    arithmetic in between may still differ; SmolLM2, 12 prompts, 48 tokens, AMD EPYC with
    AVX512-BF16: 10/12 replies = eager with it, 8/12 without; results/SPEED.md). Not on CUDA,
    where it also turns off Triton's fused multiply-adds, unmeasured there."""
    device = next(model.parameters()).device
    row_tile(device)  # asked before tracing: the CPU check is no graph to compile
    mode = mode or ("reduce-overhead" if device.type == "cuda" else "default")
    # torch.compile takes a mode or options, not both: the mode's options, and ours
    options = dict(torch._inductor.list_mode_options(mode), emulate_precision_casts=device.type == "cpu")
    # one graph per decoder, batch size and dtype, all of the one function static_hidden: past
    # dynamo's default of 8 a new shape would run eagerly, silently (bench_decode's 2 dtypes x
    # 4 decoders x 2 batch sizes did); 64 graphs per function, as many as the 256 in all allow
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    model.compiled_hidden = torch.compile(static_hidden, dynamic=False, options=options)
    return model


def init_weights(model: Qwen2, std: float = 0.02, seed: int | None = None):
    """Random init for models trained from scratch (the tiny default): N(0, std),
    zero biases, unit norms, output projections scaled by 1/sqrt(2 n_layers)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    n = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                s = std / math.sqrt(2 * n) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
    return model
