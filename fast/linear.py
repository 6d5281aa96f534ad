"""FastLinear: nn.Linear with the weight packed once for oneDNN, and row tiles in bf16/fp16.

Two devices, both invisible in exact arithmetic:

Packing. On the CPU, oneDNN's matmul from a weight laid out once for it (the ops torch.compile's
CPU prepacking uses when the row count varies) costs about one row's time for the 1-20 rows
of a decoding step, a row less than F.linear (SmolLM2, 2 threads: results/SPEED.md). `pack`
gives every fp32 or bf16 CPU FastLinear that second copy. Parameters, names, values and the
head tie stay; training, gradients, forwards of more than `packed_max_rows` rows and a weight
changed since packing take F.linear. The price: a second copy of every weight matrix, and
oneDNN's buffers per row count (~220 MB for SmolLM2). bf16 weights stay unpacked where oneDNN
refuses them (no AVX512BW/VL/DQ or AVX-NE-CONVERT, or ONEDNN_MAX_CPU_ISA below them).

Row invariance. A bf16 (or fp16) output keeps 8 significant bits, so two summation orders of
the same row, equal to ~1e-7 in fp32, round apart now and then, and the next layers carry that
ulp on. Matmul and attention kernels pick their summation order by the shape of the call
(oneDNN: AMX tiles, AVX-512 or AVX2 code and how to split a sum over threads; cuBLAS and the
CUDA attention kernels: tiles and split-K), so the same row could come out differently alone
(an AR step), among a batch, or among exact mode's drafts; exact mode is exact only if it does
not. So in LOW_PRECISION, without gradients, every FastLinear runs the rows of all batch rows
together in calls of exactly `row_tile` rows, the last tile padded: 16 on a CPU with bf16
units, where the packed matmul streams the weights once for up to 16 rows at about one row's
cost; 1 (each row alone) on a CPU that emulates bf16, where every row costs its own
arithmetic anyway; 128 on CUDA. attention.py does the same for attention. What this assumes
of a kernel is only that it gives every row of one call the same arithmetic (true of a
matmul: a row is one sum per output, whatever its neighbours). tests/test_bf16.py proves the
construction with kernels made to sum differently at every shape.
"""

import itertools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from util.precision import LOW_PRECISION, cpu_bf16_units, onednn_packs_bf16

ROW_TILE = {"cpu": 16, "cpu without bf16 units": 1, "cuda": 128}
_cpu_row_tile = []  # the CPU's row tile, asked once: the answer holds for the process


def row_tile(device):
    """Rows per matmul call in LOW_PRECISION decoding on `device` (one number per machine)."""
    if device.type == "cuda":
        return ROW_TILE["cuda"]
    if not _cpu_row_tile:
        _cpu_row_tile.append(ROW_TILE["cpu" if cpu_bf16_units()[0] else "cpu without bf16 units"])
    return _cpu_row_tile[0]


def set_row_tile(device, n):
    """Make `n` the row tile on `device` (a torch.device) for this process -> the one it replaces
    (a benchmark's knob: scripts/bench_gpu measures which tile is cheapest on a GPU; every tile
    is row-invariant, the construction is the same)."""
    old = row_tile(device)
    if device.type == "cuda":
        ROW_TILE["cuda"] = n
    else:
        _cpu_row_tile[0] = n
    return old


def padded(x, n, dim):
    """x and copies of its first row along `dim`, n rows in all (the tiles' padding)."""
    shape = x.shape[:dim] + (n - x.shape[dim],) + x.shape[dim + 1:]
    return torch.cat([x, x.narrow(dim, 0, 1).expand(shape)], dim)


def in_tiles(f, x, n):
    """f over the rows of x (M, C) in calls of exactly n rows, the last tile padded -> (M, C')."""
    M = x.shape[0]
    x = padded(x, -(-M // n) * n, 0)
    return torch.cat([f(t) for t in x.split(n)])[:M]


class FastLinear(nn.Linear):
    """nn.Linear (`make_fast` swaps its class in: same parameters), in tiles of `row_tile` rows
    in LOW_PRECISION without gradients, each tile from the packed copy where there is one."""

    packed = None  # (weight key, packed tensor), set by `pack`
    slot = None  # its key in PACKED, set by `pack`
    # oneDNN keeps a buffer of the output's size for every row count it has run, so the packed
    # copy serves small row counts only (a bounded set: ROW_TILE in bf16); prefills and
    # teacher-forced forwards of fp32 models take F.linear, whose cost per row is low there
    packed_max_rows = 64

    def forward(self, x):
        if torch.is_grad_enabled() or x.dtype not in LOW_PRECISION:
            return self.product(x)
        rows = x.reshape(-1, x.shape[-1])  # (M, C_in)
        return in_tiles(self.product, rows, row_tile(x.device)).reshape(*x.shape[:-1], -1)

    def product(self, x):
        p = self.packed
        if p is not None and not torch.is_grad_enabled() and x.dtype == self.weight.dtype and x.is_cpu \
                and x.numel() <= self.packed_max_rows * x.shape[-1]:
            if torch.compiler.is_compiling():  # one opaque call in the graph (inductor cannot trace oneDNN's)
                return packed_linear(x, self.weight, self.bias, self.slot)
            return from_packed(p, x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def from_packed(packed, x, weight, bias):
    """x @ weight.T + bias from `packed` (a FastLinear's packed copy, or None), or F.linear if
    `weight` is not the one it was packed from (another storage, or changed in place since)."""
    if packed is None or packed[0] != _weight_key(weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed[1], bias, "none", [], "")


def _weight_key(w):
    """What identifies a weight's values cheaply: its storage and in-place version counter."""
    return w.data_ptr(), w._version


_SLOTS = itertools.count()
PACKED = weakref.WeakValueDictionary()  # slot -> a FastLinear with a packed copy (a compiled step's name)


def _packed_linear(x, weight, bias, slot):
    """FastLinear.product's packed matmul as one opaque call of a compiled step (inductor cannot
    trace oneDNN's packed op; its own fp32 prepacking, MKL's, is 1.6x slower at 9 rows here):
    the packed copy of FastLinear PACKED[slot], or F.linear if `weight` is not the one it was
    packed from. A plain library op: torch.library.custom_op's wrapper costs ~100 us a call."""
    m = PACKED.get(slot)
    return from_packed(None if m is None else m.packed, x, weight, bias)


_LIB = torch.library.Library("mars", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, int slot) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("mars::packed_linear", lambda x, weight, bias, slot:
                            x.new_empty(*x.shape[:-1], weight.shape[0]), lib=_LIB)
packed_linear = torch.ops.mars.packed_linear


def pack(model, rows=ROW_TILE["cpu"]):
    """Give every fp32 or bf16 CPU FastLinear of `model` a copy of its weight packed for oneDNN
    (in place; returns the model). `rows`: the row count oneDNN lays it out for."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return model
    dtypes = (torch.float32, torch.bfloat16) if onednn_packs_bf16() else (torch.float32,)
    with torch.no_grad():
        for module in model.modules():
            w = module.weight if isinstance(module, FastLinear) else None
            if w is not None and w.dtype in dtypes and w.is_cpu:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
                module.packed = (_weight_key(w), packed)
                module.slot = next(_SLOTS)
                PACKED[module.slot] = module
    return model
