"""Exact mode's guarantee in the compiled path (issues 39 and 40): in bf16 the engine's compiled
decoding step (fast.make_fast(model, compile=True)) keeps the row invariance that makes exact mode
bf16 AR (fast/linear.py, "Row invariance"), on this machine's kernels and, by construction, on
kernels that compute another function at every shape.
Apart from tests/test_compile.py so that the two files' compile times fall on the two workers."""

import pytest
import torch
from conftest import graphs_built
from test_bf16 import (
    MASK,
    ONE_KEY_BLOCK,
    SMALL,
    ShapeDependentKernels,
    differing,
    prompts_of,
    tiles_removed_from_attention,
    tiles_removed_from_matmuls,
    tiny_bf16,
)

import fast
import fast.attention
import fast.linear
from exact import generate_exact
from fast.step import compile_step
from generate import generate_ar

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


def three_decoders(model, prompts, new, mask_id):
    """AR in a batch (the reference: tests/test_bf16.py's `differing` compares with it), AR on
    each prompt alone and exact mode K = 2 on the batch: three graphs -> {name: replies},
    exact mode's tokens per forward."""
    exact = generate_exact(model, prompts, block_size=4, drafts=2, max_new_tokens=new, mask_id=mask_id)
    out = {"AR batch": [g.ids for g in generate_ar(model, prompts, new)],
           "AR alone": [generate_ar(model, [p], new)[0].ids for p in prompts],
           "exact K=2 batch": [g.ids for g in exact]}
    return out, sum(len(g.ids) for g in exact) / sum(g.forwards for g in exact)


@torch.no_grad()
def test_compiled_exact_mode_in_bf16_is_compiled_bf16_ar():
    """Exact mode's guarantee in the compiled path (bf16, this machine's kernels, inductor): with
    the step compiled, AR alone and exact mode K = 2 in a batch give AR's tokens in the batch,
    token for token. Each is its own graph (4, 1 and 4 x 9 rows): the row-invariance tiles
    (fast/) must survive fusion. Drafts are accepted (the verification path runs): a
    16-token vocabulary and SmolLM2's widths, as tests/test_bf16.py has them eagerly."""
    torch.set_num_threads(2)
    before = graphs_built()
    out, tpf = three_decoders(compile_step(tiny_bf16(seed=2, layers=1)), prompts_of(2), 24, MASK)
    assert graphs_built() == before + 3  # three steps, compiled
    assert differing(out) == []
    assert tpf > 1.05  # drafts accepted: the verification path ran


@torch.no_grad()
@pytest.mark.parametrize("tiles", [True, False])
def test_compiled_row_invariance_holds_whatever_the_kernels_do_at_each_shape(monkeypatch, tiles):
    """The construction, compiled: with stand-in kernels that compute another function at every
    shape of call (tests/test_bf16.py's ShapeDependentKernels, traced into the graph), the
    engine's compiled exact mode K = 2 in a batch and AR alone equal AR in the batch, because
    every matmul and attention call of a bf16 step has one shape (the row tile; QUERY_TILE query
    rows against one key block). The proof can fail: with the rows as they come (the matmul and
    attention tiles removed), the same compiled decoders differ. One layer (its inductor compile
    is the test's time; the construction is the same in every layer, and a layer's rounding
    alone flips tokens: the mutation fails)."""
    kernels = ShapeDependentKernels(monkeypatch)
    if not tiles:
        tiles_removed_from_matmuls(monkeypatch)
        tiles_removed_from_attention(monkeypatch)
    before = graphs_built()
    model = fast.make_fast(tiny_bf16(2, engine=False, layers=1, width=SMALL, std=0.2), compile=True)
    out, tpf = three_decoders(model, prompts_of(2, n=3), 16, MASK)
    assert graphs_built() >= before + 3  # the stand-ins ran inside the compiled steps (more graphs: breaks)
    assert (differing(out) == []) == tiles
    assert tpf > 1.05
    if tiles:  # every call of a step (and of the eager prefills) at the tile's shape
        assert kernels.called("matmul") == {(fast.linear.row_tile(torch.device("cpu")), None)}
        assert kernels.called("attention") == {(fast.attention.QUERY_TILE, ONE_KEY_BLOCK)}
