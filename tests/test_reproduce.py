"""Proof for scripts.reproduce's shortcut: every MARS variant starts from ONE saved AR stage.

scripts.reproduce trains the AR stage once (ar_stage) and runs each MARS variant as
`train.py --init_from=<ar_stage>/ar --ar_steps=0`. Its docstring claims that mars_b4 is
then what the default two-stage `python train.py` does. Proof: with scripts.reproduce's own
settings for the two runs, the final MARS weights and the logged MARS losses equal those
of one uninterrupted two-stage run, bit for bit (CPU, one thread). And the benchmarks it runs
name scripts that exist, with options they accept, and each log lands on the page.
"""

import importlib.util
import json

import pytest
import torch
from conftest import write_rows
from safetensors.torch import load_file

import train
from data.bpe import train_bpe
from scripts import bench_generate
from scripts.reproduce import __main__ as cli
from scripts.reproduce import report, runs, training


def test_mars_from_the_saved_ar_stage_equals_the_two_stage_run(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "train.npz", 40, 0)
    write_rows(data / "val.npz", 8, 1)
    train_bpe(["<|im_start|>user\nhello world<|im_end|>\n"], 8).save(data / "tokenizer")
    tiny = [f"--data_dir={data}", "--n_layer=2", "--n_embd=32", "--n_head=4", "--n_kv_head=2",
            "--intermediate=64", "--max_len=48", "--batch_size=8", "--micro_batch_size=4", "--lr=3e-3",
            "--log_interval=1", "--eval_interval=100", "--eval_at_end=false"]
    A, M, root = 4, 4, tmp_path / "root"
    spec = {v["name"]: v for v in runs.variants(A, M, str(root))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in ("ar_stage", "mars_b4"):  # scripts.reproduce's way, its settings
            train.main(tiny + [runs.arg(k, x) for k, x in spec[name]["train"].items()]
                       + [f"--out_dir={root / name}"])
        two = tmp_path / "two_stage"  # the default run's way
        train.main(tiny + [f"--ar_steps={A}", f"--mars_steps={M}", f"--out_dir={two}"])
    finally:
        torch.set_num_threads(threads)
    ours = load_file(f"{spec['mars_b4']['ckpt']}/model.safetensors")
    ref, start = load_file(f"{two}/mars/model.safetensors"), load_file(f"{two}/ar/model.safetensors")
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    assert not all(torch.equal(ours[k], start[k]) for k in ref)  # the MARS stage did train
    log = lambda out: map(json.loads, (out / "log.jsonl").read_text().splitlines())
    mars_losses = lambda out: [r["loss"] for r in log(out) if r["kind"] == "train" and r["stage"] == "mars"]
    assert len(mars_losses(two)) == M
    assert mars_losses(root / "mars_b4") == mars_losses(two)


def test_seeds_scheduling_failure_and_verdicts(tmp_path, monkeypatch):
    """plan() makes one run per variant and seed (train.py --seed=S, its own s<S>/ directory);
    train_all starts every AR stage before the MARS runs that wait for it, and a failure stops
    the queue: nothing starts after it and the failure is raised. The claims' rule: a verdict
    only from non-overlapping min–max ranges of at least two seeds each."""
    a = cli.parse_args(["--seeds", "0,1", "--jobs", "1", "--results", str(tmp_path / "r"),
                        "--out", str(tmp_path / "o"), "--only", "mars_b4,ar_sft"])
    P, vs = runs.plan(a)
    (tmp_path / "r" / "runs").mkdir(parents=True)
    assert [v["key"] for v in vs] == ["ar_stage.s0", "mars_b4.s0", "ar_sft.s0",
                                      "ar_stage.s1", "mars_b4.s1", "ar_sft.s1"]
    for v in vs:
        assert f"--seed={v['seed']}" in v["train_cmd"] and f"/s{v['seed']}/" in v["out_dir"]
    started = []

    def fake(v, P, env, old):
        started.append(v["key"])
        if v["key"] == "ar_stage.s1":
            raise SystemExit("ar_stage.s1: training failed")
        return {"name": v["name"], "seed": v["seed"], "results": {"1.0": {"accuracy": 1.0}}}

    monkeypatch.setattr(training, "run_variant", fake)
    with pytest.raises(SystemExit, match="ar_stage.s1: training failed"):
        training.train_all(a, P, vs, lambda: "")
    assert started == ["ar_stage.s0", "ar_stage.s1"]  # the AR stages first; nothing after the failure
    started.clear()
    monkeypatch.setattr(training, "run_variant", lambda v, *_: started.append(v["key"]) or
                        {"name": v["name"], "seed": v["seed"], "results": {}})
    got = training.train_all(a, P, vs, lambda: "")
    assert started[:2] == ["ar_stage.s0", "ar_stage.s1"] and sorted(got) == sorted(v["key"] for v in vs)
    assert report.compare([3.0, 4.0], [1.0, 2.5]) == "higher"
    assert report.compare([1.0, 2.0], [2.5, 3.0]) == "lower"
    assert report.compare([1.0, 3.0], [2.0, 4.0]) == "within the spread"
    assert report.compare([97.0], [96.0]) == "one seed: no verdict"
    assert report.fmt([1.0, 2.0, 6.0]) == "3.0 (1.0–6.0)" and report.fmt([]) == "–"
    with pytest.raises(SystemExit, match="must include 1"):
        runs.plan(cli.parse_args(["--taus", "0.9"]))


def test_the_benchmark_commands_run_and_reach_the_page(tmp_path):
    """Each benchmark command (printed on results/RESULTS.md for a user to run) names a script
    module that exists; bench_generate parses its options, exact mode's rows (--drafts) among
    them; and report.py puts every benchmark's log on the page."""
    P, _ = runs.plan(cli.parse_args(["--results", str(tmp_path / "r"), "--out", str(tmp_path / "o")]))
    for quick in (False, True):
        cmds = runs.bench_commands(P, "ckpt", quick)
        for cmd in cmds.values():
            assert cmd[1] == "-m" and importlib.util.find_spec(cmd[2]) is not None, cmd
        assert bench_generate.parse_args(cmds["bench_generate"][3:]).drafts == [2, 3]
    for name in cmds:
        (tmp_path / f"{name}.txt").write_text(f"the log of {name}\n")
    page = "\n".join(report.bench_sections(str(tmp_path)))
    assert all(f"the log of {name}" in page for name in cmds)
