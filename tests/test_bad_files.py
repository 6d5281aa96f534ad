"""A broken file is one line, not a traceback (issue 32): every file read from a checkpoint
or data directory, broken each way a copy breaks (cut short, emptied, not JSON, a key of the
wrong type, a key missing), makes the CLI that reads it print `error: FILE: what is wrong`
and exit non-zero, and write nothing.

The many cases run the CLIs in-process (generate.main, evaluate.main, train.main: a Python +
torch start-up costs seconds); one subprocess each of generate.py and train.py proves the
real exit path: the same line on stderr and no traceback.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_rows
from safetensors.torch import load_file, save_file

import evaluate
import generate
import train
from checkpoint import write_release
from data.batches import fingerprint
from data.bpe import train_bpe
from data.prepare import load_npz
from model import Qwen2, Qwen2Config, init_weights
from settings import Settings, parse_settings

REPO = Path(__file__).resolve().parent.parent
DROP = object()  # in a corruption: delete this key
VOCAB = 287  # train_bpe below: 256 bytes + 8 merges + 22 added tokens + <|mask|>


def corrupt(file, how):
    """Break `file` in place: "truncated" (its first half), "empty", bytes (the new content),
    or {key: value} (DROP deletes the key) applied to a JSON, .npz or torch.save dict."""
    data = file.read_bytes()
    if how in ("truncated", "empty"):
        file.write_bytes(data[: len(data) // 2] if how == "truncated" else b"")
        return
    if isinstance(how, bytes):
        file.write_bytes(how)
        return
    kind = file.suffix
    d = dict(np.load(file)) if kind == ".npz" else torch.load(file) if kind == ".pt" else json.loads(data)
    for k, v in how.items():
        d[k] = v
        if v is DROP:
            del d[k]
    if kind == ".npz":
        with open(file, "wb") as f:
            np.savez(f, **d)
    elif kind == ".pt":
        torch.save(d, file)
    else:
        file.write_text(json.dumps(d))


def snapshot(d):
    """{relative path: sha256} of every file under d (None when d does not exist)."""
    if not d.exists():
        return None
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in d.rglob("*") if p.is_file()}


def train_args(data, out, *extra):
    return [f"--data_dir={data}", f"--out_dir={out}", "--n_layer=1", "--n_embd=16", "--n_head=2",
            "--n_kv_head=1", "--intermediate=32", "--max_len=48", "--batch_size=4", "--micro_batch_size=4",
            "--ar_steps=1", "--mars_steps=1", "--eval_at_end=false", "--device=cpu", *extra]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Intact directories: "release" (a tiny MARS release: weights, tokenizer, mars.json,
    generation_config.json), "sharded" (its weights in two shards and an index), "slow" (its
    tokenizer as vocab.json + merges.txt only), "data" (train.npz, val.npz, tokenizer) and
    "out" (an out_dir whose ckpt/ train.main would resume from)."""
    root = tmp_path_factory.mktemp("good")
    tok = train_bpe(["<|im_start|>user\nhello world<|im_end|>\n"], 8)
    assert tok.vocab_size == VOCAB
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = init_weights(Qwen2(cfg), seed=0)
    special = {"mask": tok.mask_id, "eos": tok.eos_id, "pad": tok.pad_id}
    write_release(str(root / "release"), model, Settings(), special, tok, "mars", [tok.eos_id])
    shutil.copytree(root / "release", root / "slow")
    os.remove(root / "slow" / "tokenizer.json")
    shard_weights(root / "release", root / "sharded")
    data = root / "data"
    data.mkdir()
    write_rows(data / "train.npz", 16, 0)
    write_rows(data / "val.npz", 4, 1)
    tok.save(data / "tokenizer")
    ckpt = root / "out" / "ckpt"
    model.save_pretrained(str(ckpt))
    torch.save({"stage": "ar", "step": 1, "optimizer": {"state": {}, "param_groups": []},
                "settings": asdict(parse_settings(train_args(data, root / "out"))),
                "data": fingerprint(load_npz(str(data / "train.npz")))}, ckpt / "train_state.pt")
    return {k: root / k for k in ("release", "sharded", "slow", "data", "out")}


def shard_weights(src, dst):
    """dst = src with model.safetensors split in two shards named by an index (HF's layout)."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    os.remove(dst / "model.safetensors")
    keys, weight_map = sorted(state), {}
    for n, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:]), 1):
        name = f"model-0000{n}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def broken_copy(good, tmp_path, base, name, how):
    """A copy of good[base] with `name` (a path inside it) broken by `how` -> (dir, file)."""
    d = tmp_path / base
    shutil.copytree(good[base], d)
    corrupt(d / name, how)
    return d, d / name


def run_generate(ckpt, capsys):
    rc = generate.main(["--ckpt", str(ckpt), "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--tau", "1"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line(err, file, fragment):
    """stderr is exactly `error: FILE: ...` holding `fragment`, one line (no traceback)."""
    assert err.startswith(f"error: {file}: ") and err.count("\n") == 1, err
    assert fragment in err, err


CHECKPOINT_CASES = [  # (base directory, file, how it is broken, what the message must say)
    ("release", "config.json", "truncated", "not valid JSON"),
    ("release", "config.json", "empty", "empty file"),
    ("release", "config.json", b"{'hidden_size': 16}", "not valid JSON"),
    ("release", "config.json", b"[1, 2]", "expected a JSON object, got a list"),
    ("release", "config.json", {"hidden_size": "x"}, "key 'hidden_size' must be an int, got 'x'"),
    ("release", "config.json", {"num_attention_heads": 0}, "key 'num_attention_heads' must be >= 1, got 0"),
    ("release", "config.json", {"rope_theta": "big"}, "key 'rope_theta' must be a float, got 'big'"),
    ("release", "config.json", {"tie_word_embeddings": "yes"}, "key 'tie_word_embeddings' must be a bool"),
    ("release", "config.json", {"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ("release", "config.json", {"vocab_size": DROP}, "missing key(s) ['vocab_size']"),
    ("release", "config.json", {"eos_token_id": [1, None]}, "key 'eos_token_id' must be an int, got None"),
    ("release", "model.safetensors", "truncated", "not a readable safetensors file"),
    ("release", "model.safetensors", "empty", "not a readable safetensors file"),
    ("release", "model.safetensors", b"not weights at all", "not a readable safetensors file"),
    ("sharded", "model.safetensors.index.json", "truncated", "not valid JSON"),
    ("sharded", "model.safetensors.index.json", {"weight_map": [1]}, "no 'weight_map' object"),
    ("sharded", "model-00002-of-00002.safetensors", "truncated", "not a readable safetensors file"),
    ("release", "mars.json", "truncated", "not valid JSON"),
    ("release", "mars.json", "empty", "empty file"),
    ("release", "mars.json", {"block_size": "x"}, "key 'block_size' must be an int, got 'x'"),
    ("release", "mars.json", {"block_size": 0}, "key 'block_size' must be >= 1, got 0"),
    ("release", "mars.json", {"mask_id": 1.5}, "key 'mask_id' must be an int, got 1.5"),
    ("release", "mars.json", {"mask_id": VOCAB}, f"mask_id {VOCAB} is not below the model's vocab_size"),
    ("release", "generation_config.json", "truncated", "not valid JSON"),
    ("release", "generation_config.json", {"eos_token_id": "x"}, "key 'eos_token_id' must be an int"),
    ("release", "tokenizer.json", "truncated", "not valid JSON"),
    ("release", "tokenizer.json", "empty", "empty file"),
    ("release", "tokenizer.json", b"\xff\xfe{}", "not UTF-8 text"),
    ("release", "tokenizer.json", {"model": "x"}, "unexpected content (AttributeError"),
    ("release", "tokenizer.json", {"added_tokens": [{"id": 300}]},
     "unexpected content (KeyError: 'content')"),
    ("release", "tokenizer.json", {"added_tokens": [{"id": "x", "content": "<|a|>"}]},
     "key 'id' must be an int, got 'x'"),
    ("release", "tokenizer_config.json", "truncated", "not valid JSON"),
    ("release", "tokenizer_config.json", {"added_tokens_decoder": []}, "unexpected content (AttributeError"),
    ("release", "tokenizer_config.json", {"eos_token": 5}, "key 'eos_token' must be a str, got 5"),
    ("slow", "vocab.json", "truncated", "not valid JSON"),
    ("slow", "vocab.json", {"zz": "x"}, "key 'zz' must be an int, got 'x'"),
    ("slow", "merges.txt", b"\xff\xfe x\n", "not UTF-8 text"),
    ("slow", "merges.txt", b"a b c\n", "line 1 'a b c' is not two tokens"),
]


def test_intact_copies_load(good, capsys):
    """The control: the directories the cases break are sound (generate runs on each)."""
    for base in ("release", "sharded", "slow"):
        rc, out, err = run_generate(good[base], capsys)
        assert rc == 0 and out, (base, err)


@pytest.mark.parametrize("base, name, how, fragment", CHECKPOINT_CASES,
                         ids=[f"{b}/{n}-{h if isinstance(h, str) else 'edit'}-{i}"
                              for i, (b, n, h, _) in enumerate(CHECKPOINT_CASES)])
def test_generate_names_the_broken_checkpoint_file(good, tmp_path, capsys, base, name, how, fragment):
    ckpt, file = broken_copy(good, tmp_path, base, name, how)
    before = snapshot(ckpt)
    rc, out, err = run_generate(ckpt, capsys)
    assert rc == 2 and out == ""
    assert_one_line(err, file, fragment)
    assert snapshot(ckpt) == before


TRAIN_CASES = [  # (base directory, file, how it is broken, what the message must say)
    ("data", "train.npz", "truncated", "not a readable .npz file (BadZipFile"),
    ("data", "train.npz", "empty", "not a readable .npz file (EOFError"),
    ("data", "val.npz", b"not an npz file", "not a readable .npz file"),
    ("data", "train.npz", {"loss": DROP}, "missing array(s) ['loss']"),
    ("data", "train.npz", {"ids": np.zeros(10, np.float32)}, "wrong dtype: 'ids' is float32"),
    ("data", "tokenizer/tokenizer.json", "truncated", "not valid JSON"),
    ("init", "config.json", {"hidden_size": "x"}, "key 'hidden_size' must be an int"),
    ("init", "model.safetensors", "truncated", "not a readable safetensors file"),
    ("out", "ckpt/train_state.pt", "truncated", "not a readable torch.save file"),
    ("out", "ckpt/train_state.pt", "empty", "not a readable torch.save file"),
    ("out", "ckpt/train_state.pt", {"step": DROP}, "missing key 'step'"),
    ("out", "ckpt/train_state.pt", {"step": "x"}, "key 'step' must be an int, got 'x'"),
    ("out", "ckpt/train_state.pt", {"stage": "sft"}, "key 'stage' must be one of ('ar', 'mars'), got 'sft'"),
    ("out", "ckpt/model.safetensors", "truncated", "not a readable safetensors file"),
    ("out", "ckpt/config.json", {"num_hidden_layers": -1}, "key 'num_hidden_layers' must be >= 1, got -1"),
]


@pytest.mark.parametrize("base, name, how, fragment", TRAIN_CASES,
                         ids=[f"{b}/{n}-{h if isinstance(h, str) else 'edit'}-{i}"
                              for i, (b, n, h, _) in enumerate(TRAIN_CASES)])
def test_train_names_the_broken_file_and_writes_nothing(good, tmp_path, base, name, how, fragment):
    """data_dir's arrays and tokenizer, init_from's model and out_dir/ckpt (a resume)."""
    d, file = broken_copy(good, tmp_path, "release" if base == "init" else base, name, how)
    data, out = (d if base == "data" else good["data"]), (d if base == "out" else tmp_path / "out")
    extra = [f"--init_from={d}"] if base == "init" else []
    before = snapshot(out)
    with pytest.raises(SystemExit) as e:
        train.main(train_args(data, out, *extra))
    msg = str(e.value.code)
    assert msg.startswith(f"error: {file}: ") and "\n" not in msg and fragment in msg, msg
    assert snapshot(out) == before  # absent stays absent; a resume point stays as it was


@pytest.mark.parametrize("content, fragment", [(b'{"lr": ', "Expecting value"),
                                               (b'{"lr": "x"}', "lr must be a float, got 'x'")])
def test_train_config_file_is_named(good, tmp_path, content, fragment):
    """--config FILE.json (settings.py): cut short or of the wrong type."""
    cfg = tmp_path / "run.json"
    cfg.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        train.main(train_args(good["data"], tmp_path / "out", "--config", str(cfg)))
    assert str(cfg) in str(e.value.code) and fragment in str(e.value.code), e.value.code
    assert not (tmp_path / "out").exists()


def test_evaluate_names_the_broken_file(good, tmp_path):
    """evaluate.py: a checkpoint's mars.json of the wrong type, then data_dir's test.jsonl cut short."""
    ckpt, file = broken_copy(good, tmp_path, "release", "mars.json", {"block_size": "x"})
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--ckpt", str(ckpt), "--data-dir", str(good["data"])])
    assert str(e.value.code).startswith(f"error: {file}: key 'block_size' must be an int"), e.value.code
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text('{"messages": [{"role": "user", "content": "1+1"}]}\n{"messages": [{"ro')
    result = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--ckpt", str(good["release"]), "--data-dir", str(data), "--json", str(result)])
    msg = str(e.value.code)
    assert msg.startswith(f"error: {data / 'test.jsonl'}: line 2 is not valid JSON"), msg
    assert not result.exists()


def test_the_command_lines_print_no_traceback(good, tmp_path):
    """The issue's first and last cases through the real scripts: a truncated model.safetensors
    (generate.py) and a truncated train.npz (train.py) -> one line on stderr, non-zero exit."""
    ckpt, weights = broken_copy(good, tmp_path, "release", "model.safetensors", "truncated")
    data, npz = broken_copy(good, tmp_path, "data", "train.npz", "truncated")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, script, *argv], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for script, argv in (("generate.py", ["--ckpt", str(ckpt), "--prompt-ids", "5,6", "--tau", "1"]),
                                 ("train.py", train_args(data, tmp_path / "out")))]
    for p, file in zip(runs, (weights, npz)):
        out, err = p.communicate(timeout=120)
        assert p.returncode != 0 and out == "", (p.returncode, out, err)
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert err.startswith(f"error: {file}: not a readable "), err
    assert not (tmp_path / "out").exists()
