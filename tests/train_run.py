"""The tiny training run that tests/test_train_loop.py and tests/test_train_distributed.py share.

Not collected by pytest (no test_ prefix). Its data directory is conftest's data_dir fixture;
this module holds what both files need to make and read a run:
  args(data_dir, out_dir, *extra)   train.py's arguments: 2 layers, STEPS AR SFT + STEPS MARS
                                    steps (docs/spec.md §2-§4), batch 8 in micro-batches of 4,
                                    a checkpoint every 5 steps; extra ones override
  records(out)                      the logged train and val records, without the wall-clock field
  weights(d)                        a saved model's tensors, by name
It states no claim; each test file states its own.
"""

from pathlib import Path

from safetensors.torch import load_file

from util.runlog import read_log

REPO = Path(__file__).resolve().parent.parent
STEPS = 10  # per stage; checkpoints every 5


def args(data_dir, out_dir, *extra):
    return [f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--n_layer=2", "--n_embd=32", "--n_head=4",
            "--n_kv_head=2", "--intermediate=64", "--max_len=48", "--batch_size=8", "--micro_batch_size=4",
            "--lr=3e-3", f"--ar_steps={STEPS}", f"--mars_steps={STEPS}", "--log_interval=2",
            f"--eval_interval={STEPS}", "--eval_rows=8", "--ckpt_interval=5", "--eval_at_end=false", *extra]


def records(out):
    """The logged train and val records, without the wall-clock field."""
    return [{k: v for k, v in r.items() if k != "tok_s"} for r in read_log(out / "log.jsonl")
            if r["kind"] in ("train", "val")]


def weights(d):
    return load_file(str(d / "model.safetensors"))
