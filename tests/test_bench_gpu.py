"""scripts/bench_gpu/ runs every section it has on a machine without a GPU (`--dry-run`: the
CPU, a tiny model), so the one GPU run a session gets is not spent on the script's own bugs
(the train section: tests/test_bench_gpu_train.py, a file of its own so that the two run side by
side).

The numbers of a dry run measure nothing; what is checked is that each section ran and
wrote its page, and the checks the script makes on the GPU: exact mode = AR and AR alone = AR
in a batch (eager, compiled, the device loops), no graph built after a decoder's warm-up, and
that every row has its steady state and every observed row its kernel count."""

import json

import pytest
import torch

from scripts.bench_gpu.__main__ import main as bench_gpu_main

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py: it counts graphs


def test_a_dry_run_runs_every_section_and_its_checks_hold(tmp_path, eager_compile):
    # conftest.py's eager_compile: the graphs and recompile counts are dynamo's, the inductor
    # compile of each shape, tested in test_compile.py, is not paid again here
    out = tmp_path / "gpu"
    rc = bench_gpu_main(["--dry-run", "--out", str(out), "--batch-sizes", "1,2", "--new-tokens", "4",
                         "--sections", "decode,main,toy"])  # train: tests/test_bench_gpu_train.py
    assert rc == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    page = (tmp_path / "gpu.md").read_text()
    assert "errors" not in res and res["skipped"] == [], (res.get("errors"), res["skipped"])
    assert "dry run" in res["machine"]

    rows = {(r["decoder"], r["batch"]): r for r in res["decode"]["rows"]}
    ours = ["AR", "tau=0.95 window", "exact K=1", "exact K=2", "exact K=4"]
    for batch in (1, 2):
        for name in ours:
            assert (name, batch) in rows and (name + " compiled", batch) in rows
            assert rows[name + " compiled", batch]["recompiles_after_warmup"] == 0
            assert rows[name + " compiled", batch]["graphs_at_warmup"] >= 1
        for impl in ("dynamic", "static"):
            assert (f"HF generate ({impl} cache)", batch) in rows
    # exact mode = AR for every exact decoder at every batch, eager, compiled and on the device
    checks = {(c["check"], c["batch"]): c for c in res["exact"]}
    assert len(checks) == 2 * 3 * 2 + 2 * 2 + 1  # and at the tried row tile (4 on the CPU), batch 1
    assert ("exact K=4 device loop compiled = AR device loop compiled", 2) in checks
    assert ("exact K=2 device loop compiled, tile 4 = AR device loop compiled, tile 4", 1) in checks
    for (_, batch), c in checks.items():
        assert c["rows"] == batch and c["rows_equal"] == batch, c
    alone = {(c["check"], c["batch"]): c for c in res["alone"]}
    assert set(alone) == {("AR alone = AR in the batch", 2),
                          ("AR compiled alone = AR compiled in the batch", 2)}
    assert all(c["rows_equal"] == c["rows"] == 2 for c in alone.values())

    for name in ("AR", "tau=0.95 window", "exact K=2", "exact K=4"):
        loop = {r["batch"]: r for r in res["decode"]["rows"]
                if r["decoder"] == name + " device loop compiled"}
        assert set(loop) == {1, 2} and all(r["recompiles_after_warmup"] == 0 for r in loop.values())
        assert all(r["kernels_per_forward"] > 0 and r["syncs_per_token"] is None for r in loop.values())
    assert all(r["steady_ms_per_forward"] > 0 for r in res["decode"]["rows"])
    assert "AR device loop" in page and "x HF's static cache" in page  # the targets' lines
    assert res["main"]["returncode"] == 0, res["main"]["last_lines"]
    # the toy section decodes the checkpoint the main job wrote: exact K = 2 = AR there too
    toy = {(r["decoder"], r["batch"]): r for r in res["toy"]["rows"]}
    for name in ("AR", "tau=0.9 window", "exact K=2"):
        for suffix in ("", " compiled"):
            assert {(name + suffix, 1), (name + suffix, 2)} <= set(toy)
            assert toy[name + suffix, 2]["recompiles_after_warmup"] == 0
    assert len(res["toy"]["exact"]) == 4
    assert all(c["rows_equal"] == c["rows"] == c["batch"] for c in res["toy"]["exact"])
    for heading in ("## Decoding", "## Main job", "## Decoding the trained toy"):
        assert heading in page


def test_without_cuda_it_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu_main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


def test_an_unknown_section_is_named(capsys):
    assert bench_gpu_main(["--dry-run", "--sections", "decode,trian"]) == 2
    assert "trian" in capsys.readouterr().out
