"""Proofs for fast/loop.py, greedy AR with the whole step on the device (issue 49's first piece):
its tokens are generate.generate_ar's (float64, a ragged batch, EOS ids that end rows in the
middle of a chunk, chunks of 1, 3 and 8 steps), eager and compiled whole (fullgraph=True, dynamo's
aot_eager backend: one graph for two requests of one batch size); and a step reads nothing back
from the device (it runs on the meta device, where every read-back raises)."""

import copy

import pytest
import torch
from conftest import graphs_built
from test_fast_paths import tiny_model

import fast
from fast.cache import FastCache
from fast.loop import ar_step, generate_ar_device
from generate import generate_ar

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def pair():
    """The reference in float64, its greedy replies, EOS ids that stop rows 0 and 1 early, and
    the engine made from a copy."""
    ref = tiny_model(3, 2).double().eval()
    free = [g.ids for g in generate_ar(ref, PROMPTS, 20)]
    eos = {free[0][5], free[1][10]}
    return ref, eos, fast.make_fast(copy.deepcopy(ref))


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_the_device_loop_gives_the_reference_tokens(pair, chunk):
    ref, eos, engine = pair
    for eos_ids in ((), eos):
        want = [g.ids for g in generate_ar(ref, PROMPTS, 20, eos_ids=eos_ids)]
        assert generate_ar_device(engine, PROMPTS, 20, eos_ids, chunk) == want
    lengths = [len(r) for r in generate_ar_device(engine, PROMPTS, 20, eos, chunk)]
    assert min(lengths) < 20 and len(set(lengths)) == 3  # EOS ended rows at different steps, mid-chunk


def test_the_step_compiles_whole_once_for_two_requests(pair, fresh_dynamo):
    ref, eos, engine = pair
    step = torch.compile(ar_step, fullgraph=True, backend="aot_eager", dynamic=False)
    before = graphs_built()
    for prompts in (PROMPTS, [[7, 7], [3], [9, 9, 9, 9]]):
        want = [g.ids for g in generate_ar(ref, prompts, 16, eos_ids=eos)]
        assert generate_ar_device(engine, prompts, 16, eos, 4, step) == want
    assert graphs_built() - before == 1


def test_a_step_reads_nothing_back_from_the_device():
    """ar_step on the meta device: an .item(), .tolist(), bool(), float() or int() of a tensor
    inside it raises (the reference's cache, whose begin reads the lengths back, does)."""
    model = fast.make_fast(tiny_model(3, 2).double().eval()).to("meta")
    cfg, N = model.config, 3
    cache = FastCache(cfg.num_hidden_layers, N, cfg.num_key_value_heads, cfg.head_dim, 40, 1,
                      torch.float64, "meta", static=True)
    z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device="meta")
    ar_step(model, z(N, 1), cache.k, cache.v, cache.lengths, z(N, 8), z(N), z(N, dtype=torch.bool), z(2), 8)
    reads_back = FastCache(cfg.num_hidden_layers, N, cfg.num_key_value_heads, cfg.head_dim, 40, 1,
                           torch.float64, "meta")  # not static: its begin reads the lengths back
    with pytest.raises((NotImplementedError, RuntimeError)):
        reads_back.begin(1)
