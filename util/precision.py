"""Compute dtype and autocast, the one rule for train.py and the benchmarks.

Weights stay fp32 (the optimizer's copy); matmuls run in the compute dtype through
autocast. "auto" is bfloat16 on CUDA and float32 on the CPU, where a bf16 matmul is
many times slower than fp32 (measured here: about 25x).
"""

from contextlib import nullcontext

import torch

DTYPES = ("auto", "float32", "bfloat16")


def compute_dtype(name, device):
    """"auto" | "float32" | "bfloat16" -> the torch dtype for `device` (a torch.device)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def autocast(device, dtype):
    """A context that runs the forward in `dtype` (nothing to do in fp32)."""
    return nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
