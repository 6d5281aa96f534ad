"""Proofs that the engine (fast/, issue 48) is the reference (model.py, kvcache.py, the decoders
of generate.py and exact.py) made fast from outside, and nothing else:

  * the arrow runs one way: importing the core (model, mars, kvcache, decoding, exact,
    sampling, generate, checkpoint, train) loads no module of fast/, nor does a default
    `generate.py` run (the reference); `--fast` does, and gives the reference's reply (HF's);
    train.py names the engine in one function at most (its wiring, as nanoGPT's compile block);
  * make_fast changes the model it is given and no name of a core module: every decoder
    given the engine takes its greedy pick from it (its block argmax);
  * in exact arithmetic (float64) the engine computes the reference's numbers: for every
    decoder (AR, the τ loop with the window, the block cache and no cache, exact mode K = 1
    and 2), greedy and seeded sampling, on a ragged batch, the engine's tokens are the
    reference's, and the logits of a prefill, an exact-mode step and an AR step over ragged
    rows equal the reference's to 1e-12. Every swap is covered: the engine as made (its
    modules, its cache, the block argmax); the row tiles, whole key blocks and tiled attention
    of bf16/fp16 (forced on in float64, at the machine's tiles and at tiles of 5 rows and 8
    queries, which pad and split); the static cache and fixed-width step (fast.step.static_hidden
    run eagerly); and the compiled step (torch.compile with dynamo's eager and aot_eager
    backends). Each case checks that what it swaps did run. The packed matmul is fp32 only (oneDNN packs no
    float64): it is proven against HF's float64 logits in tests/test_fast_paths.py and by HF's
    greedy tokens in tests/test_exact.py; the compiled step with inductor in test_compile.py;
    bf16 (where the tiles make a row's bits independent of its batch) in test_bf16.py;
  * the class swaps keep every parameter (the same objects), name, value, buffer, the tied
    head and the state_dict's keys in order; what a made-fast model saves is what the
    reference saves, and transformers and our Qwen2 load it equal.
"""

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import graphs_built, hf_greedy, make_hf_model
from greedy_margin import assert_no_near_tie
from safetensors.torch import load_file

import fast
import fast.attention
import fast.cache
import fast.linear
import sampling
from exact import generate_exact, step_input
from fast.argmax import block_argmax
from fast.attention import TiledAttention
from fast.cache import FastCache
from fast.linear import FastLinear
from fast.step import FastQwen2, static_hidden, switch_step
from generate import generate, generate_ar
from kvcache import KVCache
from model import Attention, Qwen2, Qwen2Config, init_weights
from sampling import GREEDY, Sampling

ROOT = Path(__file__).resolve().parent.parent
V, MASK = 256, 255  # a vocabulary of two 128-wide blocks, so the block argmax runs its blocks
ATOL64 = 1e-12  # float64 logits, two orders of the same sums: observed <= 4.3e-14 on logits up to 11.7 (23x)
CORE = ("model", "mars", "kvcache", "decoding", "exact", "sampling", "generate", "checkpoint", "train")
FAST_MODULES = "sorted(m for m in sys.modules if m == 'fast' or m.startswith('fast.'))"


# ---------------------------------------------------------------- the arrow runs one way
def test_the_core_imports_no_engine_module():
    """A fresh interpreter importing every core module has no fast or fast.* in sys.modules;
    the same check sees the engine once it is imported (it can fail)."""
    code = f"import json, sys; import {', '.join(CORE)}; print(json.dumps({FAST_MODULES}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    code = f"import json, sys; import generate, fast; print(json.dumps({FAST_MODULES}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert {"fast", "fast.step", "fast.linear", "fast.cache", "fast.attention", "fast.argmax"} <= set(
        json.loads(out.stdout))


def engine_references(node):
    """Whether the code under an ast node names the engine: imports fast or fast.*, or reads `fast`."""
    for n in ast.walk(node):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "fast" for a in n.names):
            return True
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "fast":
            return True
        if isinstance(n, ast.Name) and n.id == "fast":
            return True
    return False


def test_train_py_wires_the_engine_in_one_place():
    """Of train.py's functions (module-level, and the methods of its classes) at most one names
    the engine: the wiring (the losses handed to StageLoss, the compile), in one place; every
    other step of training is the reference's. (Importing train loads no fast module:
    test_the_core_imports_no_engine_module.) The check reads code, not docstrings, and can fail:
    a function with `from fast.train import ...` is seen (asserted on a sample)."""
    assert engine_references(ast.parse("def f():\n    from fast.train import x\n"))
    assert not engine_references(ast.parse('def f():\n    """fast/train.py"""\n'))
    functions = {}
    for node in ast.parse((ROOT / "train.py").read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            functions |= {f"{node.name}.{f.name}": f for f in node.body
                          if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert len(functions) > 5  # train.py read
    wiring = sorted(name for name, f in functions.items() if engine_references(f))
    assert len(wiring) <= 1, f"train.py's functions naming the engine (one place at most): {wiring}"


def test_a_default_generate_run_is_the_reference_and_fast_is_the_engine(tmp_path):
    """generate.main in a fresh interpreter, a tiny tokenizer-less checkpoint, --prompt-ids: by
    default it runs the reference (float32, said on stderr's first line) and loads no fast
    module; --fast (float32 here, to compare with HF in fp32) loads the engine and says so; both
    give HF's greedy reply, far from a near-tie (greedy_margin)."""
    prompt = [5, 17, 99, 3, 40]
    hf = make_hf_model(tmp_path, seed=3)
    ref = hf_greedy(hf, [prompt], 8)[0]
    assert_no_near_tie(hf, [prompt], [ref])
    args = ["--ckpt", str(tmp_path), "--prompt-ids", ",".join(map(str, prompt)), "--mask-id", str(MASK),
            "--tau", "1", "--block-size", "4", "--max-new-tokens", "8", "--json"]
    code = ("import json, sys, generate; rc = generate.main(sys.argv[1:]); "
            f"print('FAST ' + json.dumps({FAST_MODULES})); sys.exit(rc)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {name: subprocess.Popen([sys.executable, "-c", code, *args, *extra], cwd=ROOT, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for name, extra in {"reference": [], "fast": ["--fast", "--dtype", "float32"]}.items()}
    out = {name: (p.communicate(timeout=300), p.returncode) for name, p in runs.items()}
    for name, ((stdout, stderr), rc) in out.items():
        assert rc == 0, stderr
        lines = stdout.splitlines()
        assert json.loads(lines[0])["ids"] == ref, name
        loaded = json.loads(lines[-1].removeprefix("FAST "))
        first = stderr.splitlines()[0]
        if name == "reference":
            assert loaded == [] and first == "[float32: the reference (--fast for the engine)]", first
        else:
            assert "fast.step" in loaded and first == "[float32: as set; the engine]", (loaded, first)


# ---------------------------------------------------------------- engine = reference, float64
def tiny(seed=0):
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return init_weights(Qwen2(cfg), std=0.6, seed=seed).to(torch.float64).eval()  # peaked: drafts accepted


def ragged(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g)
    return [torch.randint(0, MASK, (int(L),), generator=g).tolist() for L in lengths]


SAMPLINGS = {"greedy": GREEDY, "sampled": Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=5)}


def decoders(model, prompts, s, new=16):
    """{decoder: a function running it on the prompts -> Generations}, every decoder with the
    sampling s (rows seeded seed + b)."""
    out = {"AR": lambda: generate_ar(model, prompts, new, sampling=s)}
    for K in (1, 2):
        out[f"exact K={K}"] = lambda K=K: generate_exact(model, prompts, block_size=4, drafts=K,
                                                         max_new_tokens=new, mask_id=MASK, sampling=s)
    for cache in ("window", "block", "none"):
        out[cache] = lambda cache=cache: generate(model, prompts, block_size=4, tau=0.4, max_new_tokens=new,
                                                  mask_id=MASK, cache=cache, block_cache_size=6, sampling=s)
    return out


def every_decoder(model, prompts, new=16):
    """{(decoder, sampling): (ids, forwards) per row} for every decoder, greedy and sampled."""
    return {(decoder, name): [(g.ids, g.forwards) for g in run()]
            for name, s in SAMPLINGS.items() for decoder, run in decoders(model, prompts, s, new).items()}


STEP_WIDTH = 9  # exact mode's at K = 2, the widest step of one_step


@torch.no_grad()
def one_step(model):
    """Logits of a prefill of 4 tokens, then over ragged rows an exact-mode step (K = 2, its
    positions and mask, rows of 2, 1 and 0 drafts) and an AR step -> [(N, T, V)] * 3."""
    idx = torch.randint(0, MASK, (3, 4), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(3, 24, step=STEP_WIDTH)
    out = [model.lm_head(model.hidden(idx, cache=cache))]
    cache.commit(torch.tensor([4, 2, 3]))
    tokens, positions, mask = step_input([1, 2, 3], [[4, 5], [6], []], 2, cache.lengths, MASK)
    assert tokens.shape[1] == STEP_WIDTH
    out.append(model.lm_head(model.hidden(tokens, positions, mask, cache)))
    cache.commit(torch.tensor([3, 1, 1]))
    out.append(model.lm_head(model.hidden(torch.tensor([[7], [8], [9]]), cache=cache)))
    return out


@pytest.fixture(scope="module")
def reference():
    """The reference model, its decoders' tokens and one_step's logits."""
    model = tiny(seed=5)  # a seed whose exact-mode drafts are right now and then (greedy and sampled)
    prompts = ragged()
    assert len(set(map(len, prompts))) > 1
    tokens = every_decoder(model, prompts)
    assert tokens["AR", "greedy"] != tokens["AR", "sampled"]  # the draws are not greedy
    for (decoder, name), rows in tokens.items():  # several tokens per forward: drafts and masks accepted
        if decoder == "block":  # (its forwards count the blocks' too) the no-cache loop's tokens
            assert [ids for ids, _ in rows] == [ids for ids, _ in tokens["none", name]]
        elif decoder != "AR":
            assert any(len(ids) > forwards for ids, forwards in rows), decoder
    assert [ids for ids, _ in tokens["exact K=2", "greedy"]] == [ids for ids, _ in tokens["AR", "greedy"]]
    return model, prompts, tokens, one_step(model)


# name: (tiles: None off, "machine" the machine's row tile, or n rows; step: None, "static" or a backend)
CASES = {
    "engine": (None, None),
    "tiles": ("machine", None),
    "tiles of 5": (5, None),
    "static step": (None, "static"),
    "static step, tiles of 5": (5, "static"),
    "compiled, eager": (None, "eager"),
    "compiled, aot_eager": (None, "aot_eager"),
    "compiled, eager, tiles of 5": (5, "eager"),
}


def spy(monkeypatch, module, name, facts, fact):
    """Record fact(*args) of every call of module.name in the set `facts`. A set of a few values,
    not a list of every call: dynamo guards a compiled step on what its trace mutated, so a list
    growing by a call each step made every step a new graph (64 recompiles, then eager)."""
    real = getattr(module, name)

    def wrapper(*args, **kw):
        facts.add(fact(*args))
        return real(*args, **kw)
    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.usefixtures("fresh_dynamo")
def test_the_engine_is_the_reference_in_float64(reference, case, monkeypatch):
    model, prompts, ref_tokens, ref_logits = reference
    tiles, step = CASES[case]
    tiled, attended = set(), set()  # the tile of each matmul; (whole key blocks, several query tiles)
    if tiles is not None:  # bf16/fp16's devices, forced on in float64 (exact arithmetic)
        low = (torch.bfloat16, torch.float16, torch.float64)
        monkeypatch.setattr(fast.linear, "LOW_PRECISION", low)
        monkeypatch.setattr(fast.cache, "LOW_PRECISION", low)
        if tiles != "machine":  # matmul tiles of `tiles` rows, attention tiles of 8 query rows (both pad)
            monkeypatch.setattr(fast.linear, "row_tile", lambda device: tiles)
            monkeypatch.setattr(fast.attention, "QUERY_TILE", 8)
        spy(monkeypatch, fast.linear, "in_tiles", tiled, lambda f, x, n: n)
        spy(monkeypatch, fast.attention, "attend_tiled", attended, lambda q, k, v, mask, scale: (
            k.shape[2] % 512 == 0, mask.additive.shape[2] > fast.attention.QUERY_TILE))
    if step not in (None, "static"):  # dynamo's guards and graphs, the backend `step`
        real = torch.compile
        monkeypatch.setattr(torch, "compile",
                            lambda f=None, **kw: real(f, dynamic=kw.get("dynamic"), backend=step))
    before = graphs_built()
    engine = fast.make_fast(copy.deepcopy(model), compile=step not in (None, "static"))
    static = []
    if step == "static":
        def counted(*args):
            static.append(args[1].shape)
            return static_hidden(*args)
        switch_step(engine, counted)  # the compiled step's code, run eagerly
    assert type(engine) is FastQwen2 and engine.argmax is block_argmax
    assert engine(torch.tensor([[1, 2]])).dtype == torch.float64
    assert engine.new_cache(1, 4).static == (step is not None)
    assert engine.new_cache(1, 4).fixed_shapes == (tiles is not None)

    assert every_decoder(engine, prompts) == ref_tokens
    logits = one_step(engine)
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL64, rtol=0)

    # what the case swaps did run
    if tiles is not None:
        n = fast.linear.row_tile(torch.device("cpu"))
        assert tiled == {n}  # every tiled matmul in tiles of n rows
        assert attended and all(whole for whole, _ in attended)  # over whole key blocks
        if tiles != "machine":  # several query tiles in a call
            assert any(several for _, several in attended)
    if step == "static":
        assert static and all(shape[1] in (1, 4, 8, 9, 10) for shape in static)  # fixed widths
    if step not in (None, "static"):
        # compiled: a graph per decoder's step width (5) and one more per new fact a spy's set
        # takes; a step recompiled at every call would build dozens (and run eagerly past 64)
        assert 0 < graphs_built() - before <= 8


def test_every_decoder_of_the_engine_picks_by_its_block_argmax(reference, monkeypatch):
    """make_fast changes the model it is given and nothing of the core (sampling's names stay as
    they were); every decoder given the engine takes its greedy pick from it: FastQwen2.argmax,
    the block argmax (spied on here), on logits of two 128-wide blocks (its block path), with the
    reference's tokens."""
    model, prompts, ref_tokens, _ = reference
    before = dict(vars(sampling))
    engine = fast.make_fast(copy.deepcopy(model))
    assert vars(sampling) == before and engine.argmax is block_argmax
    calls = []

    def counted(logits):
        calls.append(logits.shape[-1])
        return block_argmax(logits)
    monkeypatch.setattr(engine, "argmax", counted)
    for decoder, run in decoders(engine, prompts, GREEDY).items():
        calls.clear()
        assert [(g.ids, g.forwards) for g in run()] == ref_tokens[decoder, "greedy"], decoder
        assert calls and set(calls) == {V}, decoder  # every pick over the whole vocabulary


@torch.no_grad()
def test_the_engine_fills_a_tiled_cache_to_its_last_slot(monkeypatch):
    """One token per row, every row at the same length, the cache's last slot: build_mask
    returns None ("it sees every key"), which the tiled mask (bf16/fp16, forced on here in
    float64) must read as all-visible, as the reference does (it raised before: tiled_mask
    of None)."""
    low = (torch.bfloat16, torch.float16, torch.float64)
    monkeypatch.setattr(fast.linear, "LOW_PRECISION", low)
    monkeypatch.setattr(fast.cache, "LOW_PRECISION", low)
    model = tiny()
    engine = fast.make_fast(copy.deepcopy(model))
    idx = torch.randint(0, MASK, (2, 512), generator=torch.Generator().manual_seed(2))
    out = []
    for m in (model, engine):
        cache = m.new_cache(2, 511)
        assert cache.k.shape[3] == 512
        m.hidden(idx[:, :511], cache=cache)
        cache.commit(511)
        out.append(m.lm_head(m.hidden(idx[:, 511:], cache=cache)))
    torch.testing.assert_close(out[1], out[0], atol=ATOL64, rtol=0)


# ---------------------------------------------------------------- the class swaps keep the model
@pytest.mark.parametrize("tied", [True, False])
def test_make_fast_keeps_every_name_value_and_the_tie(tmp_path, tied):
    """fast.make_fast swaps classes in place (nn.Linear -> FastLinear, Attention ->
    TiledAttention, Qwen2 -> FastQwen2) and adds packed copies beside the weights; nothing
    else changes: the same Parameter objects, names, values (bit for bit), buffers, tie and
    state_dict keys in order. What it saves is the reference's save, byte for byte in every
    tensor and config.json; transformers and our Qwen2 load it equal. Twice is once (the
    second call packs again, the same way). A float64 model is swapped but not packed."""
    from transformers import Qwen2ForCausalLM

    make_hf_model(tmp_path / "src", tie_word_embeddings=tied)
    model = Qwen2.from_pretrained(str(tmp_path / "src"))
    model.save_pretrained(str(tmp_path / "reference"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    params = dict(model.named_parameters())
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    n_attention = sum(type(m) is Attention for m in model.modules())
    assert n_linear == 7 * model.config.num_hidden_layers + 1
    assert n_attention == model.config.num_hidden_layers
    assert fast.make_fast(fast.make_fast(model)) is model  # in place, twice
    assert type(model) is FastQwen2
    assert sum(type(m) is FastLinear and m.packed is not None for m in model.modules()) == n_linear
    assert sum(type(m) is TiledAttention for m in model.modules()) == n_attention
    assert not any(type(m) in (torch.nn.Linear, Attention) for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[k]) for k, b in model.named_buffers()) and len(buffers) == 1
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.save_pretrained(str(tmp_path / "engine"))
    saved, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("engine", "reference"))
    assert list(saved) == list(want) and all(torch.equal(saved[k], want[k]) for k in want)
    assert (json.loads((tmp_path / "engine" / "config.json").read_text())
            == json.loads((tmp_path / "reference" / "config.json").read_text()))
    hf = Qwen2ForCausalLM.from_pretrained(str(tmp_path / "engine"))
    assert all(torch.equal(v, before[k]) for k, v in hf.state_dict().items())
    ours = Qwen2.from_pretrained(str(tmp_path / "engine"))
    assert type(ours) is Qwen2 and all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    model64 = fast.make_fast(Qwen2.from_pretrained(str(tmp_path / "src"), dtype=torch.float64))
    linears = [m for m in model64.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == n_linear and all(type(m) is FastLinear and m.packed is None for m in linears)


def test_the_reference_cache_is_plain_and_the_engines_is_its_subclass():
    """model.new_cache gives kvcache.KVCache of max_len + step slots; the engine's, a FastCache
    (a KVCache) of whole key blocks only where its devices need them."""
    model = tiny()
    cache = model.new_cache(2, 20, step=5)
    assert type(cache) is KVCache and cache.k.shape == (2, 2, 2, 25, 8) and cache.k.dtype == torch.float64
    engine = fast.make_fast(copy.deepcopy(model))
    cache = engine.new_cache(2, 20, step=5)
    assert isinstance(cache, KVCache) and type(cache) is FastCache and cache.k.shape[3] == 25
    assert fast.make_fast(copy.deepcopy(model).to(torch.bfloat16)).new_cache(2, 20, step=5).k.shape[3] == 512


def test_load_checkpoint_gives_the_reference(tmp_path):
    """checkpoint.load_checkpoint opens the plain model (what the engine is proven against):
    model.Qwen2 of nn.Linear and model.Attention, nothing packed, in eval mode."""
    from checkpoint import load_checkpoint

    make_hf_model(tmp_path)
    model = load_checkpoint(str(tmp_path)).model
    assert type(model) is Qwen2 and not model.training
    kinds = {type(m) for m in model.modules()}
    assert torch.nn.Linear in kinds and Attention in kinds
    assert not kinds & {FastLinear, TiledAttention, FastQwen2}
