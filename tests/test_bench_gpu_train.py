"""scripts/bench_gpu/'s train section runs on a machine without a GPU (`--dry-run --sections
train`: the CPU, a tiny model; the other sections: tests/test_bench_gpu.py). Its numbers measure
nothing; checked: every row ran, the static step's rows first, the model FLOPs of util/flops.py
(MARS does more work than AR; the static step is credited the reference's work), no MFU claimed
without a GPU peak, the estimate beside each MARS row."""

import json

import pytest

from scripts.bench_gpu.__main__ import main as bench_gpu_main

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py: it counts graphs


def test_a_dry_run_of_the_train_section(tmp_path, eager_compile):
    assert bench_gpu_main(["--dry-run", "--out", str(tmp_path / "gpu"), "--sections", "train"]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert "errors" not in res and res["skipped"] == [], (res.get("errors"), res["skipped"])
    assert [(r["loss"], r["compiled"]) for r in res["train"]["rows"]] == [  # the static step first
        ("MARS static", True), ("AR static", True), ("MARS static, no checkpointing", True), ("AR", False),
        ("MARS", False), ("AR", True), ("MARS", True), ("MARS static, 2 x 32", True),
        ("AR static, 2 x 32", True)]  # (and "MARS static flex" on CUDA; 8 x 1024 there)
    flops = {r["loss"]: r["tflops"] for r in res["train"]["rows"]}
    assert flops["MARS"] > 1.5 * flops["AR"] > 0 and flops["MARS static"] == flops["MARS"]  # util/flops.py
    assert all(r["mfu"] is None for r in res["train"]["rows"])  # no GPU peak on a CPU: no MFU claimed
    assert all((r["estimate_GiB"] is not None) == r["loss"].startswith("MARS") for r in res["train"]["rows"])
    assert "## Training step" in (tmp_path / "gpu.md").read_text()
