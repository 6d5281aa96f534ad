"""Proofs for what a train.py run is told to do: its settings, the named configs, its batch order,
torch.compile.

  (1) settings: --config/--key=value typed overrides and clear errors;
  (2) the named configs parse, and the 0.5B one fits 24 GB by estimate_memory;
  (3) the batch order (data.batches.step_rows) reads every row once per epoch and groups
      rows of similar length;
  (4) compile=true hands the loss module to torch.compile, and the optimizer step and the
      validation pass call what it returned (torch.compile replaced by a recorder).
None of these trains a model to the end; the training runs' proofs are tests/test_train_loop.py and
tests/test_train_distributed.py.
"""

import json
import re
from dataclasses import replace

import pytest
import torch
from train_run import REPO

from data import batches
from model import Qwen2, Qwen2Config
from settings import Settings, parse_settings
from util import memory


# ----------------------------------------------------------------------------- (1) settings
def test_settings_overrides_and_errors(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"_comment": "ignored", "lr": 1, "n_layer": 6, "bidirectional": True}))
    s = parse_settings(["--lr=0.5", "--config", str(cfg), "--n-layer=3", "--w_ar=0"])
    assert (s.lr, s.n_layer, s.bidirectional, s.w_ar, s.block_size) == (1.0, 3, True, 0.0, 4)
    assert type(s.lr) is float and type(s.n_layer) is int
    assert parse_settings(["--bidirectional=false", "--init_from=/x"]).init_from == "/x"
    for argv, err in ((["--lrr=1"], "unknown setting 'lrr'"),
                      (["--n_layer=two"], "n_layer='two' is not a int"),
                      (["--resume=maybe"], "resume='maybe' is not a bool"),
                      (["lr=3"], "bad argument 'lr=3'"),
                      (["--dtype=float16"], "dtype must be"),
                      (["--block_size=0"], "block_size must be >= 1"),
                      (["--flex_attention=true"], "flex_attention=true needs compile=true"),
                      (["--compile=true", "--fast_loss=false", "--flex_attention=true"], "fast_loss=true"),
                      (["--two_stream=false"], "setting 'two_stream' is gone: use fast_loss"),
                      (["--config", str(tmp_path / "absent.json")], "absent.json")):
        with pytest.raises(SystemExit, match=re.escape(err)):
            parse_settings(argv)
    cfg.write_text(json.dumps({"n_layer": "3"}))
    with pytest.raises(SystemExit, match=re.escape(f"{cfg}: n_layer must be a int")):
        parse_settings(["--config", str(cfg)])
    cfg.write_text(json.dumps({"n_layers": 3}))
    with pytest.raises(SystemExit, match=re.escape(f"{cfg}: unknown setting 'n_layers'")):
        parse_settings(["--config", str(cfg)])
    cfg.write_text(json.dumps({"trim_noisy": True}))  # a config of before issue 55: told what replaced it
    with pytest.raises(SystemExit, match=re.escape(f"{cfg}: setting 'trim_noisy' is gone: use fast_loss")):
        parse_settings(["--config", str(cfg)])


# ----------------------------------------------------------------------------- (2) named configs
def test_named_configs(tmp_path):
    """default.json is the defaults of train.py (python train.py == the default config); the
    0.5B config fits one 24 GB GPU by estimate_memory without gradient checkpointing, so train.py
    leaves it off (util.memory.needs_checkpointing), and turns it on for a 16 GB card."""
    assert parse_settings(["--config", str(REPO / "configs/default.json")]) == Settings()
    small = parse_settings(["--config", str(REPO / "configs/qwen2.5-0.5b-24gb.json")])
    big = parse_settings(["--config", str(REPO / "configs/qwen2.5-7b-multigpu.json")])
    assert not small.gradient_checkpointing and small.dtype == "bfloat16" and small.block_size == 4
    assert small.batch_size == 384 and small.lr == 5e-6 and small.max_len == 512 and small.epochs == 5
    assert big.fsdp and big.batch_size == 384
    q05 = Qwen2Config()  # the defaults are Qwen2.5-0.5B's geometry
    with torch.device("meta"):
        n = Qwen2(q05).num_params()
    assert 490e6 < n < 500e6  # Qwen2.5-0.5B: 494M
    assert memory.memory_parts(q05, small)["weights"] == 4 * n  # fp32 master weights
    assert 16 * n < memory.estimate_memory(q05, small) <= 24 * 2**30
    ckpt = replace(small, gradient_checkpointing=True)
    assert memory.estimate_memory(q05, small) > memory.estimate_memory(q05, ckpt) + 4e9
    assert not memory.needs_checkpointing(q05, small)  # 24 GB: it fits without
    assert memory.needs_checkpointing(q05, replace(small, gpu_mem_gb=16))  # 16 GB: it does not
    assert not memory.needs_checkpointing(q05, replace(ckpt, gpu_mem_gb=16))  # already on: nothing to turn on
    # the static step's chunked head (compile=true) holds one chunk of logits, not the targets'
    assert memory.estimate_memory(q05, small, static=True) < memory.estimate_memory(q05, small) - 1.5 * 2**30


# ----------------------------------------------------------------------------- (3) batch order
def test_step_rows_every_row_once_per_epoch_and_buckets_by_length():
    """step_rows is a pure function of (seed, stage, step); window = 1 takes the samples of
    the epoch permutations in order; window = W cuts each window's samples, sorted by
    length, into W batches: every row still once per epoch, and no batch overlaps another
    batch of its window in length."""
    n, batch, W = 96, 4, 6
    lengths = torch.randint(10, 60, (n,), generator=torch.Generator().manual_seed(0))
    plain = torch.cat([batches.step_rows(n, batch, 0, "mars", s) for s in range(n // batch)])
    assert torch.equal(plain, batches._epoch_perm(n, 0, "mars", 0))  # the written-out rule
    for epoch in range(2):  # n / (batch * W) = 4 windows per epoch
        steps = range(epoch * n // batch, (epoch + 1) * n // batch)
        got = [batches.step_rows(n, batch, 0, "mars", s, lengths, W) for s in steps]
        assert sorted(torch.cat(got).tolist()) == list(range(n))  # every row once
        for w in range(0, len(got), W):  # inside a window: disjoint length ranges
            spans = sorted((int(lengths[b].min()), int(lengths[b].max())) for b in got[w:w + W])
            assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))
        window_rows = torch.cat([batches._samples(n, batch * W, 0, "mars", epoch * 4 + i) for i in range(4)])
        assert sorted(window_rows.tolist()) == sorted(torch.cat(got).tolist())
    assert torch.equal(batches.step_rows(n, batch, 0, "mars", 7, lengths, W),
                       batches.step_rows(n, batch, 0, "mars", 7, lengths, W))
    pad = lambda rows: sum(int(lengths[r].max()) * len(r) for r in rows)
    assert pad([batches.step_rows(n, batch, 0, "mars", s, lengths, W) for s in range(24)]) < \
        pad([batches.step_rows(n, batch, 0, "mars", s) for s in range(24)])


# ----------------------------------------------------------------------------- (4) compile
def test_compile_wraps_the_loss_module_and_the_steps_run_through_the_compiled_one(monkeypatch):
    """compile=true: build_model passes the loss module (StageLoss, what DDP would wrap) to
    torch.compile once, and both the optimizer step and the validation pass run through what
    it returned; compile=false: torch.compile is never called and the steps call the module.
    torch.compile is replaced by a recorder (compiling for real takes minutes on the CPU)."""
    import numpy as np

    import train

    calls = []

    class Recorder(torch.nn.Module):  # what the fake torch.compile returns: counts its calls
        def __init__(self, net):
            super().__init__()
            self.net, self.n = net, 0

        def forward(self, *args, **kwargs):
            self.n += 1
            return self.net(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", lambda net, **kw: calls.append(net) or Recorder(net))
    rows, l = 4, 8  # 4 rows of 8 tokens, the last 4 of each carrying loss
    ids = np.arange(rows * l, dtype=np.int64) % 20
    data = {"ids": ids, "loss": np.tile([0] * 4 + [1] * 4, rows).astype(np.uint8),
            "offsets": np.arange(0, rows * l + 1, l, dtype=np.int64)}
    special = {"mask": 20, "eos": 21, "pad": 22}
    for on in (False, True):
        calls.clear()
        S = replace(Settings(), compile=on, n_layer=1, n_embd=16, n_head=2, n_kv_head=1, intermediate=32,
                    batch_size=2, micro_batch_size=2, eval_rows=2, bucket_window=1, max_len=16,
                    mask_id=20, eos_id=21, pad_id=22)
        r = train.Run(S, 0, 1, torch.device("cpu"), {"train": data, "val": data}, None, special,
                      {"ar": 1, "mars": 1})
        train.build_model(r, None)
        assert calls == ([r.net] if on else [])
        assert (type(r.runner) is Recorder and r.runner.net is r.net) if on else r.runner is r.net
        r.net.stage = "mars"
        train.train_step(r, train.make_optimizer(r.net, S, r.device), "mars", 0)
        train.val_loss(r)
        assert (r.runner.n == 2) if on else not calls  # one micro-batch, one validation batch
