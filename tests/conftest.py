"""Shared test helpers: tiny random Qwen2 checkpoints built with transformers
(the independent reference) and saved with save_pretrained. Nothing is downloaded."""

import functools

import numpy as np
import pytest
import torch

torch.set_num_threads(1)  # tiny models: one thread is fastest and leaves a core for subprocess tests


def make_hf_model(path, seed=0, max_shard_size=None, **overrides):
    """Build a random HF Qwen2ForCausalLM (eager attention, fp32), save it to `path`
    and return it. A larger-than-default init std makes the output distribution peaked,
    so greedy argmaxes are far from ties and token-for-token comparisons are meaningful."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
               initializer_range=0.15, attn_implementation="eager")
    cfg.update(overrides)
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(str(path), **kw)
    return hf


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the tests of a module that asks for it (`pytestmark =
    pytest.mark.usefixtures("one_thread")`), two being this suite's default: tiny models on
    shared cores run faster with one thread than with two that wait for each other, and an
    in-process run then gives the same bits as a subprocess started with
    OMP_NUM_THREADS=1 (CPU kernels may split sums by thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_hf(tmp_path):
    """(hf_model, path) for the default tiny config."""
    path = tmp_path / "tiny"
    return make_hf_model(path), str(path)


def hf_greedy(hf, prompts, max_new, eos_id=None, pad_id=0):
    """HF greedy generation (the reference), the prompts left-padded with an attention mask
    -> generated ids per prompt, cut after the first EOS (HF pads finished rows).
    Memoised: many tests compare with the same references."""
    key = tuple(tuple(p) for p in prompts)
    return [list(r) for r in _hf_greedy(hf, key, max_new, eos_id, pad_id)]


@functools.cache
@torch.no_grad()
def _hf_greedy(hf, prompts, max_new, eos_id, pad_id):
    from transformers import GenerationConfig

    L = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts])
    att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos_id, pad_token_id=pad_id)
    out = hf.generate(input_ids=ids, attention_mask=att, generation_config=gc)[:, L:].tolist()
    return tuple(tuple(r[: r.index(eos_id) + 1] if eos_id in r else r) for r in out)


def write_rows(path, n, seed):
    """n random rows of 8..40 tokens (ids < 256), loss on a tail of each: a prepared file."""
    rng = np.random.default_rng(seed)
    ids, loss, off = [], [], [0]
    for _ in range(n):
        length = int(rng.integers(8, 41))
        prompt = int(rng.integers(2, length - 2))
        ids += rng.integers(0, 256, length).tolist()
        loss += [0] * prompt + [1] * (length - prompt)
        off.append(len(ids))
    np.savez(path, ids=np.array(ids, np.int32), loss=np.array(loss, np.uint8), offsets=np.array(off))


def first_mid_step_token(steps):
    """A token whose first occurrence is accepted with more tokens after it in the same
    step -> (token, index in the output)."""
    out = []
    for s in steps:
        toks = s.tokens[0]
        for i, t in enumerate(toks[:-1]):
            if t not in out + toks[:i]:
                return t, len(out) + i
        out += toks
    raise AssertionError("no multi-token step")
