"""Proofs for fast/loop.py, greedy AR, the τ window and exact mode with the whole step on the
device (issue 49): their tokens are generate.generate_ar's, generate.generate's and
exact.generate_exact's (float64, a ragged batch, EOS ids that end rows in the middle of a chunk,
chunks of 1, 3 and 8 steps, τ = 1, 0.5, 0.2 with drafts accepted, K = 1, 2, 4, budgets that cut
drafts), eager and compiled whole (fullgraph=True, dynamo's aot_eager backend: one graph for two
requests of one batch size with other prompts, budgets, EOS ids and τ); a request reuses its
shape's State; and a step reads nothing back from the device (it runs on the meta device, where
every read-back raises). The device loops pick greedily by the engine's block argmax (its model's,
spied on), and the τ rule keeps a probability equal to τ, as the reference's does (§5.4).
Sampling on the device: tests/test_device_sampling.py."""

import copy

import pytest
import torch
from conftest import graphs_built
from test_fast_paths import tiny_model

import fast
from exact import generate_exact, step_layout
from fast.argmax import block_argmax
from fast.loop import (
    State,
    ar_step,
    exact_step,
    generate_ar_device,
    generate_exact_device,
    generate_window_device,
    keep,
    start,
    window_step,
)
from generate import generate, generate_ar
from model import Qwen2, Qwen2Config, init_weights

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
        want = generate_ar(ref, PROMPTS, 20, eos_ids=eos_ids)
        assert generate_ar_device(engine, PROMPTS, 20, eos_ids, chunk) == want
    lengths = [len(r.ids) for r in generate_ar_device(engine, PROMPTS, 20, eos, chunk)]
    assert min(lengths) < 20 and len(set(lengths)) == 3  # EOS ended rows at different steps, mid-chunk


def test_the_step_compiles_whole_once_for_two_requests(pair, fresh_dynamo):
    ref, eos, engine = pair
    step = torch.compile(ar_step, fullgraph=True, backend="aot_eager", dynamic=False)
    before = graphs_built()
    for prompts, n, eos_ids in ((PROMPTS, 16, eos), ([[7, 7], [3], [9, 9, 9, 9]], 11, {5})):
        want = generate_ar(ref, prompts, n, eos_ids=eos_ids)
        assert generate_ar_device(engine, prompts, n, eos_ids, 4, step) == want
    assert graphs_built() - before == 1  # other prompts, budget and EOS ids: the same graph


def test_a_request_reuses_its_shapes_state(pair):
    """The second request of a shape runs in the first's tensors (its cache holds the first
    request's keys past every row's length: masked, the tokens are still the reference's)."""
    ref, eos, engine = pair
    long = [[1] * 30, [2] * 25, [3] * 28]
    first, _ = start(engine, "ar", long, [30, 25, 28], 1, 1, 20)
    generate_ar_device(engine, long, 20)
    second, _ = start(engine, "ar", PROMPTS, [3, 6, 1], 1, 1, 20)
    assert second is first and second.cache.k is first.cache.k
    assert generate_ar_device(engine, PROMPTS, 20) == generate_ar(ref, PROMPTS, 20)


def meta_state(B, width):
    model = fast.make_fast(tiny_model(3, 2).double().eval()).to("meta")
    return model, State(model, 3, 512, width, B)


def test_a_step_reads_nothing_back_from_the_device():
    """ar_step on the meta device: an .item(), .tolist(), bool(), float() or int() of a tensor
    inside it raises (the reference's cache, whose begin reads the lengths back, does)."""
    model, st = meta_state(1, 1)
    ar_step(model, st)
    reads_back = model.new_cache(3, 40, 1, static=False)  # not static: its begin reads the lengths back
    with pytest.raises((NotImplementedError, RuntimeError)):
        reads_back.begin(1)


MASK = 63


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.2])
def test_the_device_window_gives_the_reference_tokens(pair, tau):
    ref, _, engine = pair
    free = generate(ref, PROMPTS, block_size=4, tau=tau, max_new_tokens=20, mask_id=MASK)
    eos = {free[0].ids[3], free[1].ids[7]}
    for eos_ids, chunk in (((), 8), (eos, 3), (eos, 1)):
        want = generate(ref, PROMPTS, block_size=4, tau=tau, max_new_tokens=20, mask_id=MASK,
                                        eos_ids=eos_ids)
        assert generate_window_device(engine, PROMPTS, 4, tau, 20, MASK, eos_ids, chunk) == want
    if tau == 0.2:  # drafts were accepted: more than one token per forward
        assert sum(len(g.ids) for g in free) > sum(g.forwards for g in free)


def test_the_window_step_compiles_whole_once_for_two_requests_and_two_taus(pair, fresh_dynamo):
    ref, eos, engine = pair
    step = torch.compile(window_step, fullgraph=True, backend="aot_eager", dynamic=False)
    before = graphs_built()
    for prompts, tau, n in ((PROMPTS, 0.5, 16), ([[7, 7], [3], [9, 9, 9, 9]], 0.2, 13)):
        want = generate(ref, prompts, block_size=4, tau=tau, max_new_tokens=n, mask_id=MASK,
                                        eos_ids=eos)
        assert generate_window_device(engine, prompts, 4, tau, n, MASK, eos, 4, step) == want
    assert graphs_built() - before == 1


def test_a_window_step_reads_nothing_back_from_the_device():
    model, st = meta_state(4, 8)
    st.mask_id = MASK
    window_step(model, st)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_device_exact_mode_gives_the_reference_tokens(pair, K):
    """Greedy exact mode on the device = exact.generate_exact (which is greedy AR), with budgets
    that cut a row's drafts (20 and 7 new tokens) and a draft threshold."""
    ref, eos, engine = pair
    for n, eos_ids, chunk, threshold in (
            (20, (), 8, 0.0), (20, eos, 3, 0.0), (7, eos, 1, 0.0), (20, eos, 2, 0.3)):
        want = generate_exact(ref, PROMPTS, block_size=4, drafts=K, max_new_tokens=n,
                                              mask_id=MASK, eos_ids=eos_ids, draft_threshold=threshold)
        got = generate_exact_device(engine, PROMPTS, K, n, MASK, eos_ids, chunk, draft_threshold=threshold,
                                    block_size=4)
        assert got == want, (n, eos_ids, chunk, threshold)


def test_device_exact_mode_accepts_drafts():
    """A model whose mask predictions are right (its drafts are accepted), so the acceptance and
    the group G_a are exercised past a = 0: the tokens are still the reference's, in fewer steps."""
    ref = tiny_model(5, 2).double().eval()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [4, 4, 4, 4]]
    counted = generate_exact(ref, prompts, block_size=4, drafts=2, max_new_tokens=24, mask_id=MASK)
    assert all(g.forwards < len(g.ids) for g in counted)  # drafts were accepted in both rows
    engine = fast.make_fast(copy.deepcopy(ref))
    assert generate_exact_device(engine, prompts, 2, 24, MASK, (), 1) == counted


def test_the_exact_step_compiles_whole_once_for_two_requests(pair, fresh_dynamo):
    ref, eos, engine = pair
    step = torch.compile(exact_step, fullgraph=True, backend="aot_eager", dynamic=False)
    before = graphs_built()
    for prompts, n in ((PROMPTS, 16), ([[7, 7], [3], [9, 9, 9, 9]], 9)):
        want = generate_exact(ref, prompts, block_size=4, drafts=2, max_new_tokens=n, mask_id=MASK,
                                              eos_ids=eos)
        assert generate_exact_device(engine, prompts, 2, n, MASK, eos, 4, step) == want
    assert graphs_built() - before == 1


def test_an_exact_step_reads_nothing_back_from_the_device():
    model, st = meta_state(3, 9)
    st.mask_id, st.threshold = MASK, 0.3
    st.offsets, st.mask = step_layout(2, 2, "meta")
    exact_step(model, st)


def device_decodes(model, prompts, max_new=16, Ks=(1, 2, 4)):
    """The device loops' greedy replies that must all be AR's: AR on the batch and alone, exact
    mode (K in Ks) on the batch and alone -> {name: replies}, tokens/forward of exact mode."""
    from test_bf16 import MASK as M

    out = {"AR batch": [g.ids for g in generate_ar_device(model, prompts, max_new)],
           "AR alone": [generate_ar_device(model, [p], max_new)[0].ids for p in prompts]}
    tokens = forwards = 0
    for K in Ks:
        batch = generate_exact_device(model, prompts, K, max_new, M)
        out[f"exact K={K} batch"] = [g.ids for g in batch]
        out[f"exact K={K} alone"] = [generate_exact_device(model, [p], K, max_new, M)[0].ids for p in prompts]
        tokens, forwards = tokens + sum(len(g.ids) for g in batch), forwards + sum(g.forwards for g in batch)
    return out, tokens / forwards


@pytest.mark.parametrize("tile", [1, 4, 16])
def test_device_exact_mode_is_ar_whatever_the_kernels_do_at_each_shape(monkeypatch, tile):
    """Issue 49's batch invariance, for the device loops and at any row tile (the knob bench_gpu
    turns to find the cheapest on a GPU: fast.linear.set_row_tile): with tests/test_bf16.py's
    stand-in kernels, which compute another function at every shape of call, exact mode on the
    device (K = 1, 2, 4, alone and in a batch) is AR on the device, and AR alone is AR in the batch;
    every matmul is called at the tile's row count. With the tiles taken away the same check fails."""
    from test_bf16 import SMALL, ShapeDependentKernels, prompts_of, tiles_removed_from_matmuls, tiny_bf16

    cpu = torch.device("cpu")
    monkeypatch.setattr(fast.linear, "_cpu_row_tile", [fast.linear.row_tile(cpu)])  # restored after
    fast.linear.set_row_tile(cpu, tile)
    kernels = ShapeDependentKernels(monkeypatch)
    model, prompts = tiny_bf16(2, width=SMALL, std=0.2), prompts_of(2, n=3)
    out, tpf = device_decodes(model, prompts)
    assert all(replies == out["AR batch"] for replies in out.values()), out
    assert tpf > 1.05  # drafts were accepted
    assert kernels.called("matmul") == {(tile, None)}
    tiles_removed_from_matmuls(monkeypatch)
    broken, _ = device_decodes(model, prompts)
    assert any(replies != broken["AR batch"] for replies in broken.values())


def test_a_knobs_tau_changed_mid_request_is_read_as_the_reference_reads_it(pair, eager_compile):
    """fast.loop.device_decoder (the CLI's --device-loop) streams decoding.Steps, reading the knob's
    τ before every chunk: with chunks of one step, a τ changed after the third step gives the
    reference's mars_decode steps (read before every step), step for step."""
    from decoding import Knob
    from fast.loop import device_decoder
    from generate import mars_decode

    ref, eos, engine = pair
    decode = device_decoder(engine, block_size=4, max_new_tokens=20, mask_id=MASK, eos_ids=eos, chunk=1)
    runs = []
    for steps in (lambda k: mars_decode(ref, PROMPTS, block_size=4, tau=k, max_new_tokens=20, mask_id=MASK,
                                        eos_ids=eos, cache="window"),
                  lambda k: decode(PROMPTS, k)):
        knob, seen = Knob(1.0), []
        for i, step in enumerate(steps(knob)):
            seen.append((step.tokens, step.done, step.forwards, step.tau))
            if i == 2:
                knob.tau = 0.2
        runs.append(seen)
    assert runs[0] == runs[1]
    assert any(len(t) > 1 for s in runs[0][3:] for t in s[0])  # after the change, drafts were accepted


def test_generate_py_device_loop_gives_the_references_replies(tmp_path, capsys, eager_compile):
    """python generate.py --device-loop (in this process; dynamo's eager backend for the compile):
    AR, the τ window and exact mode give the reference's JSON records (ids, forwards, tokens per
    forward) on a tiny checkpoint, float32; a sampled run is reproducible; --cache block is a
    message, exit 2."""
    import json

    from conftest import make_hf_model

    import generate

    make_hf_model(tmp_path, seed=3)
    base = ["--ckpt", str(tmp_path), "--prompt-ids", "5,17,99,3,40", "--mask-id", "200", "--block-size", "4",
            "--max-new-tokens", "12", "--json", "--dtype", "float32"]

    def reply(*extra):
        assert generate.main(base + list(extra)) == 0
        return json.loads(capsys.readouterr().out.splitlines()[0])

    for mode in (["--tau", "1"], ["--tau", "0.3"], ["--exact", "--drafts", "2"]):
        assert reply(*mode, "--device-loop") == reply(*mode), mode
    sampled = ["--tau", "1", "--temperature", "1.5", "--seed", "4", "--device-loop"]
    assert reply(*sampled) == reply(*sampled) != reply("--tau", "1")
    assert generate.main(base + ["--device-loop", "--cache", "block"]) == 2
    assert "--device-loop decodes with --cache window" in capsys.readouterr().err


def test_the_streamed_steps_are_the_references_with_chunks_of_8(pair, eager_compile):
    """With chunks of 8 the device decoder yields the reference's steps, no more: the masked
    steps after the last row finished (in the last chunk) are not told, so the chat's count of
    forwards is the reference's."""
    from decoding import Knob
    from fast.loop import device_decoder
    from generate import mars_decode

    ref, eos, engine = pair
    for tau, prompts, n in ((0.5, PROMPTS, 20), (1.0, [[1, 2, 3]], 5)):
        want = [(s.tokens, s.done, s.forwards, s.tau) for s in mars_decode(
            ref, prompts, block_size=4, tau=Knob(tau), max_new_tokens=n, mask_id=MASK, eos_ids=eos,
            cache="window")]
        decode = device_decoder(engine, block_size=4, max_new_tokens=n, mask_id=MASK, eos_ids=eos, chunk=8)
        assert [(s.tokens, s.done, s.forwards, s.tau) for s in decode(prompts, Knob(tau))] == want


def test_a_device_request_is_checked_as_the_references(pair):
    ref, eos, engine = pair
    for prompts, n, what in (([[]], 5, "prompt 0 is empty"), ([[1, 999]], 5, "outside the vocabulary"),
                             ([[1, 2]], 0, "max_new_tokens must be >= 1")):
        for run in (lambda p, n: generate_ar_device(engine, p, n), lambda p, n: generate_ar(ref, p, n),
                    lambda p, n: generate_window_device(engine, p, 4, 0.5, n, MASK),
                    lambda p, n: generate_exact_device(engine, p, 2, n, MASK)):
            with pytest.raises(ValueError, match=what):
                run(prompts, n)


def test_a_chats_sampled_replies_go_on_drawing_and_seed_starts_over(pair, eager_compile):
    """As the reference's session generators: the same knob's second reply draws new numbers;
    the chat's /seed (knob.generators = None) starts the stream again."""
    from decoding import Knob
    from fast.loop import device_decoder
    from sampling import Sampling

    ref, eos, engine = pair
    decode = device_decoder(engine, block_size=4, max_new_tokens=12, mask_id=MASK)
    knob = Knob(1.0, Sampling(temperature=1.5, seed=3))
    reply = lambda: [t for s in decode([[1, 2, 3]], knob) for t in s.tokens[0]]
    first, second = reply(), reply()
    assert first != second
    knob.generators = None
    assert reply() == first


def test_states_are_few(pair):
    """At most MAX_STATES States (each a static KV cache) per model: the least recently used goes."""
    import fast.loop

    ref, eos, engine = pair
    for n in (20, 600, 1200, 1800, 2400, 3000):  # each a cache of other 512-slot blocks
        generate_ar_device(engine, [[1, 2]], 1)  # a budget of one: the prefill alone
        start(engine, "ar", [[1, 2]], [2], 1, 1, n)
    assert len(fast.loop._STATES[engine]) == fast.loop.MAX_STATES


def test_an_overflowing_temperature_draws_the_argmax_inside_the_vocabulary():
    """logits / 1e-40 overflow float32 (processed_probs is NaN there; the reference's multinomial
    raises): the device sampler draws the argmax, the limit temperature 0, never a token past V."""
    from fast.sample import candidates, draw
    from sampling import Sampling

    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0))
    got = candidates(logits, Sampling(temperature=1e-40), torch.arange(3), torch.tensor(5), block_argmax)
    assert torch.equal(got, logits.argmax(-1))
    nan = torch.full((4, 50), float("nan"))
    token = draw(nan, torch.full((4,), 0.5, dtype=torch.float64))
    assert ((token >= 0) & (token < 50)).all()


# ---------------------------------------------------------------- the greedy pick and τ at equality
V2, MASK2 = 256, 255  # a vocabulary of two 128-wide blocks: the block argmax runs its blocks


def two_block_pair():
    """A float64 reference over V2 tokens and the engine made from a copy."""
    cfg = Qwen2Config(vocab_size=V2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ref = init_weights(Qwen2(cfg), std=0.6, seed=5).double().eval()
    return ref, fast.make_fast(copy.deepcopy(ref))


def test_the_device_loops_pick_by_the_engines_block_argmax(monkeypatch):
    """make_fast changes only the model: the device loops take every greedy pick from it
    (FastQwen2.argmax, the block argmax, spied on here) over the whole vocabulary of two blocks,
    in AR, the τ window and exact mode, and give the reference's tokens."""
    ref, engine = two_block_pair()
    assert engine.argmax is block_argmax
    calls = []

    def counted(logits):
        calls.append(logits.shape[-1])
        return block_argmax(logits)
    monkeypatch.setattr(engine, "argmax", counted)
    runs = {
        "AR": (lambda m: generate_ar(m, PROMPTS, 12), lambda: generate_ar_device(engine, PROMPTS, 12)),
        "window": (lambda m: generate(m, PROMPTS, block_size=4, tau=0.3, max_new_tokens=12, mask_id=MASK2),
                   lambda: generate_window_device(engine, PROMPTS, 4, 0.3, 12, MASK2)),
        "exact": (lambda m: generate_exact(m, PROMPTS, block_size=4, drafts=2, max_new_tokens=12,
                                           mask_id=MASK2),
                  lambda: generate_exact_device(engine, PROMPTS, 2, 12, MASK2, block_size=4)),
    }
    for name, (reference, device) in runs.items():
        calls.clear()
        assert device() == reference(ref), name
        assert calls and set(calls) == {V2}, name


def test_the_tau_rule_keeps_a_probability_equal_to_tau():
    """§5.4 keeps a candidate while p >= τ: a p equal to τ is kept, on the device (fast.loop.keep)
    as in the reference (generate.accept). Two equal top logits, in different 128-wide blocks, the
    rest so far below that exp(.) is 0 in float32: p is 0.5 exactly, at τ = 0.5. Row 0's masks all
    sit at p = τ (all four kept); row 1's second mask has a third logit near the top (p < τ: the
    run stops there). The candidate of a tie is its first index (torch.argmax's), by the engine's
    block argmax."""
    from generate import accept, candidates

    _, engine = two_block_pair()
    N, B = 2, 4
    logits = torch.full((N, B, V2), -1000.0)
    logits[:, :, 5] = logits[:, :, 133] = 3.0
    logits[1, 2, 7] = 2.0
    conf = torch.softmax(logits, -1)[..., 5]
    assert conf[0].eq(0.5).all() and conf[1, 2] < 0.5  # the premise: p = τ exactly, in float32
    want = torch.tensor([4, 2])

    c, conf = candidates(logits)
    assert torch.equal(c, torch.full((N, B), 5)) and torch.equal(accept(conf, 0.5), want)

    st = State(engine, N, 512, 2 * B, B)
    st.eos.fill_(-1), st.max_new.fill_(100), st.tau.fill_(0.5)
    c, kept = keep(engine, st, logits)
    assert torch.equal(c, torch.full((N, B), 5)) and torch.equal(kept, want)
