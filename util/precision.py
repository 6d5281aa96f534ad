"""Compute dtype and autocast, the one rule for train.py and the benchmarks.

Weights stay fp32 (the optimizer's copy); matmuls run in the compute dtype through
autocast. "auto" is bfloat16 on CUDA and float32 on the CPU, where a bf16 matmul is
many times slower than fp32 (measured here: about 25x).
"float64" is for proofs, not for training: weights, optimizer state, compute and the
gradient all-reduce all in float64, so two runs that differ only in summation order
(one process vs DDP / FSDP) agree to ~1e-15 on any machine (tests/test_train.py).
"""

from contextlib import nullcontext

import torch

DTYPES = ("auto", "float32", "bfloat16", "float64")


def compute_dtype(name, device):
    """"auto" | "float32" | "bfloat16" | "float64" -> the torch dtype for `device` (a torch.device)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def weight_dtype(dtype):
    """The dtype of the weights (and so of the optimizer state and the gradient reduce) for a
    compute dtype: float32, except float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast(device, dtype):
    """A context that runs the forward in `dtype` (nothing to do where it is the weights' dtype)."""
    return nullcontext() if dtype == weight_dtype(dtype) else torch.autocast(device.type, dtype=dtype)
