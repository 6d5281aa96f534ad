"""The static decoding step and `--compile` (issue 40, issue 48): the engine's step of fixed shape
over a static KV cache (fast.step.static_hidden over a fast.cache.FastCache) gives the reference's
outputs (the plain model.Qwen2 over its growing kvcache.KVCache), and the compiled step gives the
reference's tokens with no recompile after the warm-up.

Proof 1 (float64, where rounding is not the question): every decoder (AR, exact mode, the τ
loop with the window and the block cache) on a ragged batch, once by the reference and once by
the engine with the static layout (the cache read whole, every step padded to its decoder's
fixed width, written by index: what a compiled step runs, here run eagerly); same tokens and
the same logits to 1e-12. Proof 2 (float64, inductor): sampled decoders draw the reference's
tokens through the compiled step. Proof 3 (float32, inductor): the compiled decoders give the
reference's tokens, their step logits stay within a bound measured here, and a 64-token decode
after the warm-up builds no graph. Proof 4: the static step reads nothing back from the device
(run on the meta device, where every read-back raises). The models are tiny so that compiling
stays a few seconds a graph. tests/test_engine.py proves the rest of the engine (every swap,
every decoder, dynamo's eager backends) against the reference.
"""

import copy

import pytest
import torch
from conftest import graphs_built

import fast
from exact import generate_exact, step_input
from fast.cache import FastCache
from fast.linear import FastLinear, pack, packed_linear
from fast.step import static_hidden, switch_step
from generate import generate, generate_ar
from kvcache import KVCache
from model import Qwen2, Qwen2Config, init_weights
from sampling import Sampling

MASK = 63


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


def tiny(dtype, seed=0):
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return init_weights(Qwen2(cfg), std=0.3, seed=seed).to(dtype).eval()


def ragged(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g)
    return [torch.randint(0, MASK, (int(L),), generator=g).tolist() for L in lengths]


def every_decoder(model, prompts, new=20):
    out = {"AR": [g.ids for g in generate_ar(model, prompts, new)]}
    for K in (1, 2):
        out[f"exact K={K}"] = [g.ids for g in generate_exact(model, prompts, block_size=4, drafts=K,
                                                            max_new_tokens=new, mask_id=MASK)]
    for cache in ("window", "block"):
        out[cache] = [g.ids for g in generate(model, prompts, block_size=4, tau=0.4, max_new_tokens=new,
                                              mask_id=MASK, cache=cache, block_cache_size=6)]
    return out


def static_steps(engine):
    """Run the engine's decoding steps through the compiled step's code, not compiled
    (fast.step.static_hidden) -> (real, seen): per step, (the tokens the decoder forwards, the
    cache's fixed width), and the tokens the static step ran (padded)."""
    seen = []

    def step(model, idx, position_ids, attn_mask, k, v, lengths):
        seen.append(idx.shape[1])
        return static_hidden(model, idx, position_ids, attn_mask, k, v, lengths)

    real = []
    hidden = engine.hidden

    def spy(idx, position_ids=None, attn_mask=None, cache=None):
        if cache is not None and cache.commits:
            real.append((idx.shape[1], cache.width))
        return hidden(idx, position_ids, attn_mask, cache)

    switch_step(engine, step)
    engine.hidden = spy
    return real, seen


@torch.no_grad()
def test_the_static_step_equals_the_growing_cache_in_float64():
    """Every decoder, ragged batch of 3, float64: the engine with the static layout
    (fast.step.static_hidden run eagerly in place of the compiled step) gives the reference's
    tokens (the plain model, its growing cache), every step padded to its decoder's width; and
    one padded step's logits over a static cache equal the reference's to 1e-12."""
    reference = tiny(torch.float64)
    engine = fast.make_fast(copy.deepcopy(reference))
    prompts = ragged()
    before = every_decoder(reference, prompts)
    real, seen = static_steps(engine)
    after = every_decoder(engine, prompts)
    assert after == before
    assert len(set(map(len, prompts))) > 1  # the rows really are ragged
    assert seen and [W for _, W in real] == seen  # every step ran static, at its decoder's width
    assert any(T < W for T, W in real)  # ... and padded to their decoder's width
    # one step: 5 new tokens on ragged prefixes, static cache (whole, index writes, padded to 8) vs growing
    idx = torch.randint(0, MASK, (3, 9), generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([4, 2, 3])
    logits = []
    for model, width in ((reference, 5), (engine, 8)):
        cache = model.new_cache(3, 20, step=width)
        model.hidden(idx[:, :4], cache=cache)
        cache.commit(lens)
        logits.append(model.lm_head(model.hidden(idx[:, 4:], cache=cache)))
    assert type(cache) is FastCache and cache.static  # the engine's step compiled: its caches are static
    assert cache.k.shape[3] == 512 and cache.width == 8  # read whole (one key block), steps of 8
    assert type(reference.new_cache(3, 20)) is KVCache
    assert seen[-1] == 8 and real[-1] == (5, 8)  # the step ran static, padded from 5 to 8
    torch.testing.assert_close(logits[1], logits[0], atol=1e-12, rtol=0)


@torch.no_grad()
def test_compiled_sampled_decoders_draw_the_eager_tokens_in_float64():
    """Sampling through the compiled step: every decoder (AR, exact K = 2, the τ loop with the
    window and the block cache) at temperature 0.8 with top-k and top-p, row generators seeded
    alike, draws with the engine's step compiled (inductor) the tokens the reference draws
    eagerly. In float64 the compiled logits are the reference's to ~1e-15, so a draw could only
    differ on a boundary that close; a sampled decode is where `--compile` must change nothing
    but the speed."""
    reference = tiny(torch.float64, seed=3)
    prompts = ragged(seed=3)
    s = Sampling(temperature=0.8, top_k=20, top_p=0.95, seed=5)

    def draws(model):
        kw = dict(block_size=4, max_new_tokens=16, mask_id=MASK, sampling=s)
        out = {"AR": [g.ids for g in generate_ar(model, prompts, 16, sampling=s)],
               "exact K=2": [g.ids for g in generate_exact(model, prompts, drafts=2, **kw)]}
        for cache in ("window", "block"):
            out[cache] = [g.ids for g in generate(model, prompts, tau=0.4, cache=cache, block_cache_size=6,
                                                  **kw)]
        return out

    eager = draws(reference)
    before = graphs_built()
    engine = fast.make_fast(copy.deepcopy(reference), compile=True)
    assert draws(engine) == eager
    assert graphs_built() >= before + 4  # each decoder's step compiled
    assert eager["AR"] != [g.ids for g in generate_ar(reference, prompts, 16)]  # the draws are not greedy


# compiled engine step - reference step (F.linear, growing cache), fp32 logits of size ~3: measured
# 1.6e-6 unpacked and 2.4e-6 packed on a 2-core AMD EPYC with AVX512-BF16, torch 2.13, inductor
# (compiled - eager step before issue 48: 1.7e-6 on an AVX2-only EPYC): an 8x margin or more
COMPILED_LOGITS_ATOL = 2e-5


@torch.no_grad()
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_decoders_give_the_eager_tokens_and_never_recompile(packed):
    """float32, inductor: the engine's compiled AR and exact K = 2 decoders give the reference's
    tokens on a ragged batch (the model's argmax margins are far above the bound below,
    checked), one compiled step's logits are within COMPILED_LOGITS_ATOL of the reference's
    step, and a 64-token decode after the warm-up builds no new graph. Packed: the weights as
    fast.make_fast leaves them (packed for oneDNN), which a compiled step reads through the op
    mars::packed_linear; unpacked: the packed copies dropped, F.linear in the graph."""
    reference = tiny(torch.float32, seed=1)
    engine = fast.make_fast(copy.deepcopy(reference))
    linears = [m for m in engine.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is FastLinear and m.packed is not None for m in linears)
    if not packed:
        for m in linears:
            m.packed = None
    prompts = ragged(seed=1)
    eager_ar = [g.ids for g in generate_ar(reference, prompts, 64)]
    eager_ex = [g.ids for g in generate_exact(reference, prompts, block_size=4, drafts=2, max_new_tokens=64,
                                              mask_id=MASK)]
    before = graphs_built()
    fast.step.compile_step(engine)
    generate_ar(engine, prompts, 4)  # warm-up: compiles the AR step of this batch
    generate_exact(engine, prompts, block_size=4, drafts=2, max_new_tokens=4, mask_id=MASK)
    built = graphs_built()
    assert built == before + 2  # the AR and the exact step, compiled (not run eagerly)
    compiled_ar = [g.ids for g in generate_ar(engine, prompts, 64)]
    compiled_ex = [g.ids for g in generate_exact(engine, prompts, block_size=4, drafts=2, max_new_tokens=64,
                                                 mask_id=MASK)]
    assert graphs_built() == built  # no recompile
    assert compiled_ar == eager_ar and compiled_ex == eager_ex == eager_ar
    # one AR step on ragged prefixes: the compiled engine (static cache) against the reference
    tok = torch.tensor([[5], [6], [7]])
    lens = torch.tensor([3, 1, 2])
    steps = []
    for model in (reference, engine):
        cache = model.new_cache(3, 70)
        model.hidden(torch.tensor([p[:3] for p in prompts]), cache=cache)
        cache.commit(lens)
        steps.append(model.lm_head(model.hidden(tok, cache=cache)))
    assert cache.static and graphs_built() == built  # the engine's step ran compiled: this batch's AR graph
    eager, compiled = steps
    err = (compiled - eager).abs().max().item()
    print(f"compiled engine - reference step logits: {err:.2e}")
    assert err <= COMPILED_LOGITS_ATOL, err
    top2 = eager.float().topk(2, -1).values
    assert (top2[..., 0] - top2[..., 1]).min().item() > 100 * COMPILED_LOGITS_ATOL  # no near-tie to flip


def test_every_shape_is_compiled_past_dynamos_default_limit(monkeypatch, eager_compile):
    """Each decoder, batch size and dtype is a graph of the one function fast.step.static_hidden;
    past dynamo's default of 8 graphs a function, a new shape would run eagerly, silently.
    Twelve batch sizes of AR give twelve graphs (dynamo's eager backend: the guards and the
    limit are dynamo's, and the test needs no inductor compile)."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # the default, whatever ran before
    model = fast.make_fast(tiny(torch.float32), compile=True)
    before = graphs_built()
    for n in range(1, 13):
        generate_ar(model, [[1, 2, 3]] * n, 2)
    assert graphs_built() == before + 12


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_step_reads_no_length_back(dtype):
    """The engine's static step syncs nothing with the host (a host sync inside the step would
    break a CUDA graph and stall the compiled step): the engine, its static cache and every
    input on the meta device, where a tensor has no data, so every read-back (int, float,
    bool, .item(), .tolist(), a copy to the CPU) raises; the steps of each decoder's shape
    (AR; the window's, padded to its width; exact mode's, with positions and a mask) run
    through the compiled step's code (fast.step.static_hidden) all the same. In bfloat16
    the tiles and whole key blocks run too. The guard can fail: the reference's cache, which
    reads the lengths back once per forward, is refused by it."""
    engine = fast.make_fast(tiny(dtype))
    switch_step(engine, static_hidden)  # the compiled step's code, run eagerly (no dynamo to hide a read)
    engine.to("meta")
    C = engine.config.hidden_size
    cache = engine.new_cache(2, 20, step=9)
    assert cache.static and cache.lengths.is_meta and cache.k.is_meta
    assert cache.fixed_shapes == (dtype == torch.bfloat16)
    idx = torch.zeros(2, 9, dtype=torch.long, device="meta")
    engine.hidden(idx[:, :5], cache=cache)  # the prefill (eager, static cache)
    cache.commit(torch.tensor([3, 5]))
    assert engine.hidden(idx[:, :1], cache=cache).shape == (2, 1, C)  # AR step, padded to 9
    assert engine.hidden(idx[:, :6], cache=cache).shape == (2, 6, C)  # a window step
    tokens, positions, mask = step_input([1, 2], [[3, 4], [5]], 2, cache.lengths, MASK)
    assert tokens.shape == (2, 9) and positions.is_meta
    assert engine.hidden(tokens, positions, mask, cache).shape == (2, 9, C)  # an exact K = 2 step
    cache.commit(torch.tensor([1, 2]))
    with pytest.raises((RuntimeError, NotImplementedError)):  # the guard catches a read-back:
        KVCache(2, 2, 2, 8, 20, device="meta").begin(1)  # the reference's begin reads the lengths


@torch.no_grad()
def test_the_packed_op_reads_the_packed_copy_while_the_weight_is_unchanged():
    """mars::packed_linear (what a compiled step calls for a packed FastLinear) reads the module's
    packed copy, and F.linear once the weight changed in place: shown with a copy packed from
    zeros under the weight's key (the bias alone where it is read)."""
    torch.manual_seed(0)
    lin, x = FastLinear(16, 8), torch.randn(3, 16)
    pack(lin)
    assert lin.packed is not None
    lin.packed = (lin.packed[0], torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16), 8))
    assert torch.equal(packed_linear(x, lin.weight, lin.bias, lin.slot), lin.bias.expand(3, 8))
    lin.weight.mul_(2)  # an in-place change: the packed copy is stale
    assert torch.equal(packed_linear(x, lin.weight, lin.bias, lin.slot),
                       torch.nn.functional.linear(x, lin.weight, lin.bias))

