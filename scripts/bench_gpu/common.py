"""What every section of scripts.bench_gpu shares: the run's settings (the GPU's, or a dry run's
on the CPU), the card's figures, the random 0.5B model and its engine, prompts, timing."""

import time
from dataclasses import dataclass

import torch

import fast
from fast.step import switch_step
from model import Qwen2, Qwen2Config, init_weights

BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, the vendors' figures
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM), the vendors' figures


@dataclass(frozen=True)
class Run:
    """Everything a dry run changes, in one place; main() sets RUN."""

    device: str
    model: str  # the decode section's model, in words
    shape: dict  # Qwen2Config fields over its defaults (Qwen2.5-0.5B's shape)
    batch_sizes: list  # defaults of --batch-sizes, --new-tokens, --out
    new_tokens: int
    out: str
    row_tokens: int  # the training step's rows
    timed_steps: int  # the training step: the fastest of these, after a warm-up
    main_flags: list  # train.py's flags beyond --device and --out_dir
    toy_tokens: int | None  # the toy's replies end at EOS or here (None: --new-tokens)
    big_step: tuple = (8, 1024)  # the training step's larger shape, rows x tokens
    mask_id: int = 151665  # Qwen2.5's <|mask|> (docs/spec.md §2)
    ids_below: int = 150000  # prompts and training rows draw their token ids below this
    row_tile: int | None = None  # the row tile of the run's low-precision matmuls (None: the machine's)


GPU_RUN = Run(device="cuda", model="random Qwen2.5-0.5B shape", shape={}, batch_sizes=[1, 4, 16],
              new_tokens=64, out="results/GPU", row_tokens=512, timed_steps=3, main_flags=[], toy_tokens=96)
# The dry run checks the code paths, cheaply: one layer (the layers' code is the core's, proven with
# several in tests/; a second layer cost the suite's dry run 10 s of its 41, most of it dynamo's
# tracing), a vocabulary of 1,024 (Qwen's 151,936 made its bf16 head most of its time where bf16 is
# emulated), and the row tile of a CPU with bf16 units on every CPU (one without has a tile of 1: a
# step's rows never padded, as a GPU's tile of 128 pads them, and its graphs a call per row)
DRY_RUN = Run(device="cpu", model="tiny random model (dry run)",
              shape=dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2),
              batch_sizes=[1, 2], new_tokens=8, out="out/bench_gpu_dry_run", row_tokens=32, timed_steps=1,
              main_flags=["--ar_steps=2", "--mars_steps=2", "--eval_rows=8", "--eval_at_end=False"],
              toy_tokens=None,  # an untrained toy reaches no EOS: --new-tokens
              big_step=(2, 32), mask_id=1023, ids_below=1000, row_tile=16)
RUN = GPU_RUN


def use(run):
    """Set the run every section reads (main: GPU_RUN, or DRY_RUN with --dry-run)."""
    global RUN
    RUN = run


def bandwidth():
    if RUN.device == "cpu":
        return None, "the CPU (dry run)"
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None), name


def random_05b(seed=0):
    """A random model of RUN's shape in bf16 on RUN's device, the reference (decode_section makes
    it the engine)."""
    return init_weights(Qwen2(Qwen2Config(**RUN.shape)), seed=seed).to(RUN.device, torch.bfloat16).eval()


def engine(model):
    """The engine over `model`, eager (fast.make_fast), and its compiled decoding step, set on
    the model per decoder by run_ours (fast.step.switch_step): a decoder's cache is static iff the
    step is on when the decoder makes it -> (model, step)."""
    step = switch_step(fast.make_fast(model, compile=True), None)  # compiled, and off for now
    return model, step


def sync():
    if RUN.device == "cuda":
        torch.cuda.synchronize()


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, RUN.ids_below, (int(L),), generator=g).tolist()
        for L in torch.randint(32, 49, (n,), generator=g)
    ]


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def graph_count():
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def empty_cache():
    if RUN.device == "cuda":
        torch.cuda.empty_cache()


def peak_flops():
    """The GPU's dense bf16 peak (FLOP/s) by its name, or None (a CPU, an unknown card)."""
    if RUN.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


