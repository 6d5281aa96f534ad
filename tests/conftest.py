"""Shared test helpers: tiny random Qwen2 checkpoints built with transformers
(the independent reference) and saved with save_pretrained. Nothing is downloaded."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


@pytest.fixture
def tiny_hf(tmp_path):
    """(hf_model, path) for the default tiny config."""
    path = tmp_path / "tiny"
    return make_hf_model(path), str(path)


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
