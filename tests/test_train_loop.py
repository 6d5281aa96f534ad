"""Proofs for train.py's single-process job: it is restartable, atomic and produces loadable models.

One tiny reference run (tests/train_run.py: 2 layers, 20 steps: 10 AR SFT + 10 MARS,
docs/spec.md §2-§4) is made in-process; the other runs must reproduce it:
  (1) a run SIGKILLed after a checkpoint and resumed logs exactly the same losses, and
      ends with bit-identical weights (CPU); a checkpoint of other settings is refused;
  (2) whatever instant a run dies at, out_dir/ckpt is absent or complete, and start-up
      recovery always finds a complete checkpoint once one was written;
  (3) out_dir/ar and out_dir/mars load in transformers with logits equal to ours, and
      init_from an HF checkpoint trains that model (step 1's loss = HF's loss);
      freeze_vocab trains the mask row alone;
  (4) a NaN/inf stops the run with a message naming the step, keeping the last good
      checkpoint;
  (5) the default MARS step (the engine's windowed forward, fast_loss) trains as the
      textbook one (--fast_loss=false, mars.mars_loss): the same losses and weights (float64).
2 processes equal 1: tests/test_train_distributed.py; settings: tests/test_train_settings.py.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import make_hf_model
from train_run import REPO, STEPS, args, records, weights

import train
from data import batches
from model import Qwen2
from settings import Settings
from tokenizer import Tokenizer
from util.runlog import read_log


@pytest.fixture(scope="module")
def ref(data_dir, tmp_path_factory):
    """The uninterrupted single-process run every other run is compared with."""
    out = tmp_path_factory.mktemp("ref")
    train.main(args(data_dir, out))
    return out


def launch(argv, log, **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([sys.executable, "train.py", *argv], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def test_reference_run_is_complete(ref):
    recs = records(ref)
    assert [(r["stage"], r["step"]) for r in recs if r["kind"] == "train"] == \
        [(s, i) for s in ("ar", "mars") for i in [1, *range(2, STEPS + 1, 2)]]  # log_interval = 2
    ar = [r for r in recs if r["kind"] == "train" and r["stage"] == "ar"]
    mars = [r for r in recs if r["kind"] == "train" and r["stage"] == "mars"]
    assert all(r["l_mask"] is None and r["l_ar"] == r["loss"] for r in ar)  # AR: no noisy stream
    assert all(math.isclose(r["loss"], r["l_mask"] + r["l_ar"], rel_tol=1e-6) for r in mars)  # w = 1
    assert ar[-1]["loss"] < ar[0]["loss"] and mars[-1]["l_mask"] < mars[0]["l_mask"]  # it learns
    assert (ref / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- (1) SIGKILL, resume
def test_sigkill_then_resume_continues_exactly(ref, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    with open(tmp_path / "stdout.txt", "w") as log:
        p = launch(args(data_dir, out), log)
        deadline = time.time() + 180
        while not any(r["kind"] == "ckpt" for r in read_log(out / "log.jsonl")):
            assert p.poll() is None, (tmp_path / "stdout.txt").read_text()
            assert time.time() < deadline, "no checkpoint within 180 s"
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL
    state = torch.load(out / "ckpt" / "train_state.pt", weights_only=True)
    k = (state["stage"], state["step"])
    assert k != ("mars", STEPS), "the run ended before the kill; nothing was resumed"

    capsys.readouterr()
    train.main(args(data_dir, out))
    printed = capsys.readouterr().out
    assert f"resuming from {out / 'ckpt'}: {k[0]} step {k[1]}" in printed
    redone = re.findall(r"^(ar|mars) +step +(\d+)/", printed, flags=re.M)
    assert redone and all((s, int(i)) > k if s == k[0] else s == "mars" for s, i in redone)
    assert records(out) == records(ref)  # every logged number, bit for bit
    w_got, w_want = weights(out / "mars"), weights(ref / "mars")
    assert all(torch.equal(w_got[n], w_want[n]) for n in w_want)


def test_resume_refuses_a_checkpoint_of_different_settings(ref, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(ref / "ckpt", out / "ckpt")
    with pytest.raises(SystemExit, match=re.escape("lr: 0.003 -> 0.01")):
        train.main(args(data_dir, out, "--lr=1e-2"))
    with pytest.raises(SystemExit, match="bad argument"):
        train.main(["--lr"])


# ----------------------------------------------------------------------------- (2) atomic checkpoints
class Crash(BaseException):
    """Stands for the process dying: nothing after the raise runs, no cleanup touches files."""


def complete(d):
    """(stage, step) of a checkpoint directory that loads fully; fails on a partial one."""
    state = torch.load(d / "train_state.pt", map_location="cpu", weights_only=True)
    Qwen2.from_pretrained(str(d))
    assert set(state) >= {"stage", "step", "optimizer", "settings"}
    return state["stage"], state["step"]


def recovered(out, snap):
    """What start-up recovery makes of out_dir's checkpoint directories as they are now, had
    the run died right here: (stage, step) of the complete checkpoint it finds, or None. It
    works on a copy in snap, so the run goes on untouched."""
    shutil.rmtree(snap, ignore_errors=True)
    snap.mkdir()
    for name in ("ckpt", "ckpt.tmp", "ckpt.old"):
        if (out / name).exists():
            shutil.copytree(out / name, snap / name)
    train.recover_dir(str(snap / "ckpt"))
    return complete(snap / "ckpt") if (snap / "ckpt").exists() else None


def test_checkpoint_is_never_half_written(ref, data_dir, tmp_path, monkeypatch):
    """After every file operation of a run, (a) out_dir/ckpt is absent or complete, and
    (b) what start-up recovery makes of the directory, had the run died right there, is a
    complete checkpoint (once one was written). Then a death between the two renames of
    a save is resumed, exactly."""
    out, snap = tmp_path / "run", tmp_path / "snap"
    real_replace, real_rmtree, real_save = os.replace, shutil.rmtree, torch.save
    seen, checking = [], [False]

    def check():
        if checking[0]:
            return
        checking[0] = True
        if (out / "ckpt").exists():
            complete(out / "ckpt")
        seen.append(recovered(out, snap))
        checking[0] = False

    def after(fn):
        def wrapped(*a, **kw):
            r = fn(*a, **kw)
            check()
            return r
        return wrapped

    monkeypatch.setattr(os, "replace", after(real_replace))
    monkeypatch.setattr(shutil, "rmtree", after(real_rmtree))
    monkeypatch.setattr(torch, "save", after(real_save))
    train.main(args(data_dir, out))
    first = seen.index(("ar", 5))
    assert set(seen[:first]) == {None} and None not in seen[first:]
    assert [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]] == \
        [None, ("ar", 5), ("ar", 10), ("mars", 5), ("mars", 10)]
    monkeypatch.undo()

    # die between "ckpt -> ckpt.old" and "ckpt.tmp -> ckpt" of the save at mars step 5: the
    # second save that replaces an older checkpoint (ar 5 is the first save, ar 10 the second)
    out, moved = tmp_path / "run2", []

    def dying_replace(src, dst):
        real_replace(src, dst)
        if str(dst).endswith("ckpt.old"):
            moved.append(dst)
            if len(moved) == 2:
                raise Crash

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(Crash):
        train.main(args(data_dir, out))
    monkeypatch.undo()
    assert not (out / "ckpt").exists() and complete(out / "ckpt.old") == ("ar", 10)
    # resume with gradient checkpointing on: it recomputes the same ops, so still bit-exact
    train.main(args(data_dir, out, "--gradient_checkpointing=true"))
    assert not (out / "ckpt.old").exists() and not (out / "ckpt.tmp").exists()
    assert records(out) == records(ref)


# ----------------------------------------------------------------------------- (3) transformers loads it
def test_outputs_load_in_transformers_with_equal_logits(ref, data_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = Tokenizer.from_dir(data_dir / "tokenizer")
    ids = torch.randint(0, tok.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    for stage in ("ar", "mars"):
        d = ref / stage
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        ours = Qwen2.from_pretrained(str(d))
        with torch.no_grad():
            a, b = hf(ids).logits, ours(ids)
        assert b.abs().max() > 0.1  # not trivially equal
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        meta = json.loads((d / "mars.json").read_text())
        assert (meta["block_size"], meta["mask_id"], meta["stage"]) == (4, tok.mask_id, stage)
        assert meta["mask_id"] < hf.config.vocab_size
        gen = GenerationConfig.from_pretrained(d)
        assert set(gen.eos_token_id) == {tok.eos_id, tok.endoftext_id} and gen.pad_token_id == tok.pad_id
        hf_tok = AutoTokenizer.from_pretrained(d)
        assert hf_tok.encode("hello world") == tok.encode("hello world")
    # the MARS stage trained the AR model further; its final weights are the checkpoint's
    w_ar, w_mars, w_ckpt = weights(ref / "ar"), weights(ref / "mars"), weights(ref / "ckpt")
    assert not torch.equal(w_ar["model.norm.weight"], w_mars["model.norm.weight"])
    assert all(torch.equal(w_mars[k], w_ckpt[k]) for k in w_mars)


def test_init_from_an_hf_checkpoint_trains_that_model(data_dir, tmp_path):
    """init_from = an HF-layout dir (written by transformers): step 1's logged loss is the AR
    SFT loss that transformers' own model gives on step 1's rows, computed row by row here:
    each row EOS-padded to a multiple of B with the pads carrying loss (docs/spec.md §2), CE of
    every loss target from the output one position earlier, mean per row, mean over rows."""
    tok = Tokenizer.from_dir(data_dir / "tokenizer")
    hf = make_hf_model(tmp_path / "hf", seed=3, vocab_size=320, initializer_range=0.02)
    out = tmp_path / "run"
    train.main(args(data_dir, out, f"--init_from={tmp_path / 'hf'}", "--ar_steps=2", "--mars_steps=0",
                    "--warmup_frac=0"))
    d = np.load(data_dir / "train.npz")
    per_row = []
    off = d["offsets"]  # step 1's rows, by the rule of batches.step_rows (the default's length buckets)
    rows = batches.step_rows(len(off) - 1, 8, 0, "ar", 0, off[1:] - off[:-1], Settings.bucket_window)
    for i in rows.tolist():
        a, b = d["offsets"][i], d["offsets"][i + 1]
        n_pad = -(b - a) % 4
        ids = torch.tensor(d["ids"][a:b].tolist() + [tok.eos_id] * n_pad)
        carries = torch.tensor(d["loss"][a:b].tolist() + [1] * n_pad, dtype=torch.bool)
        with torch.no_grad():
            logits = hf(ids[None]).logits[0]
        ce = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
        per_row.append(ce[carries[1:]].mean())
    first = read_log(out / "log.jsonl")[0]
    assert (first["stage"], first["step"]) == ("ar", 1)
    assert math.isclose(first["loss"], torch.stack(per_row).mean().item(), rel_tol=1e-5)
    assert not (out / "mars").exists() and Qwen2.from_pretrained(str(out / "ar")).config.vocab_size == 320


@pytest.mark.parametrize("tied", [True, False])
def test_freeze_vocab_trains_the_mask_row_alone(data_dir, tmp_path, tied):
    """freeze_vocab: after AR and MARS steps at weight decay 0.1, every embedding row but the mask
    token's is bit-equal to the start, and so is an untied LM head; the mask row and the layers moved."""
    mask_id = Tokenizer.from_dir(data_dir / "tokenizer").mask_id
    make_hf_model(tmp_path / "hf", seed=3, vocab_size=320, initializer_range=0.02, tie_word_embeddings=tied)
    start = weights(tmp_path / "hf")
    out = tmp_path / "run"
    train.main(args(data_dir, out, f"--init_from={tmp_path / 'hf'}", "--ar_steps=2", "--mars_steps=2",
                    "--freeze_vocab=true", "--weight_decay=0.1"))
    end = weights(out / "mars")
    emb, emb0 = end["model.embed_tokens.weight"], start["model.embed_tokens.weight"]
    others = torch.ones(len(emb), dtype=torch.bool)
    others[mask_id] = False
    assert torch.equal(emb[others], emb0[others])
    assert not torch.equal(emb[mask_id], emb0[mask_id])
    assert ("lm_head.weight" in end) == (not tied)
    if not tied:
        assert torch.equal(end["lm_head.weight"], start["lm_head.weight"])
    layer = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(end[layer], start[layer])


# ----------------------------------------------------------------------------- (4) NaN guard
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
    """lr = 1e6 (no warm-up) blows the model up within a few steps: a realistic trigger."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(args(data_dir, out, "--lr=1e6", "--warmup_frac=0", "--ckpt_interval=1",
                        "--log_interval=1"))
    msg = str(e.value.code)  # SystemExit with a message: exit status 1
    m = re.search(r"non-finite (loss|gradient norm) \S+ at (ar|mars) step (\d+)", msg)
    assert m and "last good checkpoint" in msg, msg
    stage, step = m[2], int(m[3])
    assert step >= 2  # step 1 starts from the finite initial model
    recs = read_log(out / "log.jsonl")
    done = [(r["stage"], r["step"]) for r in recs if r["kind"] == "train"]
    assert done[-1] == (stage, step - 1)
    assert all(math.isfinite(r["loss"]) for r in recs if r["kind"] == "train")
    assert complete(out / "ckpt") == (stage, step - 1)  # nothing of the bad step was saved
    assert all(torch.isfinite(t).all() for t in weights(out / "ckpt").values())


# ----------------------------------------------------------------------------- (5) the engine's loss
TEXTBOOK_REL = 1e-9  # float64 runs, the same sums in another order: measured 3.9e-13 (AMD EPYC)


def test_the_engines_loss_trains_as_the_textbook_loss(data_dir, tmp_path, monkeypatch):
    """The default MARS step (fast_loss = true: fast.window.mars_loss_windowed) and --fast_loss=false
    (mars.mars_loss, the textbook forward of §3) log the same losses and gradient norms and save the
    same weights, in float64 (the same computation: tests/test_fast_paths.py); each run called the
    loss its setting names, and only that one."""
    import fast.window

    calls = {}

    def counting(name, f):
        def counted(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return f(*a, **k)
        return counted

    monkeypatch.setattr(train, "mars_loss", counting("textbook", train.mars_loss))
    monkeypatch.setattr(fast.window, "mars_loss_windowed", counting("engine", fast.window.mars_loss_windowed))
    runs, used = {}, {}
    for fast_loss in ("true", "false"):
        calls.clear()
        out = tmp_path / fast_loss
        train.main(args(data_dir, out, "--ar_steps=2", "--mars_steps=4", "--dtype=float64",
                        "--log_interval=1", "--eval_interval=4", f"--fast_loss={fast_loss}"))
        runs[fast_loss], used[fast_loss] = (records(out), weights(out / "mars")), set(calls)
    assert used == {"true": {"engine"}, "false": {"textbook"}}
    (engine, w_engine), (textbook, w_textbook) = runs["true"], runs["false"]
    assert [(r["kind"], r["stage"], r["step"]) for r in engine] == [(r["kind"], r["stage"], r["step"])
                                                                     for r in textbook]
    rel = [abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(engine, textbook)
           for k in ("loss", "l_mask", "l_ar", "grad_norm", "val_loss") if b.get(k) is not None]
    rel += [((w_engine[k] - w_textbook[k]).abs().max() / w_textbook[k].abs().max()).item()
            for k in w_textbook]
    print(f"engine vs textbook run: {max(rel):.1e} relative at most")
    assert len(rel) > 20 and max(rel) <= TEXTBOOK_REL
    assert any(r.get("l_mask") for r in textbook)  # the MARS stage ran
