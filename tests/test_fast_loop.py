"""Proofs for fast/loop.py, greedy AR and the τ window with the whole step on the device (issue
49's first pieces): their tokens are generate.generate_ar's and generate.generate's (float64, a
ragged batch, EOS ids that end rows in the middle of a chunk, chunks of 1, 3 and 8 steps, τ = 1,
0.5, 0.2, drafts accepted), eager and compiled whole (fullgraph=True, dynamo's aot_eager backend:
one graph for two requests of one batch size, and for two τ); and a step reads nothing back from
the device (it runs on the meta device, where every read-back raises)."""

import copy

import pytest
import torch
from conftest import graphs_built
from test_fast_paths import tiny_model

import fast
from fast.cache import FastCache
from fast.loop import ar_step, generate_ar_device, generate_window_device, window_step
from generate import generate, generate_ar

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


MASK = 63


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.2])
def test_the_device_window_gives_the_reference_tokens(pair, tau):
    ref, _, engine = pair
    free = generate(ref, PROMPTS, block_size=4, tau=tau, max_new_tokens=20, mask_id=MASK)
    eos = {free[0].ids[3], free[1].ids[7]}
    for eos_ids, chunk in (((), 8), (eos, 3), (eos, 1)):
        want = [g.ids for g in generate(ref, PROMPTS, block_size=4, tau=tau, max_new_tokens=20, mask_id=MASK,
                                        eos_ids=eos_ids)]
        assert generate_window_device(engine, PROMPTS, 4, tau, 20, MASK, eos_ids, chunk) == want
    if tau == 0.2:  # drafts were accepted: more than one token per forward
        assert sum(len(g.ids) for g in free) > sum(g.forwards for g in free)


def test_the_window_step_compiles_whole_once_for_two_requests_and_two_taus(pair, fresh_dynamo):
    ref, eos, engine = pair
    step = torch.compile(window_step, fullgraph=True, backend="aot_eager", dynamic=False)
    before = graphs_built()
    for prompts, tau in ((PROMPTS, 0.5), ([[7, 7], [3], [9, 9, 9, 9]], 0.2)):
        want = [g.ids for g in generate(ref, prompts, block_size=4, tau=tau, max_new_tokens=16, mask_id=MASK,
                                        eos_ids=eos)]
        assert generate_window_device(engine, prompts, 4, tau, 16, MASK, eos, 4, step) == want
    assert graphs_built() - before == 1


def test_a_window_step_reads_nothing_back_from_the_device():
    model = fast.make_fast(tiny_model(3, 2).double().eval()).to("meta")
    cfg, N, B = model.config, 3, 4
    cache = FastCache(cfg.num_hidden_layers, N, cfg.num_key_value_heads, cfg.head_dim, 40, 2 * B,
                      torch.float64, "meta", static=True)
    z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device="meta")
    window_step(model, z(N, B), z(N), cache.k, cache.v, cache.lengths, z(N, 8 + B), z(N),
                z(N, dtype=torch.bool), z(2), 8, z((), dtype=torch.float32), MASK)
