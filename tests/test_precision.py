"""What `--dtype auto` picks and what the command line says (issue 39; util/precision.py): bf16
exactly where the CPU has bf16 units (AMX or AVX512-BF16), ONEDNN_MAX_CPU_ISA lets oneDNN use them
and oneDNN takes bf16 weights; bf16 decodes (unpacked) where oneDNN refuses bf16 weights, with no
traceback; generate.py says which dtype it chose, and uses it. (Split from tests/test_bf16.py,
which keeps the proofs that bf16 decoding is row-invariant and exact mode exact.)"""

import os
import subprocess
import sys

import pytest
import torch

import fast
import fast.argmax
import fast.linear
import generate as generate_cli
import sampling
from decoding import greedy_pick
from fast.linear import FastLinear
from tests.conftest import make_hf_model
from util import precision
from util.precision import choose_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- auto
@pytest.mark.parametrize("has", [True, False])
def test_auto_picks_bf16_where_the_cpu_has_bf16_units(monkeypatch, has):
    """The rule written out: auto = bf16 on CUDA and on a CPU with bf16 units, fp32 on a CPU
    without; an explicit dtype is taken as given. The capability check is replaced, so the
    test means the same on every CPU."""
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: (has, "WHY"))
    want = torch.bfloat16 if has else torch.float32
    assert choose_dtype("auto", "cpu") == (want, "auto: WHY")
    assert choose_dtype("auto", "cuda")[0] == torch.bfloat16
    assert choose_dtype("float32", "cpu")[0] == torch.float32
    assert choose_dtype("bfloat16", "cpu")[0] == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("bf16", "cpu")


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA, any case; its CPU dispatcher control docs), written out:
# those at or above AVX512_CORE_BF16, which keep a CPU's bf16 units (AVX512-BF16, AMX) within
# reach, and those below it, which make oneDNN emulate bf16 or refuse it
CAPS_THAT_REACH_BF16 = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                        "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
                        "AVX10_2_512", "AVX10_2_512_AMX_2")
CAPS_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def onednn_takes_a_bf16_weight():
    """Asked of oneDNN here, by packing a bf16 weight (another shape than the code's own probe)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 32, dtype=torch.bfloat16), 1)
    except (RuntimeError, AttributeError):
        return False
    return torch.backends.mkldnn.is_available()


def test_the_capability_check_asks_torch_and_onednn(monkeypatch):
    """cpu_bf16_units says yes exactly when torch reports AMX or AVX512-BF16 on this CPU, no
    ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA, in any case) caps oneDNN below them, and oneDNN
    takes a bf16 weight: with this process's own cap (if any) and with each cap written out
    above set in turn (the variable is read at each call; oneDNN itself keeps the process's)."""
    cpu = torch.cpu
    units = cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported()
    takes = onednn_takes_a_bf16_weight()
    own = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    reach = own is None or own.strip().upper() in CAPS_THAT_REACH_BF16
    assert precision.cpu_bf16_units()[0] == (units and reach and takes), own
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        for caps, reach in ((CAPS_THAT_REACH_BF16, True), (CAPS_BELOW_BF16, False)):
            for cap in caps + tuple(c.lower() for c in caps):
                monkeypatch.setenv(variable, cap)
                assert precision.cpu_bf16_units()[0] == (units and reach and takes), (variable, cap)


@pytest.mark.parametrize("amx, avx512_bf16, cap, packs, want", [
    (True, True, None, True, "the CPU has AMX"),
    (True, True, "AVX512_CORE_AMX", True, "the CPU has AMX"),
    (True, True, "avx512_core_bf16", True, "the CPU has AVX512-BF16"),
    (True, True, "AVX512_CORE", True, None),  # a Skylake / Cascade Lake Xeon: bf16 emulated
    (True, True, "AVX2", False, None),  # a laptop: oneDNN refuses bf16 weights
    (False, True, None, True, "the CPU has AVX512-BF16"),  # AMD Zen 4
    (False, False, None, False, None),  # AVX2 only
    (False, True, None, False, None),  # flags say yes, oneDNN says no: the kernels decide
])
def test_auto_follows_the_instruction_set_onednn_may_use(monkeypatch, amx, avx512_bf16, cap, packs, want):
    """The rule written out: bf16 from `auto` only where the CPU has bf16 units, the oneDNN cap
    (ONEDNN_MAX_CPU_ISA) reaches them and oneDNN packs bf16 weights; the reason names which."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(precision, "onednn_packs_bf16", lambda: packs)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    has, why = precision.cpu_bf16_units()
    assert has == (want is not None)
    if want is not None:
        assert why == want
    elif cap is not None and avx512_bf16:
        assert cap.upper() in why or "oneDNN" in why


def test_bf16_decodes_where_onednn_refuses_bf16_weights(tmp_path, capsys):
    """generate.py --dtype bfloat16 (which decodes through the engine) with oneDNN capped at
    AVX2, where it refuses to pack bf16 weights (before issue 39: a traceback), decodes in a
    fresh process (the cap is read at start), says bfloat16 on the engine and prints no
    traceback; its reply is this process's (uncapped) one."""
    make_hf_model(tmp_path, vocab_size=32, intermediate_size=64)
    argv = ["--ckpt", str(tmp_path), "--prompt-ids", "3,4,5", "--mask-id", "31", "--block-size", "2",
            "--exact", "--drafts", "2", "--max-new-tokens", "6", "--dtype", "bfloat16"]
    env = {k: v for k, v in os.environ.items() if k != "DNNL_MAX_CPU_ISA"}
    env.update(OMP_NUM_THREADS="1", ONEDNN_MAX_CPU_ISA="AVX2")
    r = subprocess.run([sys.executable, "generate.py", *argv], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "[bfloat16: as set; the engine]" in r.stderr.splitlines()
    assert generate_cli.main(argv) == 0
    assert r.stdout == capsys.readouterr().out and r.stdout.strip()


@pytest.mark.parametrize("flags, has, line", [
    (["--fast"], True, "[bfloat16: auto: THE REASON; the engine]"),
    (["--fast"], False, "[float32: auto: THE REASON; the engine]"),
    (["--dtype", "auto"], True, "[bfloat16: auto: THE REASON; the engine]"),
    ([], True, "[float32: the reference (--fast for the engine)]"),  # bf16 units or not
])
def test_generate_says_which_dtype_it_chose_and_uses_it(tmp_path, monkeypatch, capsys, flags, has, line):
    """generate.py's stderr names the dtype, why and what runs in one line, and the model it
    decodes with has that dtype and is the engine (fast.make_fast: FastQwen2, every Linear a
    FastLinear, the block argmax) or the plain reference (the loader is wrapped to see it).
    Without --fast (or a --dtype that implies it) the reference runs, in float32 even where the
    CPU has bf16 units."""
    make_hf_model(tmp_path, vocab_size=32, intermediate_size=64)
    capsys.readouterr()  # what saving the checkpoint printed
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: (has, "THE REASON"))
    seen = []
    real = generate_cli.load_checkpoint
    monkeypatch.setattr(generate_cli, "load_checkpoint", lambda *a: seen.append(real(*a)) or seen[-1])
    generate_cli.main(["--ckpt", str(tmp_path), "--prompt-ids", "3,4,5", "--mask-id", "31",
                       "--block-size", "2", "--tau", "1", "--max-new-tokens", "3", *flags])
    assert capsys.readouterr().err.splitlines()[0] == line
    model, engine = seen[0].model, line.endswith("; the engine]")
    assert model.lm_head.weight.dtype == (torch.bfloat16 if line.startswith("[bfloat16") else torch.float32)
    assert isinstance(model, fast.FastQwen2) == engine
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, FastLinear) == engine for m in linears)
    assert (greedy_pick(model) is fast.argmax.block_argmax) == engine  # the engine's pick, on its model
    assert sampling.argmax is not fast.argmax.block_argmax  # and no core name rebound
