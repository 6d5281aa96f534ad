"""The real-model pipeline's pure parts (scripts/real_model.py, data/prompts.py), no model needed:
prompts are deterministic and their splits disjoint by source, the agreement metrics equal a
brute-force count, capped replies are cut to whole blocks without an EOS, a stage is skipped
exactly when its key matches, and a training checkpoint is filed under its own step."""

import json
import os

import numpy as np
import torch

from data import prompts as P
from scripts import real_model as R


def test_prompts_deterministic_and_splits_disjoint():
    a, b = P.build(0, 200, 30, 20), P.build(0, 200, 30, 20)
    assert a == b
    assert P.build(1, 200, 30, 20) != a  # the seed matters
    keys = {s: {x["key"] for x in a[s]} for s in P.SPLITS}
    assert not keys["train"] & keys["heldout"] and not keys["human"] & (keys["train"] | keys["heldout"])
    # a compared pair is split with both of its functions: no held-out function is trained on
    funcs = {s: {k for x in a[s] for k in x["key"].removeprefix("pair:").split("|")} for s in P.SPLITS}
    assert not funcs["train"] & funcs["heldout"]
    prompt_text = " ".join(x["text"] for s in ("train", "heldout") for x in P.candidates(0)[s])
    assert all(h["text"] not in prompt_text for h in a["human"])  # human text is in no prompt
    assert len({x["kind"] for x in a["train"]}) >= 6  # varied, not one template


def test_agreement_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    refs = [
        torch.randint(0, 3, (int(n),), generator=g).tolist() for n in torch.randint(0, 8, (200,), generator=g)
    ]
    outs = [
        r[: len(r) // 2] + torch.randint(0, 3, (3,), generator=g).tolist() if i % 3 else list(r)
        for i, r in enumerate(refs)
    ]
    got = R.agreement(refs, outs)

    def prefix(a, b):
        return max(k for k in range(min(len(a), len(b)) + 1) if a[:k] == b[:k])

    assert got["identical"] == sum(a == b for a, b in zip(refs, outs)) / len(refs)
    assert got["common_prefix"] == sum(prefix(a, b) for a, b in zip(refs, outs)) / len(refs)


def test_cut_unfinished_rows_end_on_a_block_without_eos():
    eos, B = 2, 4
    rows = [
        ([5, 6, 7, 8, 9, 10, 11, eos, 13], [0, 0, 0, 1, 1, 1, 1, 1, 1]),  # cut by the cap
        ([5, 6, 7, 8, 9, eos, 13], [0, 0, 0, 1, 1, 1, 1]),
    ]  # finished: untouched
    arrays = {
        "ids": np.array([t for r in rows for t in r[0]], np.int32),
        "loss": np.array([m for r in rows for m in r[1]], np.uint8),
        "offsets": np.array([0, 9, 16], np.int64),
    }
    out = R.cut_unfinished(arrays, [False, True], eos, B)
    assert out["offsets"].tolist() == [0, 4, 11]
    assert out["ids"][:4].tolist() == [5, 6, 7, 8] and eos not in out["ids"][:4]
    assert out["ids"][4:].tolist() == rows[1][0] and out["loss"][4:].tolist() == rows[1][1]


def test_chunks_cover_every_prompt_once_shortest_first():
    lengths = [5, 1, 9, 1, 3, 7, 2]
    c = R.chunks(lengths, 3)
    assert sorted(i for ch in c for i in ch) == list(range(len(lengths)))
    flat = [lengths[i] for ch in c for i in ch]
    assert flat == sorted(flat) and all(len(ch) <= 3 for ch in c)


def test_stage_skipped_exactly_when_key_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []
    run = R.Run("t", {"results_dir": "r"}, "cfg.json", {}, smoke=False)
    out = run.path("x.json")
    make = lambda: (calls.append(1), R.write_json(out, {}))
    run.stage("s", "k1", [out], make)
    run.stage("s", "k1", [out], make)  # done: skipped
    assert len(calls) == 1
    run = R.Run("t", {"results_dir": "r"}, "cfg.json", {}, smoke=False)  # a new process reads stages.json
    run.stage("s", "k1", [out], make)
    assert len(calls) == 1
    run.stage("s", "k2", [out], make)  # the inputs changed: redone
    os.remove(out)
    run.stage("s", "k2", [out], make)  # the output vanished: redone
    assert len(calls) == 3 and json.load(open(run.path("stages.json")))["s"]["key"] == "k2"


def test_snapshot_files_the_checkpoint_under_its_step(tmp_path):
    out, snaps = tmp_path / "train", tmp_path / "snaps"
    R.snapshot(str(out), str(snaps))  # no checkpoint yet: nothing
    assert not (snaps / "step_00020").exists()
    for step, stage in ((20, "mars"), (40, "mars")):
        if (out / "ckpt").exists():  # train.py replaces the directory: new files, new inodes
            for f in (out / "ckpt").iterdir():
                f.unlink()
        (out / "ckpt").mkdir(parents=True, exist_ok=True)
        (out / "ckpt" / "model.safetensors").write_text(f"weights {step}")
        torch.save({"stage": stage, "step": step}, out / "ckpt" / "train_state.pt")
        R.snapshot(str(out), str(snaps))
        R.snapshot(str(out), str(snaps))  # twice: the same snapshot
    assert (snaps / "step_00020" / "model.safetensors").read_text() == "weights 20"
    assert (snaps / "step_00040" / "model.safetensors").read_text() == "weights 40"
    assert not (snaps / "step_00020" / "train_state.pt").exists()  # weights only
