"""bf16 decoding (issue 39): the packed bf16 matmul against F.linear and HF, and exact mode in
bf16 against bf16 greedy AR, token for token, alone and in batches (what `--dtype auto` picks,
and bf16 where oneDNN refuses bf16 weights: tests/test_precision.py).

Why exact mode can be exact in bf16 at all: a bf16 output keeps 8 significant bits, so two
summation orders of the same row, equal to ~1e-7 in fp32, round to different bf16 values now
and then, and the next layers carry that ulp on. Kernels choose their summation order by the
shape of the call, and exact mode reads a row's AR token among other rows. So the engine
(fast.make_fast: fast/linear.py, "Row invariance") calls every kernel of a bf16 decode at one
shape; the reference (model.py) makes no such promise, and every decode here that claims exact
mode = AR or batch invariance runs on the engine. Two kinds of proof here:
  * by construction: with kernels made to round differently at every shape of call
    (`ShapeDependentKernels`), AR alone, AR in a batch and exact mode alone and in a batch
    still give the same tokens; and the same kernels break a decode when any one of the
    engine's devices is taken away (the proof can fail);
  * on this machine's real kernels (oneDNN at whatever instruction set the CPU has, or
    ONEDNN_MAX_CPU_ISA allows: test_every_isa_level_this_cpu_can_play re-runs them at each).

The models are small (bf16 math is emulated, and slow, on CPUs without bf16 units) but have
the widths of SmolLM2's MLP (576 -> 1536 -> 576).
"""

import os
import subprocess
import sys

import pytest
import torch

import exact
import fast
import fast.attention
import fast.cache
import fast.linear
import fast.step
from data.prompts import CHAT
from exact import generate_exact
from fast.linear import FastLinear, pack
from generate import generate_ar
from model import Qwen2, Qwen2Config, init_weights
from tests.conftest import make_hf_model
from tests.test_precision import onednn_takes_a_bf16_weight
from tokenizer import Tokenizer
from util import precision

MASK = 15  # the <|mask|> id of the tiny models (never in a prompt)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- models
def tiny_bf16(seed, vocab=16, layers=2, engine=True, width=(576, 1536, 9, 3), std=0.08):
    """A random Qwen2 in bf16 with SmolLM2's widths (576 -> 1536 -> 576, 9 heads over 3 kv
    heads) by default, small elsewhere: the engine over it (fast.make_fast), or with
    engine=False the plain reference (to be moved, or compiled, first)."""
    hidden, inter, heads, kv = width
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512)
    model = init_weights(Qwen2(cfg), std=std, seed=seed).to(torch.bfloat16).eval()
    return fast.make_fast(model) if engine else model


def prompts_of(seed, n=4, vocab=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (int(L),), generator=g).tolist()
            for L in torch.randint(3, 12, (n,), generator=g)]


# ----------------------------------------------------------------------------- the matmul
@torch.no_grad()
@pytest.mark.parametrize("threads", [1, 2])
def test_a_bf16_linear_row_is_the_same_alone_or_among_rows(threads):
    """The engine's FastLinear in bf16, packed and not: each of 9 rows computed alone gives
    bitwise the row computed among the 9 (the rule exact mode needs), at the widths of
    SmolLM2's projections, on one and on two threads (oneDNN may split a sum by thread)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(threads)
    for n_in, n_out in [(576, 1536), (1536, 576), (576, 192), (576, 4096)]:
        lin = FastLinear(n_in, n_out, bias=n_out == 192).to(torch.bfloat16)
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * 0.03)
        x = torch.randn(1, 9, n_in, generator=g).to(torch.bfloat16)
        for packed in (False, True):
            if packed:
                lin.packed = None
                pack(torch.nn.Sequential(lin))
                assert lin.packed is not None or not onednn_takes_a_bf16_weight()
            among = lin(x)
            alone = torch.cat([lin(x[:, r:r + 1]) for r in range(9)], 1)
            assert torch.equal(alone, among), (n_in, n_out, packed)


def bf16_matmul_bound(x, lin):
    """How far a bf16 matmul with fp32 accumulation may be from the float64 product of the same
    bf16 values (x and lin's weight and bias), elementwise -> (float64 product, bound). The
    products of two bf16 values are exact in fp32; their fp32 sum (n additions, the bias
    included, in any order) is off by at most E = gamma_n sum_i |x_i w_i| (+ |b|), gamma_n =
    n u / (1 - n u), u = 2^-24 (the classical bound); rounding that sum to bf16 (8 significant
    bits) moves it by at most one bf16 spacing at |product| + E. Bound: E + that spacing."""
    x, w = x.double(), lin.weight.double()
    b = None if lin.bias is None else lin.bias.double()
    exact = torch.nn.functional.linear(x, w, b)
    size = torch.nn.functional.linear(x.abs(), w.abs(), None if b is None else b.abs())
    n, u = x.shape[-1] - (b is None), 2.0 ** -24
    err = n * u / (1 - n * u) * size
    spacing = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs() + err)[1] - 8)
    return exact, err + spacing


def is_bf16_matmul(lin, x):
    """Whether every output of lin(x) is within `bf16_matmul_bound` of the float64 product."""
    exact, bound = bf16_matmul_bound(x, lin)
    return bool(((lin(x).double() - exact).abs() <= bound).all())


@torch.no_grad()
def test_packed_bf16_is_a_bf16_matmul_and_as_accurate_as_hf_bf16(tmp_path):
    """The engine's packed bf16 weights (what its decoding runs): (1) every FastLinear of a model
    made fast (F.linear where oneDNN does not pack bf16), at 1, 5 and 18 rows (in its row tiles),
    is a bf16 matmul: each output within `bf16_matmul_bound` of the float64 product of the same
    bf16 values (the rule written out, whatever the kernel's summation order: on a 2-core AMD
    EPYC every output was within one bf16 spacing at its own level and capped to AVX512_CORE and
    AVX2); (2) the packed forward
    (prompt, steps of 1 and 5 rows) is off the fp32 forward by at most 1.25x HF bf16's error, as
    the plain reference in bf16 is (a bf16 forward is off by ~0.1 on logits of size ~5:
    test_model.test_bf16_matches_hf_bf16 explains why)."""
    hf = make_hf_model(tmp_path, num_hidden_layers=3, hidden_size=128, intermediate_size=1536,
                       tie_word_embeddings=False)
    idx = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = hf(idx).logits[0]  # fp32
    hf_bf = hf.to(torch.bfloat16)(idx).logits[0].float()
    plain = Qwen2.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    packed = fast.make_fast(Qwen2.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval())
    assert packed.lm_head.packed is not None or not onednn_takes_a_bf16_weight()
    g = torch.Generator().manual_seed(4)
    for name, lin in packed.named_modules():
        if isinstance(lin, FastLinear):
            for rows in (1, 5, 18):
                x = torch.randn(rows, lin.weight.shape[1], generator=g).to(torch.bfloat16)
                assert is_bf16_matmul(lin, x), (name, rows)
    outs = {}
    for name, m in (("plain", plain), ("packed", packed)):  # the prompt, then steps of 1 and 5 rows
        cache = m.new_cache(1, 24)
        parts = [m(idx[:, :18], cache=cache)]
        cache.commit(18)
        parts += [m(idx[:, 18:19], cache=cache)]
        cache.commit(1)
        parts += [m(idx[:, 19:24], cache=cache)]
        outs[name] = torch.cat(parts, 1)[0].float()
    err = (outs["plain"] - ref).abs().mean().item()
    assert err > 1e-4  # it ran in bf16
    assert (outs["packed"] - ref).abs().mean().item() <= 1.25 * (hf_bf - ref).abs().mean().item()
    assert err <= 1.25 * (hf_bf - ref).abs().mean().item()


# ----------------------------------------------------------------------------- exact mode
@torch.no_grad()
def alone_and_among(model, seq, Ts, mask_id):
    """For each T in Ts, the logits of seq's last token (1) as an AR step on the cache of the
    rest, and (2) as row 0 of a T-row step over the same cache, the others masks under a causal
    mask (as exact mode's c_0 among its drafts and masks). The prefix is computed once, in a
    cache 1,024 slots larger than the step needs, and copied into the two caches of the steps:
    the AR step's the smaller, the T-row step's 1,024 slots
    larger: key blocks past every row's end must change nothing. `model`: the engine."""
    n, T_max = seq.shape[1], max(Ts)
    big = model.new_cache(1, n + T_max + 1024)
    model(seq[:, :-1], cache=big)
    big.commit(n - 1)
    out = []
    for T in Ts:
        one, many = model.new_cache(1, n + T_max), model.new_cache(1, n + T_max + 1024)
        assert many.k.shape[3] >= one.k.shape[3] + 1024
        for cache in (one, many):
            cache.k[..., :n - 1, :], cache.v[..., :n - 1, :] = big.k[..., :n - 1, :], big.v[..., :n - 1, :]
            cache.commit(n - 1)
        step = torch.cat([seq[:, -1:], torch.full((1, T - 1), mask_id)], 1)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        out.append((model(seq[:, -1:], cache=one)[0, 0], model(step, attn_mask=causal, cache=many)[0, 0]))
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_is_the_row_among_others(threads):
    """The engine's decoding step, the claim exact mode rests on: an AR step (one new token on
    the cache) gives bitwise the logits that the same token gets as row 0 of a T-row step over
    the same cache (exact mode's c_0 among its drafts and masks), for every T a step of
    exact mode with K <= 2 has (2, 3, 4, 6, 9 rows), over prefixes of 4-70 tokens, on caches of
    512 and 1,536 slots."""
    torch.set_num_threads(threads)
    model = tiny_bf16(seed=threads, vocab=256, layers=4)
    g = torch.Generator().manual_seed(threads)
    for n in (4, 9, 30, 63, 64, 70):
        prefix = torch.randint(0, MASK, (1, n), generator=g)
        for T, (alone, among) in zip((2, 3, 4, 6, 9), alone_and_among(model, prefix, (2, 3, 4, 6, 9), MASK)):
            assert torch.equal(alone, among), (n, T)


def decodes(model, prompts, max_new=24, Ks=(1, 2, 4)):
    """Greedy replies of every decoder exact mode must equal: AR on the batch, AR on each prompt
    alone, and exact mode (K in Ks) on the batch and alone -> {name: replies}, tokens/forward."""
    out = {"AR batch": [g.ids for g in generate_ar(model, prompts, max_new)],
           "AR alone": [generate_ar(model, [p], max_new)[0].ids for p in prompts]}
    tokens = forwards = 0
    for K in Ks:
        kw = dict(block_size=4, drafts=K, max_new_tokens=max_new, mask_id=MASK)
        batch = generate_exact(model, prompts, **kw)
        out[f"exact K={K} batch"] = [g.ids for g in batch]
        out[f"exact K={K} alone"] = [generate_exact(model, [p], **kw)[0].ids for p in prompts]
        tokens, forwards = tokens + sum(len(g.ids) for g in batch), forwards + sum(g.forwards for g in batch)
    return out, tokens / forwards


def differing(out):
    """The decoders whose replies are not AR's on the batch."""
    return [name for name, replies in out.items() if replies != out["AR batch"]]


@pytest.mark.parametrize("threads", [1, 2])
def test_exact_mode_in_bf16_is_bf16_ar(threads):
    """Exact mode in bf16 emits bf16 greedy AR's tokens, token for token, for K = 1, 2, 4, one
    prompt at a time and in a batch, on two threads and one; and AR in a batch is AR alone. A
    16-token vocabulary makes the random masks' drafts right often enough that accepted drafts
    are committed and read on. These are this machine's real kernels: 4 prompts and 24 tokens on
    a CPU with bf16 units, 3 and 16 on one that emulates bf16 (slow there, and at 2 threads beside
    the suite's other worker slower still; the construction itself is proven whatever the kernels
    do, test_row_invariance_holds_whatever_the_kernels_do_at_each_shape)."""
    torch.set_num_threads(threads)
    seed = threads - 1  # another model and prompts on each thread count
    n, new = (4, 24) if precision.cpu_bf16_units()[0] else (3, 16)
    out, tpf = decodes(tiny_bf16(seed), prompts_of(seed, n=n), max_new=new)
    assert differing(out) == []
    assert tpf > 1.05  # drafts were accepted: the verification path really ran


SMALL = (64, 128, 4, 2)  # the proofs by construction need no real widths (std 0.2: peaked enough
# that drafts are accepted)
# the stand-in kernels' change per shape: large, so that the decode check alone catches each of
# MUTATIONS (with 2^-6 a decode without the matmul tiles, or without whole key blocks, flipped no
# token of the SMALL model and still passed; with 2^-4 whole key blocks taken away changed 1 of
# the 7 decoders, with 2^-3 5 of them)
PERTURB = 2 ** -3


class ShapeDependentKernels:
    """Stand-ins for the engine's matmul (FastLinear.product) and attention (sdpa, which
    fast/attention.py and the reference's attend both call) that compute a different function
    at every shape of call, the same for every row of a call: the worst a kernel that picks its
    summation order by shape can do. The matmul scales its output by 1 + PERTURB * (rows % 3),
    attention by 1 + PERTURB * ((query rows + keys) % 3); rounded back to bf16. `shapes`: every
    call's (kind, rows, keys) (keys: None for a matmul)."""

    def __init__(self, monkeypatch):
        real_product, real_sdpa = FastLinear.product, fast.attention.F.scaled_dot_product_attention
        self.shapes = set()

        def product(lin, x):
            self.shapes.add(("matmul", x.shape[0], None))
            return (real_product(lin, x).float() * (1 + PERTURB * (x.shape[0] % 3))).to(x.dtype)

        def sdpa(q, k, v, **kw):
            self.shapes.add(("attention", q.shape[2], k.shape[2]))
            y = real_sdpa(q, k, v, **kw)
            return (y.float() * (1 + PERTURB * ((q.shape[2] + k.shape[2]) % 3))).to(y.dtype)

        monkeypatch.setattr(FastLinear, "product", product)
        monkeypatch.setattr(fast.attention.F, "scaled_dot_product_attention", sdpa)

    def called(self, kind):
        """The (rows, keys) of every call of `kind` ("matmul" or "attention")."""
        return {s[1:] for s in self.shapes if s[0] == kind}


# every attention call of the engine over a bf16 cache: QUERY_TILE query rows against every slot
# of a cache rounded up to whole key blocks of 512 (the CPU flash attention's key block from 512
# keys on); the caches of these decodes hold under 512 slots (prompt, reply and step): one block
ONE_KEY_BLOCK = 512


def tiles_removed_from_matmuls(monkeypatch):
    """The mutation: every FastLinear call on the rows as they come (fast.linear.in_tiles)."""
    monkeypatch.setattr(fast.linear, "in_tiles", lambda f, x, n: f(x))


def tiles_removed_from_attention(monkeypatch):
    """The mutation: FastQwen2 hands attention the bool mask, so TiledAttention runs the
    reference's attention (model.attend) on the query rows as they come."""
    monkeypatch.setattr(fast.step, "tiled_mask", lambda mask, g, dtype: mask)


def keys_not_in_whole_blocks(monkeypatch):
    """The mutation: a bf16 cache's slots not rounded up to whole key blocks, so attention reads
    as many keys as the decoder's cache holds (its prompts, budget and step)."""
    monkeypatch.setattr(fast.cache, "KEY_BLOCK", 1)


MUTATIONS = {f.__name__: f for f in (tiles_removed_from_matmuls, tiles_removed_from_attention,
                                     keys_not_in_whole_blocks)}


def test_row_invariance_holds_whatever_the_kernels_do_at_each_shape(monkeypatch):
    """The construction itself: with kernels that compute another function at every shape,
    exact mode (K = 1, 2, 4, alone and in a batch) still equals AR, and AR alone equals AR in a
    batch, because the engine calls each kernel of a bf16 decode at one shape (fast/linear.py,
    "Row invariance"): every matmul at the row tile, every attention call at QUERY_TILE query
    rows against one key block. The decode check alone fails under each of MUTATIONS (the next
    test): the perturbation is large enough to flip tokens."""
    kernels = ShapeDependentKernels(monkeypatch)
    out, tpf = decodes(tiny_bf16(2, width=SMALL, std=0.2), prompts_of(2, n=3), max_new=16)
    assert differing(out) == []
    assert tpf > 1.05
    assert kernels.called("matmul") == {(fast.linear.row_tile(torch.device("cpu")), None)}  # one row count
    assert kernels.called("attention") == {(fast.attention.QUERY_TILE, ONE_KEY_BLOCK)}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_same_kernels_break_a_decode_whose_shapes_vary(monkeypatch, mutation):
    """The proof can fail: with the same stand-in kernels and any one of the engine's devices
    taken away (the matmul tiles, the attention tiles, the whole key blocks), the kernels are
    called at more than one shape and AR in a batch, AR alone or exact mode differ from AR."""
    kernels = ShapeDependentKernels(monkeypatch)
    MUTATIONS[mutation](monkeypatch)
    out, _ = decodes(tiny_bf16(2, width=SMALL, std=0.2), prompts_of(2, n=3), max_new=16)
    assert len(kernels.called("matmul")) > 1 or len(kernels.called("attention")) > 1
    assert differing(out) != []


ISA_CHECK = """
import torch
from tests.test_bf16 import tiny_bf16, prompts_of, decodes, differing, is_bf16_matmul
from fast.linear import FastLinear, pack
torch.set_num_threads(2)
out, tpf = decodes(tiny_bf16(1), prompts_of(1, n=3), max_new=16, Ks=(2,))
lin = pack(torch.nn.Sequential(FastLinear(1536, 576).to(torch.bfloat16)))[0]
x = torch.randn(40, 1536).to(torch.bfloat16)
with torch.no_grad():
    rows = all(torch.equal(lin(x[r:r + 1]), lin(x)[r:r + 1]) for r in range(40))
    matmul = is_bf16_matmul(lin, x)
print(differing(out), rows, tpf > 1.05, matmul)
"""


def isa_levels():
    """The ONEDNN_MAX_CPU_ISA levels below this CPU's own that it can play (its own level is what
    every other test of this file runs at): an Intel Xeon with AMX plays AVX512_CORE_BF16,
    AVX512_CORE and AVX2; an AMD EPYC with AVX512-BF16 plays AVX512_CORE and AVX2."""
    cpu = torch.cpu
    has = [level for level, yes in [("AVX512_CORE_AMX", cpu._is_amx_tile_supported()),
                                    ("AVX512_CORE_BF16", cpu._is_avx512_bf16_supported()),
                                    ("AVX512_CORE", cpu._is_avx512_supported()),
                                    ("AVX2", cpu._is_avx2_supported())] if yes]
    return has[1:]


def test_every_isa_level_this_cpu_can_play():
    """The real-kernel proofs at every instruction set below its own that oneDNN can be capped to
    on this CPU (isa_levels; skipped on an AVX2-only CPU, which has none): in a fresh process per
    level, exact mode K = 2 on the engine alone and in a batch equals AR alone and in a batch, a
    packed bf16 FastLinear's row is the same alone or among 40, and its outputs are within
    `bf16_matmul_bound` of the float64 product."""
    levels = isa_levels()
    assert set(levels) <= {"AVX512_CORE_BF16", "AVX512_CORE", "AVX2"}
    if not levels:
        pytest.skip("no oneDNN level below this CPU's own to play (an AVX2-only CPU, or not x86): "
                    "every other test of this file runs at its own level")
    for level in levels:
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
        env.update({"OMP_NUM_THREADS": "2", "PYTHONPATH": ROOT})
        if level:
            env["ONEDNN_MAX_CPU_ISA"] = level
        r = subprocess.run([sys.executable, "-c", ISA_CHECK], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=300)
        assert r.returncode == 0, (level, r.stderr[-2000:])
        assert r.stdout.split("\n")[-2] == "[] True True True", (level, r.stdout)


def test_a_wrong_verification_fails(monkeypatch):
    """The proof can fail: a verification that reads the AR argmax one position late (the
    mistake of an off-by-one in logits alignment) no longer gives AR's tokens."""
    real = exact.verify

    def late(logits, *rest, **kw):
        return real(torch.cat([logits[:, 1:], logits[:, -1:]], 1), *rest, **kw)

    monkeypatch.setattr(exact, "verify", late)
    out, _ = decodes(tiny_bf16(0), prompts_of(0), Ks=(2,))
    assert differing(out) == ["exact K=2 batch", "exact K=2 alone"]


# ----------------------------------------------------------------------------- on SmolLM2
@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_dir):
    """The real model in bf16 on the engine (fast.make_fast, as generate.py --fast opens it),
    general chat prompts and a reply length: 3 prompts and 32 tokens on a CPU with bf16 units,
    2 and 16 on one that emulates bf16 (a forward is ~10x slower there: the suite must stay
    within its 5 minutes)."""
    tok = Tokenizer.from_dir(smollm2_dir)
    model = fast.make_fast(Qwen2.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval())
    units = precision.cpu_bf16_units()[0]
    prompts = [tok.encode_chat([{"role": "user", "content": c}], add_generation_prompt=True)
               for c in CHAT[:3 if units else 2]]
    return model, prompts, tok.mask_id, 32 if units else 16


def test_smollm2_row_alone_is_the_row_among_others(smollm2_bf16):
    """The row-invariance claim on the real model, where random tiny models do not reach it
    (with a 2-row matmul and fewer than 4 query rows, 17 of 36 such rows of SmolLM2 differed
    from their AR step on an AMD EPYC with AVX512-BF16, by up to 0.06 in a layer's output)."""
    model, prompts, mask_id, _ = smollm2_bf16
    for prompt in prompts:
        for extra in (0, 23):  # the prompt, then 23 tokens on
            seq = torch.tensor([prompt + list(range(300, 300 + extra))])
            for T, (alone, among) in zip((2, 3, 4), alone_and_among(model, seq, (2, 3, 4), mask_id)):
                assert torch.equal(alone, among), (seq.shape[1], T)


def test_smollm2_exact_mode_in_bf16_is_bf16_ar(smollm2_bf16):
    """Exact mode K = 1 and 2 on SmolLM2 in bf16, on the prompts in a batch, gives bf16 greedy AR's
    reply token for token, and AR in the batch is AR alone (on an Intel Xeon with AMX, before
    issue 39: AR in batches of 4 = AR alone on 8 of 12 general prompts at 64 tokens)."""
    model, prompts, mask_id, new = smollm2_bf16
    ar = [g.ids for g in generate_ar(model, prompts, new)]
    assert [generate_ar(model, [p], new)[0].ids for p in prompts] == ar
    for K in (1, 2):
        ex = generate_exact(model, prompts, block_size=4, drafts=K, max_new_tokens=new, mask_id=mask_id)
        assert [g.ids for g in ex] == ar, K


# ----------------------------------------------------------------------------- on CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/bench_gpu.py measures it too)")
def test_on_cuda_exact_mode_is_ar_alone_and_in_batches_of_1_4_16():
    """Where a GPU is present (never in CI, which has none: not counted as its coverage): the same
    construction on CUDA's kernels (row tile 128), bf16, the engine eager: exact mode K = 1, 2, 4
    equals AR, and AR alone equals AR in the batch, at batch 1, 4 and 16."""
    model = fast.make_fast(tiny_bf16(2, engine=False, width=SMALL, std=0.2).cuda())
    for n in (1, 4, 16):
        out, _ = decodes(model, prompts_of(n, n=n), max_new=16)
        assert differing(out) == [], n
