"""Qwen2 / Qwen2.5 decoder, written by hand, loading Hugging Face safetensors directly.

This is the plain autoregressive model that MARS fine-tunes. MARS adds no parameter, head
or module (docs/spec.md §1-§3): all the method needs from the model is the freedom to pass
explicit position ids (the noisy stream re-uses the clean stream's positions, §3), an
explicit boolean attention mask (the two-stream mask of §3, exact mode's mask of §8,
padding; True = "may attend"), and a KV cache (kvcache.KVCache) of processed tokens (§6).

Numerics follow transformers' Qwen2 so that logits agree to ~1e-6 in fp32: RMSNorm in fp32
then cast back before the weight; rotate-half RoPE with inv_freq in fp32 and cos/sin cast to
the activation dtype; q/k/v with bias, o without; softmax in fp32 (scaled_dot_product_attention);
residual adds in the model dtype. Parameter names are HF's (model.layers.N.self_attn.q_proj,
...), so a checkpoint loads by name and what we save loads in transformers. config.json
model types: `qwen2`; `a2d-qwen2` (the authors' released MARS checkpoints: plain Qwen2
weights under another name); `llama` without rope scaling or biases (e.g. SmolLM2, via
scripts/convert_gguf.py), built with no bias tensors so it saves back as `llama`.

This is the reference: nn.Linear, one attention function, in the weights' dtype (float32,
or float64 for a student stepping through it). Its one question of the device: on CUDA a
masked attention copies the kv heads (`attend`: sdpa's fused kernels take no grouped heads
with a mask). What makes decoding fast on a given machine, and bf16 decoding batch-invariant,
is fast/ (docs/performance.md): it swaps modules of a loaded model from outside and is proven
equal to this file.
"""

import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from kvcache import KVCache
from util.atomic import atomic_write, write_json
from util.files import BadFileError, check_fields, check_hf_config, read_json_object, read_weights
from util.precision import dtype_name

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
        check_hf_config(d, model_type, source)
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


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias  # Qwen2: q/k/v biases; Llama: none
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.hd, cfg.hidden_size, bias=False)

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
        y = self.attention(q, k, v, mask)  # (N, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(N, T, self.n_head * self.hd))

    def attention(self, q, k, v, mask):
        """`attend` at this layer's scale 1/sqrt(hd) (a seam: fast/ swaps in a tiled one)."""
        return attend(q, k, v, mask, self.hd ** -0.5)


CAUSAL = "causal"  # build_mask's mask for plain causal attention over T == S tokens: no mask tensor


def attend(q, k, v, mask, scale):
    """Attention of q (N, nh, T, hd) over k, v (N, nkv, S, hd) -> (N, nh, T, hd), each kv
    head shared by nh / nkv query heads (grouped-query attention). The softmax runs in
    fp32 inside sdpa. mask: a bool tensor (N or 1, 1, T, S), True = may attend; None =
    every key; or CAUSAL (T == S, sdpa's own causal mask)."""
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
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

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
    True = may attend (MARS training's (2l, 2l) mask of §3, exact mode's of §8); None means
    plain causal. With a cache (placed by cache.begin), every committed cached token of the
    row is visible as well, and the new tokens sit at slots lengths[b] .. lengths[b]+T-1, so
    the mask is placed at that offset per row: (N, 1, T, S), S = cache.end.
    """
    if cache is None:
        if attn_mask is None:
            return CAUSAL
        return attn_mask[None, None] if attn_mask.dim() == 2 else attn_mask[:, None]
    lengths, S = cache.lengths, cache.end  # (N,), int: the slots attention reads
    if attn_mask is None and T == 1 and cache.at is not None and S == cache.at + 1:
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
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.gradient_checkpointing = False

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
        mask = self.attention_mask(T, attn_mask, cache)
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

    def attention_mask(self, T, attn_mask=None, cache=None):
        """The mask every layer's attention reads for T new tokens: `build_mask`'s (a seam:
        fast/ makes it once per forward in the form its tiled attention reads)."""
        return build_mask(T, attn_mask, cache)

    def new_cache(self, batch_size, max_len, step=1):
        """An empty KV cache in this model's dtype and device for `batch_size` rows of up to
        `max_len` committed tokens, with room for one forward of `step` tokens past them (the
        widest forward a decoder runs: its masks and drafts are written, never committed). A
        seam: fast/ makes its own cache here."""
        cfg, p = self.config, self.lm_head.weight
        return KVCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim,
                       max_len, step, p.dtype, p.device)

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
        skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()  # some tied checkpoints store it too
        what = f"the {cfg.to_hf_dict()['model_type']} model config.json describes"
        state = read_weights(path, expected, dtype, device, skip, what)
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
