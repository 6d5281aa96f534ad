"""Proofs that model.py loads and saves checkpoints the way transformers does, and refuses
bad ones by name. The reference is HF (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`AutoModelForCausalLM`) on tiny random checkpoints written by transformers itself:

  * a Llama checkpoint (no q/k/v biases) gives HF's logits and saves back as Llama;
  * the authors' MARS release (model_type "a2d-qwen2", docs/spec.md §2's unchanged weights)
    loads as Qwen2;
  * what we save loads in transformers with equal logits; transformers-4 and minimal
    config.json files mean what transformers reads; loading builds no random copy;
  * bad checkpoints fail with a message naming the file and the key.

The model-equals-HF proofs themselves (logits, masks, bf16, greedy, cache) are in test_model.py.
"""

import json
import os
import re

import pytest
import torch
from conftest import hf_float64
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_model import ATOL64, assert_order_one, make_ref, rand_ids

from model import Qwen2

# ------------------------------------------- Llama and the authors' MARS release load too

def make_llama(path, seed=0, **overrides):
    """A tiny random HF LlamaForCausalLM (no biases, random norm weights), saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.15,
               attn_implementation="eager") | overrides
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(2000 + seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("tied", [True, False])
def test_llama_logits_equal_hf_and_save_back_as_llama(tmp_path, tied):
    """Llama = Qwen2 without q/k/v biases: built with no bias tensor at all, so the model has
    exactly the checkpoint's parameters, and what we save is a llama checkpoint again."""
    from transformers import AutoModelForCausalLM

    hf = make_llama(tmp_path / "src", tie_word_embeddings=tied)
    model = Qwen2.from_pretrained(str(tmp_path / "src"))
    assert not model.config.attention_bias and model.model.layers[0].self_attn.q_proj.bias is None
    assert set(model.state_dict()) | {"lm_head.weight"} == set(hf.state_dict()) | {"lm_head.weight"}
    idx = rand_ids((2, 40), seed=11)
    with torch.no_grad():
        ref = hf(idx).logits  # fp32: what the saved copy must give, bit for bit
        assert_order_one(ref)
        with hf_float64(hf):  # the same computation: float64, where rounding is not the question
            ref64 = hf(idx).logits
        model64 = Qwen2.from_pretrained(str(tmp_path / "src"), dtype=torch.float64)
        assert (model64(idx) - ref64).abs().max().item() <= ATOL64
    model.save_pretrained(str(tmp_path / "ours"))
    back, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), attn_implementation="eager",
                                                      output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == "LlamaForCausalLM" and back.config.tie_word_embeddings == tied
    with torch.no_grad():
        assert torch.equal(back.eval()(idx).logits, ref)


def test_authors_a2d_qwen2_release_loads_as_qwen2(tmp_path):
    """The released MARS checkpoints (Xalphinions/MARS-Qwen2.5-*) are HF Qwen2 weights whose
    config.json says model_type "a2d-qwen2" (the dllm converter's name, with its extra keys),
    and which store the tied head as well."""
    hf = make_ref(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(model_type="a2d-qwen2", architectures=["A2DQwen2LMHeadModel"], mask_token_id=255,
             use_mrope=False, layer_types=["full_attention"] * d["num_hidden_layers"])
    (tmp_path / "config.json").write_text(json.dumps(d))
    rewrite_weights(tmp_path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    model = Qwen2.from_pretrained(str(tmp_path), dtype=torch.float64)
    assert model.config.attention_bias and model.lm_head.weight is model.model.embed_tokens.weight
    idx = rand_ids((2, 40), seed=12)
    with torch.no_grad(), hf_float64(hf):
        ref = hf(idx).logits
        assert (model(idx) - ref).abs().max().item() <= ATOL64


# ------------------------------------------------- save -> transformers, load -> no copy

@pytest.mark.parametrize("tied", [True, False])
def test_saved_model_loads_in_transformers(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    hf = make_ref(tmp_path / "src", tie_word_embeddings=tied, rope_theta=777.0, rms_norm_eps=1e-3)
    model = Qwen2.from_pretrained(str(tmp_path / "src"))
    model.save_pretrained(str(tmp_path / "ours"))
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not tied)  # a tied head is stored once
    assert keys | {"lm_head.weight"} == set(hf.state_dict()) | {"lm_head.weight"}

    back, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), attn_implementation="eager",
                                                      output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == "Qwen2ForCausalLM"
    assert back.config.rope_parameters["rope_theta"] == 777.0  # transformers 5 reads our theta
    assert back.config.rms_norm_eps == 1e-3 and back.config.tie_word_embeddings == tied
    idx = rand_ids((2, 30), seed=6)
    with torch.no_grad():
        ref = hf(idx).logits
        out = back.eval()(idx).logits
    assert_order_one(ref)
    assert torch.equal(out, ref)  # same weights, same code: bit-identical


def test_transformers4_style_config_loads(tmp_path):
    """Hub Qwen2.5 checkpoints were written by transformers 4: top-level rope_theta,
    rope_scaling null, torch_dtype, no rope_parameters. Same theta as HF reads."""
    from transformers import AutoModelForCausalLM

    make_ref(tmp_path, rope_theta=321.0)
    cfg_path = tmp_path / "config.json"
    d = json.loads(cfg_path.read_text())
    rope = d.pop("rope_parameters")
    d.update(rope_theta=rope["rope_theta"], rope_scaling=None, torch_dtype=d.pop("dtype"),
             sliding_window=4096, max_window_layers=21)
    cfg_path.write_text(json.dumps(d))
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert ref_model.config.rope_parameters["rope_theta"] == 321.0
    model = Qwen2.from_pretrained(str(tmp_path), dtype=torch.float64)
    assert model.config.rope_theta == 321.0
    idx = rand_ids((1, 40), seed=7)
    with torch.no_grad(), hf_float64(ref_model):
        assert (model(idx) - ref_model(idx).logits).abs().max().item() <= ATOL64


def test_minimal_config_means_what_transformers_reads(tmp_path):
    """A config.json that leaves keys out gets transformers' Qwen2 defaults for them
    (untied head, rope_theta 1e4), not the 0.5B defaults of our dataclass: otherwise an
    untied checkpoint's stored lm_head would be silently replaced by the embedding."""
    from transformers import AutoModelForCausalLM

    hf = make_ref(tmp_path, tie_word_embeddings=False)
    keep = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads")
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: d[k] for k in keep}))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert not back.config.tie_word_embeddings and back.config.rope_parameters["rope_theta"] == 10000.0
    model = Qwen2.from_pretrained(str(tmp_path), dtype=torch.float64)
    idx = rand_ids((1, 40), seed=8)
    with torch.no_grad():
        assert torch.equal(back(idx).logits, hf(idx).logits)
        with hf_float64(back):
            assert (model(idx) - back(idx).logits).abs().max().item() <= ATOL64


def test_from_pretrained_builds_no_random_copy(tmp_path, monkeypatch):
    """Loading must not materialise a randomly initialised model first (for 7B that is
    a second 15 GB copy): any nn.init call may only touch meta tensors. The loaded
    parameters are real, trainable and equal the file's tensors."""
    make_ref(tmp_path, tie_word_embeddings=False, max_shard_size="40KB")
    touched = []
    for fn in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_", "trunc_normal_"):
        orig = getattr(torch.nn.init, fn)

        def spy(tensor, *a, _orig=orig, **kw):
            touched.append(tensor.device.type)
            return _orig(tensor, *a, **kw)
        monkeypatch.setattr(torch.nn.init, fn, spy)
    model = Qwen2.from_pretrained(str(tmp_path))
    monkeypatch.undo()
    assert touched and set(touched) == {"meta"}  # init ran (nn.Linear does) but only on meta

    files = {}
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            files.update(load_file(str(tmp_path / f)))
    params = dict(model.named_parameters())
    assert set(params) == set(files)
    for k, p in params.items():
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad, k
        assert not p.is_meta and torch.equal(p.data, files[k]), k
    for name, buf in model.named_buffers():
        assert not buf.is_meta, name
    hd = model.config.head_dim
    assert torch.equal(model.inv_freq, 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd)))


def test_tied_head_is_the_embedding_after_loading(tmp_path):
    make_ref(tmp_path)
    model = Qwen2.from_pretrained(str(tmp_path))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # counted once


# --------------------------------------------------------------------- bad input

@pytest.fixture
def ckpt(tmp_path):
    make_ref(tmp_path, tie_word_embeddings=False)
    return tmp_path


def rewrite_weights(path, edit):
    file = str(path / "model.safetensors")
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})
    return file


def raises_naming(exc, *parts):
    """pytest.raises whose message must contain every part (file path, key name)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(str(p))})" for p in parts))


def test_missing_config_json(ckpt):
    os.remove(ckpt / "config.json")
    with raises_naming(FileNotFoundError, ckpt / "config.json"):
        Qwen2.from_pretrained(str(ckpt))


def test_no_weight_file(ckpt):
    os.remove(ckpt / "model.safetensors")
    with raises_naming(FileNotFoundError, ckpt, "model.safetensors"):
        Qwen2.from_pretrained(str(ckpt))


def test_wrong_shape(ckpt):
    key = "model.layers.1.mlp.up_proj.weight"
    file = rewrite_weights(ckpt, lambda s: s.update({key: s[key][:-1].clone()}))
    with raises_naming(ValueError, file, key, "(127, 64)", "(128, 64)"):
        Qwen2.from_pretrained(str(ckpt))


def test_wrong_shape_in_a_shard_names_the_shard(tmp_path):
    make_ref(tmp_path, max_shard_size="40KB")
    key = "model.layers.0.self_attn.k_proj.bias"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = str(tmp_path / index["weight_map"][key])
    state = load_file(shard)
    state[key] = torch.zeros(3)
    save_file(state, shard, metadata={"format": "pt"})
    with raises_naming(ValueError, shard, key):
        Qwen2.from_pretrained(str(tmp_path))


def test_missing_shard_file(tmp_path):
    make_ref(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = index["weight_map"]["model.norm.weight"]
    os.remove(tmp_path / name)
    with raises_naming(FileNotFoundError, tmp_path / "model.safetensors.index.json", name):
        Qwen2.from_pretrained(str(tmp_path))


def test_missing_key(ckpt):
    key = "model.layers.0.post_attention_layernorm.weight"
    rewrite_weights(ckpt, lambda s: s.pop(key))
    with raises_naming(KeyError, ckpt, key):
        Qwen2.from_pretrained(str(ckpt))


def test_untied_checkpoint_without_lm_head_is_missing_key(ckpt):
    rewrite_weights(ckpt, lambda s: s.pop("lm_head.weight"))
    with raises_naming(KeyError, ckpt, "lm_head.weight"):
        Qwen2.from_pretrained(str(ckpt))


def test_unexpected_key(ckpt):
    key = "model.layers.0.self_attn.rotary_emb.inv_freq"
    file = rewrite_weights(ckpt, lambda s: s.update({key: torch.zeros(8)}))
    with raises_naming(KeyError, file, key):
        Qwen2.from_pretrained(str(ckpt))


def test_unsupported_model_type(ckpt):
    d = json.loads((ckpt / "config.json").read_text())
    d["model_type"] = "mistral"
    (ckpt / "config.json").write_text(json.dumps(d))
    with raises_naming(ValueError, ckpt / "config.json", "model_type", "mistral", "unsupported"):
        Qwen2.from_pretrained(str(ckpt))


def test_qwen2_weights_labelled_llama_name_the_bias(ckpt):
    """A llama config.json means no q/k/v biases: a stored bias is an unexpected key."""
    d = json.loads((ckpt / "config.json").read_text())
    d["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(d))
    with raises_naming(KeyError, ckpt / "model.safetensors", "unexpected key", "_proj.bias"):
        Qwen2.from_pretrained(str(ckpt))


@pytest.mark.parametrize("key, value", [("attention_bias", True), ("mlp_bias", True),
                                        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
                                        ("hidden_act", "gelu"), ("pretraining_tp", 2)])
def test_unsupported_llama_settings_are_named(tmp_path, key, value):
    make_llama(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.pop("rope_parameters", None)
    d[key] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with raises_naming(ValueError, tmp_path / "config.json", key if key != "rope_scaling" else "rope"):
        Qwen2.from_pretrained(str(tmp_path))


def test_config_missing_required_key(ckpt):
    d = json.loads((ckpt / "config.json").read_text())
    del d["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(d))
    with raises_naming(ValueError, ckpt / "config.json", "hidden_size"):
        Qwen2.from_pretrained(str(ckpt))
