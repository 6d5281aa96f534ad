"""Compute dtype and autocast, the one rule for train.py, generate.py and the benchmarks.

"auto" picks what the hardware computes fastest without changing the method: bfloat16 on
CUDA, and on the CPU bfloat16 where it has bf16 matmul units (Intel AMX, or AVX512-BF16 as on
AMD Zen 4 and later Xeons), float32 elsewhere. The difference is large both ways: on a 2-core
AMD EPYC with AVX512-BF16 (no AMX) a bf16 matmul of SmolLM2's shapes runs 1.4-4x faster than
fp32 (results/SPEED.md, "bf16 on the CPU"); on a CPU with neither, bf16 is emulated and slower
than fp32 (on an AVX2-only AMD EPYC, 2x at one row: results/SPEED.md). The check asks torch
(cpuinfo) and oneDNN, not /proc. `--dtype float32` (or bfloat16) overrides it everywhere.

Training: weights stay fp32 (the optimizer's copy) and matmuls run in the compute dtype
through autocast; the losses are reduced in fp32 (mars.py). Decoding: the weights themselves
are cast to the compute dtype (checkpoint.load_checkpoint); fast/linear.py says why a bf16
decode step through the engine (fast.make_fast) is row-invariant (the reference promises no such thing).
"float64" is for proofs, not for training: weights, optimizer state, compute and the
gradient all-reduce all in float64, so two runs that differ only in summation order
(one process vs DDP / FSDP) agree to ~1e-15 on any machine (tests/test_train_distributed.py).
"""

import functools
import os
from contextlib import nullcontext

import torch

DTYPES = ("auto", "float32", "bfloat16", "float64")
# dtypes whose outputs keep the last-bit difference of two summation orders: the engine's
# decoding in them runs every matmul and attention call at one fixed shape (fast/linear.py,
# "Row invariance"), so a row's bits are independent of the rows beside it
LOW_PRECISION = (torch.bfloat16, torch.float16)


def dtype_name(dtype):
    """torch.bfloat16 -> "bfloat16", as settings, configs and logs spell it."""
    return str(dtype).removeprefix("torch.")


# oneDNN instruction-set caps (ONEDNN_MAX_CPU_ISA) that still reach bf16 matmul units; the
# others (AVX512_CORE, AVX2_VNNI, AVX2, SSE41, ...) make oneDNN emulate bf16, or refuse it
BF16_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
             "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
             "AVX10_2_512", "AVX10_2_512_AMX_2")


def onednn_isa_cap():
    """The instruction set oneDNN is capped at by the environment (upper case), or None."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap else None


@functools.cache
def onednn_packs_bf16():
    """Whether oneDNN packs a bf16 weight here (fast/linear.py's pack). It refuses without
    AVX512BW/VL/DQ or AVX-NE-CONVERT, also when ONEDNN_MAX_CPU_ISA caps it below them: asked by
    trying, once, so the answer is what the kernels do, not what a flag list says."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
    except RuntimeError:
        return False
    return True


def cpu_bf16_units():
    """(True, what) when this CPU has bf16 matmul units that oneDNN may use, else (False, why not).
    The CPU's flags come from torch (cpuinfo); ONEDNN_MAX_CPU_ISA, when set, can take the units
    away (an Intel CPU then plays an older one), and oneDNN must accept bf16 weights."""
    cpu = torch.cpu  # private but stable since torch 2.3: cpuinfo's flags; absent -> treated as no
    amx = getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    avx512_bf16 = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
    if not (amx or avx512_bf16):
        return False, "the CPU has no bf16 units (no AMX, no AVX512-BF16)"
    cap = onednn_isa_cap()
    if cap is not None and cap not in BF16_ISAS:
        return False, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off the CPU's bf16 units"
    if not onednn_packs_bf16():
        return False, "oneDNN does not take bf16 weights on this CPU"
    if amx and (cap is None or "AMX" in cap or cap in ("ALL", "DEFAULT")):
        return True, "the CPU has AMX"
    if avx512_bf16:
        return True, "the CPU has AVX512-BF16"
    return False, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off AMX, and the CPU has no AVX512-BF16"


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
