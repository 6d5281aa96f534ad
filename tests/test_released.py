"""Proof that the authors' released MARS checkpoints load and decode here (docs/spec.md §2, §5).

`Xalphinions/MARS-Qwen2.5-0.5B-blk4` and its siblings are HF Qwen2 weights saved with
config.json `model_type` "a2d-qwen2" (the dllm converter's name and keys, the tied head
stored as well) and a Qwen2.5 tokenizer with `<|mask|>` added right after Qwen2.5's 22
added tokens (151665). Nothing can be downloaded here, so a tiny checkpoint is written the
same way: a random HF Qwen2 model, a tiny Qwen2.5-style tokenizer with a `<|mask|>` entry,
no mars.json. It must load in our model and tokenizer, the mask id must come from the
checkpoint, and τ = 1 decoding must equal HF greedy. The entry sits three ids past the 22
(the release's sits right after them, which is also the id a loader would derive, highest + 1,
were it to ignore the entry): so only a loader that reads the entry finds it.
"""

import json

import pytest
import torch
from conftest import make_hf_model
from greedy_margin import assert_no_near_tie
from safetensors.torch import load_file, save_file

from checkpoint import load_checkpoint
from data.bpe import QWEN25_ADDED_TOKENS, train_bpe
from generate import generate, generate_ar
from model import Qwen2
from tokenizer import Tokenizer

N_NEW = 24
TEXTS = ["<|im_start|>user\nWhat is 12 + 345?<|im_end|>\n<|im_start|>assistant\n12 + 345 = 357.<|im_end|>\n",
         "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(HF reference model, checkpoint dir, id of <|mask|>)."""
    path = tmp_path_factory.mktemp("a2d")
    tok = train_bpe(TEXTS, n_merges=60)
    mask_id = max(tok.added_tokens) + 3  # not right after the 22 (151665 in Qwen2.5): no default's id
    vocab = (mask_id + 1 + 63) // 64 * 64  # padded rows, as Qwen2.5's 151936
    hf = make_hf_model(path, vocab_size=vocab, hidden_size=64)
    tok.save(path)
    record = {"content": "<|mask|>", "lstrip": False, "normalized": False, "rstrip": False,
              "single_word": False, "special": True}
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"][str(mask_id)] = record
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    fast = json.loads((path / "tokenizer.json").read_text())
    fast["added_tokens"].append({"id": mask_id} | record)
    (path / "tokenizer.json").write_text(json.dumps(fast))
    d = json.loads((path / "config.json").read_text())
    d.update(model_type="a2d-qwen2", architectures=["A2DQwen2LMHeadModel"], mask_token_id=mask_id,
             use_mrope=False, layer_types=["full_attention"] * d["num_hidden_layers"])
    (path / "config.json").write_text(json.dumps(d))
    state = load_file(str(path / "model.safetensors"))  # the release stores the tied head too
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return hf, path, mask_id


def test_release_layout_gives_the_mask_id_its_tokenizer_lists(release):
    _, path, mask_id = release
    tok = Tokenizer.from_dir(path)
    assert not (path / "mars.json").exists()
    assert [tok.decode([tok.added_ids[n]]) for n in QWEN25_ADDED_TOKENS] == list(QWEN25_ADDED_TOKENS)
    vocab = Qwen2.from_pretrained(str(path)).config.vocab_size
    # the id differs from every one a loader could make up: highest + 1 without the entry or with
    # it, and the last row (the tests' usual stand-in)
    assert mask_id not in (tok.added_ids["<|file_sep|>"] + 1, mask_id + 1, vocab - 1)
    assert tok.mask_id == mask_id and load_checkpoint(str(path)).mask_id == mask_id
    assert tok.decode([mask_id]) == "<|mask|>"
    assert vocab > mask_id  # a padded row, no new parameter


def test_release_decodes_at_tau_1_equal_to_hf_greedy(release):
    hf, path, _ = release
    tok = Tokenizer.from_dir(path)
    model = Qwen2.from_pretrained(str(path)).eval()
    questions = ["What is 12 + 345?", "Repeat: the quick brown fox.", "Say hi."]
    prompts = [tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    refs = []
    for p in prompts:
        x = torch.tensor([p])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                          do_sample=False, pad_token_id=tok.pad_id)
        refs.append(out[0, len(p):].tolist())
    assert_no_near_tie(hf, prompts, refs)  # so a mismatch below is a bug, not fp32 rounding
    for B in (1, 4):
        got = generate(model, prompts, block_size=B, tau=1.0, max_new_tokens=N_NEW, mask_id=tok.mask_id)
        assert [g.ids for g in got] == refs
    assert [g.ids for g in generate_ar(model, prompts, N_NEW)] == refs
