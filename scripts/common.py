"""What the scripts share: their common options, opening a checkpoint, prompts, timing.

A script never imports another script; what two of them need lives here.
"""

import os
import platform
import statistics
import tempfile
import time

import torch

import fast
from checkpoint import load_checkpoint
from model import Qwen2, Qwen2Config, init_weights
from util.files import USER_ERRORS, error_line
from util.precision import choose_dtype, cpu_bf16_units

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
]


def random_checkpoint(path, seed=0):
    """A small random Qwen2 saved in HF layout. A large init std makes the output peaked,
    so that some mask predictions pass τ and the multi-token path is exercised."""
    cfg = Qwen2Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True)
    init_weights(Qwen2(cfg), std=0.5, seed=seed).save_pretrained(path)
    return path


def make_prompts(tok, vocab_size, mask_id, n, seed=0, data_dir=None):
    """n prompts: the first n test problems of data_dir (data/synthetic.py), else chat-templated
    questions with a tokenizer, else random ids (32-48 tokens)."""
    if tok is not None and data_dir:
        from data.synthetic import read_jsonl

        probs = read_jsonl(os.path.join(data_dir, "test.jsonl"))
        return [tok.encode_chat(probs[i % len(probs)]["messages"][:-1], add_generation_prompt=True)
                for i in range(n)]
    if tok is not None:
        return [tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                add_generation_prompt=True) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 49, (n,), generator=g).tolist()
    return [[t for t in torch.randint(0, vocab_size, (L,), generator=g).tolist() if t != mask_id] or [1]
            for L in lengths]


def time_once(fn, device):
    """Run fn() once -> (seconds, its result); on CUDA the queued work is waited for."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def timed(fn, repeats, device):
    """fn() -> list of Generation. Warm up once, then the median over `repeats` runs
    -> (seconds, generated tokens, forwards summed over rows, the generated ids per row)."""
    once = lambda: time_once(fn, device)  # noqa: E731
    once()
    runs = [once() for _ in range(repeats)]
    dt = statistics.median(t for t, _ in runs)
    out = runs[0][1]
    return dt, sum(len(g.ids) for g in out), sum(g.forwards for g in out), [g.ids for g in out]


def machine(device):
    """One line naming the hardware and software the numbers were measured on (on the CPU its
    model name and whether it has bf16 units: which dtype `auto` picks)."""
    hw = torch.cuda.get_device_name(device) if device.startswith("cuda") else (
        f"{cpu_name()}, {os.cpu_count()} CPUs; {cpu_bf16_units()[1]}")
    return (f"machine: {device} ({hw}), torch {torch.__version__} with {torch.get_num_threads()} "
            f"thread(s), Python {platform.python_version()}, {platform.platform()}")


def cpu_name():
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0]
    except (OSError, IndexError):
        return platform.processor() or platform.machine()


def floats(text):
    return [float(x) for x in text.split(",")]


def ints(text):
    return [int(x) for x in text.split(",")]


def add_model_args(p, several_dtypes=False):
    """The options every benchmark shares: mask id, device, dtype (one, or with several_dtypes
    a comma-separated list timed side by side, float32,bfloat16 by default), threads."""
    p.add_argument("--mask-id", type=int, help="default: the tokenizer's <|mask|>, else vocab_size-1")
    p.add_argument("--device", default="cpu")
    how = "auto: bf16 where the device has bf16 units (util/precision.py)"
    if several_dtypes:
        p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes; " + how)
    else:
        p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="float32",
                       help=how)
    p.add_argument("--threads", type=int, help="torch CPU threads")


def dtype_list(text):
    """--dtype of the benchmarks that compare dtypes side by side: names, comma-separated."""
    names = text.split(",")
    for name in names:
        choose_dtype(name, "cpu")  # an unknown name is an error naming it
    return names


def load_for_bench(args, prefix, dtype=None, engine=True):
    """Apply --threads and open --ckpt (or a fresh random tiny model) with the checkpoint
    opener -> checkpoint.Checkpoint; its mask_id is --mask-id, else the checkpoint's, else
    vocab_size-1 (a random model). engine: the model runs through the engine (fast.make_fast,
    eager: what a bf16 exact = AR check needs); False: the reference as load_checkpoint opens it."""
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = args.ckpt or random_checkpoint(tempfile.mkdtemp(prefix=prefix))
    try:
        ck = load_checkpoint(ckpt, args.device, choose_dtype(dtype or args.dtype, args.device)[0])
    except USER_ERRORS as e:  # a broken checkpoint: a message, not a traceback
        raise SystemExit(error_line(e)) from None
    if engine:
        fast.make_fast(ck.model)
    if args.mask_id is not None:
        ck.mask_id = args.mask_id
    elif ck.mask_id is None:
        ck.mask_id = ck.model.config.vocab_size - 1
    return ck
