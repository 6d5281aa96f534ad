"""Compute dtype and autocast, the one rule for train.py, generate.py and the benchmarks.

"auto" picks what the hardware computes fastest without changing the method: bfloat16 on
CUDA, and on the CPU bfloat16 where it has bf16 matmul units (Intel AMX, or AVX512-BF16 as on
AMD Zen 4 and later Xeons), float32 elsewhere. The difference is large both ways: on a 2-core
AMD EPYC with AVX512-BF16 (no AMX) a bf16 matmul of SmolLM2's shapes runs 1.4-4x faster than
fp32 (results/SPEED.md, "bf16 on the CPU"); on a Xeon with AMX up to 7x; on a CPU with neither,
oneDNN emulates bf16 and it is many times slower than fp32. The check asks torch (cpuinfo),
not /proc. `--dtype float32` (or bfloat16) overrides it everywhere.

Training: weights stay fp32 (the optimizer's copy) and matmuls run in the compute dtype
through autocast; the losses are reduced in fp32 (mars.py). Decoding: the weights themselves
are cast to the compute dtype (checkpoint.load_checkpoint), see model.Linear for why a
bf16 decode step is row-invariant.
"float64" is for proofs, not for training: weights, optimizer state, compute and the
gradient all-reduce all in float64, so two runs that differ only in summation order
(one process vs DDP / FSDP) agree to ~1e-15 on any machine (tests/test_train_distributed.py).
"""

from contextlib import nullcontext

import torch

DTYPES = ("auto", "float32", "bfloat16", "float64")
# dtypes whose outputs keep the last-bit difference of two summation orders (model.Linear,
# model.attend and kvcache.py make a decoding row's bits independent of the rows beside it)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def dtype_name(dtype):
    """torch.bfloat16 -> "bfloat16", as settings, configs and logs spell it."""
    return str(dtype).removeprefix("torch.")


def cpu_bf16_units():
    """(True, what) when this CPU has bf16 matmul units, else (False, why not)."""
    cpu = torch.cpu  # private but stable since torch 2.3: cpuinfo's flags; absent -> treated as no
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return True, "the CPU has AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return True, "the CPU has AVX512-BF16"
    return False, "the CPU has no bf16 units (no AMX, no AVX512-BF16)"


def choose_dtype(name, device):
    """"auto" | "float32" | "bfloat16" | "float64" (and "float16" for decoding) ->
    (torch dtype, one line saying why) for `device` (a torch.device or a string)."""
    device = torch.device(device)
    if name not in DTYPES + ("float16",):
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    if name != "auto":
        return getattr(torch, name), "as set"
    if device.type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    if device.type != "cpu":
        return torch.float32, f"auto: {device.type}"
    has, why = cpu_bf16_units()
    return (torch.bfloat16 if has else torch.float32), f"auto: {why}"


def compute_dtype(name, device):
    """The torch dtype `choose_dtype` picks (without the reason)."""
    return choose_dtype(name, device)[0]


def weight_dtype(dtype):
    """The dtype of the weights (and so of the optimizer state and the gradient reduce) for a
    compute dtype: float32, except float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast(device, dtype):
    """A context that runs the forward in `dtype` (nothing to do where it is the weights' dtype)."""
    return nullcontext() if dtype == weight_dtype(dtype) else torch.autocast(device.type, dtype=dtype)
