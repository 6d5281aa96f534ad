"""Proof for reproduce.py's shortcut: every MARS variant starts from ONE saved AR stage.

reproduce.py trains the AR stage once (ar_stage) and runs each MARS variant as
`train.py --init_from=<ar_stage>/ar --ar_steps=0`. Its docstring claims that mars_b4 is
then what the default two-stage `python train.py` does. Proof: with reproduce.py's own
settings for the two runs, the final MARS weights and the logged MARS losses equal those
of one uninterrupted two-stage run, bit for bit (CPU, one thread).
"""

import json

import torch
from conftest import write_rows
from safetensors.torch import load_file

import train
from data.bpe import train_bpe
from scripts import reproduce


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
    spec = {v["name"]: v for v in reproduce.variants(A, M, str(root))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in ("ar_stage", "mars_b4"):  # reproduce.py's way, its settings
            train.main(tiny + [reproduce.arg(k, x) for k, x in spec[name]["train"].items()]
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
