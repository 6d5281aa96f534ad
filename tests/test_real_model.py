"""The real-model pipeline's pure parts (scripts/real_model/, data/prompts.py), no real model needed:
prompts are deterministic and their splits disjoint by coarse source group (near-duplicate
modules and sibling paragraphs on one side), the agreement metrics equal a brute-force count,
the rows whose generated ids differ from their text re-tokenised are counted exactly, the
timing interleaves warmed-up decoders, the bootstrap interval is the percentile rule, a stage
is skipped exactly when its key matches (and its key follows the code it runs), a
training checkpoint is filed under its own step, the pilots' table has a row per pilot, and
committed rows go out and come back (the teacher recomputed equal to HF's on a tiny model),
and the committed page is rendered again, byte for byte, from its results.json alone."""

import json
import os
import shutil

import numpy as np
import torch
from conftest import make_hf_model

from data.bpe import train_bpe
from decoding import Generation
from model import Qwen2
from scripts.real_model import committed, speed
from scripts.real_model.evaluation import agreement, bootstrap
from scripts.real_model.replies import TEACHER_SPLITS, retokenised_differ, template_tail
from scripts.real_model.report import PILOT_COLUMNS, report, report_pilots, summary
from scripts.real_model.run import Run, chunks, digest
from scripts.real_model.training import snapshot
from tokenizer import Tokenizer
from util.atomic import write_json


def test_agreement_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    refs = [
        torch.randint(0, 3, (int(n),), generator=g).tolist() for n in torch.randint(0, 8, (200,), generator=g)
    ]
    outs = [
        r[: len(r) // 2] + torch.randint(0, 3, (3,), generator=g).tolist() if i % 3 else list(r)
        for i, r in enumerate(refs)
    ]
    got = agreement(refs, outs)

    def prefix(a, b):
        return max(k for k in range(min(len(a), len(b)) + 1) if a[:k] == b[:k])

    assert got["identical"] == sum(a == b for a, b in zip(refs, outs)) / len(refs)
    assert got["common_prefix"] == sum(prefix(a, b) for a, b in zip(refs, outs)) / len(refs)


def test_chunks_cover_every_prompt_once_shortest_first():
    lengths = [5, 1, 9, 1, 3, 7, 2]
    c = chunks(lengths, 3)
    assert sorted(i for ch in c for i in ch) == list(range(len(lengths)))
    flat = [lengths[i] for ch in c for i in ch]
    assert flat == sorted(flat) and all(len(ch) <= 3 for ch in c)


def test_stage_skipped_exactly_when_key_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []
    run = Run("t", {"results_dir": "r"}, "cfg.json", {}, smoke=False)
    out = run.path("x.json")
    make = lambda: (calls.append(1), write_json(out, {}))
    run.stage("s", "k1", [out], make)
    run.stage("s", "k1", [out], make)  # done: skipped
    assert len(calls) == 1
    run = Run("t", {"results_dir": "r"}, "cfg.json", {}, smoke=False)  # a new process reads stages.json
    run.stage("s", "k1", [out], make)
    assert len(calls) == 1
    run.stage("s", "k2", [out], make)  # the inputs changed: redone
    os.remove(out)
    run.stage("s", "k2", [out], make)  # the output vanished: redone
    assert len(calls) == 3 and json.load(open(run.path("stages.json")))["s"]["key"] == "k2"


def test_snapshot_files_the_checkpoint_under_its_step(tmp_path):
    out, snaps = tmp_path / "train", tmp_path / "snaps"
    snapshot(str(out), str(snaps))  # no checkpoint yet: nothing
    assert not (snaps / "step_00020").exists()
    for step, stage in ((20, "mars"), (40, "mars")):
        if (out / "ckpt").exists():  # train.py replaces the directory: new files, new inodes
            for f in (out / "ckpt").iterdir():
                f.unlink()
        (out / "ckpt").mkdir(parents=True, exist_ok=True)
        (out / "ckpt" / "model.safetensors").write_text(f"weights {step}")
        torch.save({"stage": stage, "step": step}, out / "ckpt" / "train_state.pt")
        snapshot(str(out), str(snaps))
        snapshot(str(out), str(snaps))  # twice: the same snapshot
    assert (snaps / "step_00020" / "model.safetensors").read_text() == "weights 20"
    assert (snaps / "step_00040" / "model.safetensors").read_text() == "weights 40"
    assert not (snaps / "step_00020" / "train_state.pt").exists()  # weights only


def test_rows_whose_ids_differ_from_their_text_are_counted(tmp_path):
    texts = ["<|im_start|>user\nsay ab<|im_end|>\n<|im_start|>assistant\nab ab<|im_end|>\n"] * 3
    train_bpe(texts, 30).save(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    tail = template_tail(tok)
    assert tok.decode(tail) == "\n"
    prompt = tok.encode_chat([{"role": "user", "content": "say ab"}], add_generation_prompt=True)
    same = tok.encode("ab ab") + [tok.eos_id]
    assert len(tok.encode("ab")) == 1  # merged, so the ids of "a" then "b" spell the text another way
    split = tok.encode("a") + tok.encode("b") + tok.encode(" ab") + [tok.eos_id]
    assert tok.decode(split) == tok.decode(same)
    rows = [{"prompt_ids": prompt, "reply_ids": ids, "finished": True,
             "messages": [{"role": "user", "content": "say ab"},
                          {"role": "assistant", "content": tok.decode(ids[:-1])}]}
            for ids in (same, split, same)]
    assert retokenised_differ(tok, rows, tail) == 1
    cut = dict(rows[1], reply_ids=split[:-1], finished=False)  # unfinished: no <|im_end|> + tail
    same_cut = dict(rows[0], reply_ids=same[:-1], finished=False)
    assert retokenised_differ(tok, [rows[0], cut, same_cut], tail) == 1


def test_time_decoders_warms_up_each_and_interleaves_rounds(monkeypatch):
    calls = []
    fns = {n: (lambda item, n=n: calls.append((n, item)) or [Generation([1, 2], 1)]) for n in ("a", "b", "c")}
    monkeypatch.setattr(speed, "timed", lambda fn, device: (1.0, fn()))
    res, outs = speed.time_decoders(fns, ["x", "y"], rounds=3, device="cpu")
    assert calls[:3] == [("a", "x"), ("b", "x"), ("c", "x")]  # one warm-up each
    assert [n for n, _ in calls[3:9]] == ["a", "b", "c"] * 2  # round 0: every decoder on x, then on y
    assert [n for n, _ in calls[9:12]] == ["b", "c", "a"]  # round 1: the order rotated
    assert len(calls) == 3 + 3 * 2 * 3 and res["a"]["per_round_s"] == [2.0] * 3
    assert res["a"]["median_s"] == 2.0 and res["a"]["spread_s"] == [2.0, 2.0] and len(outs["a"]) == 2


def test_bootstrap_is_the_percentile_interval_of_resampled_ratios():
    num, den = [3, 1, 4, 1, 5], [2, 2, 2, 1, 2]
    got = bootstrap(num, den, n=500, seed=1)
    idx = np.random.default_rng(1).integers(0, 5, (500, 5))
    ratios = sorted(sum(num[i] for i in row) / sum(den[i] for i in row) for row in idx)
    assert got == [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]
    assert got[0] <= sum(num) / sum(den) <= got[1]


def test_stage_key_follows_the_code_it_runs():
    def f():
        return 1

    def g():
        return 2

    assert digest(("code", f)) != digest(("code", g))


SUMMARY_KEYS = {  # issue 21, item 6, written out
    "human_nll_change_chat", "human_nll_change_plain", "ar_sft_human_nll_change_chat",
    "ar_sft_human_nll_change_plain", "kl_base_replies", "ar_sft_kl_base_replies", "agreement_base_replies",
    "ar_sft_agreement_base_replies", "agreement_human", "exact_tokens_per_forward_k2_batch1",
    "prompt_lookup_tokens_per_forward", "tau095_tokens_per_forward", "exact_speed_vs_ar_batch1",
    "train_rows_distinct", "train_steps"}


def test_summary_has_exactly_the_issue_keys_as_floats():
    m = lambda nll, kl, agree: {"nll": nll, "kl": kl, "agreement": agree}  # noqa: E731
    tf = {part: {"base": m(2.0, 0.0, 1.0), "ar_sft": m(2.1, 0.2, 0.9), "mars": m(2.02, 0.04, 0.96)}
          for part in ("base_replies", "chat_replies", "human_chat", "human_plain")}
    ev = {"a_quality": {"teacher_forced": tf},
          "b_taus": {"mars": [{"tau": 1.0, "tokens_per_forward": 1.0},
                              {"tau": 0.95, "tokens_per_forward": 1.5}]},
          "c_exact": {"tokens_per_forward": {"test/mars/exact K=2": {"tokens_per_forward": 1.8},
                                             "test/mars/HF prompt lookup": {"tokens_per_forward": 1.6}}},
          "d_curve": [], "e_timing": {"k_choice": {"drafts": 2},
                                      "timing": {"batch 1": {"exact K=2": {"speed_vs_ar": 1.1}}}}}
    res = {**ev, "train_settings": {"mars_steps": 250, "batch_size": 8},
           "data": {"train": {"distinct_prompts": 2054}}}  # as results.json holds them
    s = summary(res)
    assert set(s) == SUMMARY_KEYS and all(isinstance(v, float) for v in s.values())
    assert s["human_nll_change_chat"] == 2.02 / 2.0 - 1 and s["ar_sft_kl_base_replies"] == 0.2
    assert s["train_rows_distinct"] == 2000.0  # 250 x 8 rows drawn, each once (fewer than the 2054 rows)


def test_pilot_table_has_a_row_per_pilot_with_its_numbers(tmp_path):
    """Every pilots/NAME/summary.json becomes a row with its own numbers and command, its AR-SFT
    baseline a row of its own, and a pilot without a summary is marked stopped, not dropped."""
    root = tmp_path / "pilots"
    vals = {k: 0.1 * (i + 1) for i, k in enumerate(PILOT_COLUMNS)}
    for name, extra in (("pilot-a", {}), ("pilot-b", {"ar_sft_kl_base_replies": 0.478,
                                                      "ar_sft_agreement_base_replies": 0.87,
                                                      "ar_sft_human_nll_change_chat": 0.214,
                                                      "ar_sft_human_nll_change_plain": 0.095})):
        os.makedirs(root / name)
        summary = {**vals, "ar_sft_kl_base_replies": None, **extra}
        (root / name / "summary.json").write_text(json.dumps(summary))
    os.makedirs(root / "pilot-c")
    table = report_pilots(str(tmp_path))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [r[0] for r in rows] == ["pilot-a", "pilot-b", "pilot-b: its AR-SFT baseline", "pilot-c"]
    assert rows[0][1] == "`python -m scripts.real_model --config configs/smollm2-pilot-a.json`"
    assert rows[0][2:] == [f"{vals[k]:.3f}" for k in PILOT_COLUMNS]
    assert rows[2][2:] == ["0.478", "0.870", "0.214", "0.095", "-", "-", "-"]
    assert rows[3][2].startswith("stopped early")


def test_committed_rows_round_trip_and_teacher_equals_hf(tmp_path, monkeypatch):
    """--export-rows copies a run's prompts and replies into results/real_model/data/NAME with
    their settings; a run of the same settings imports them (the same bytes) and computes the
    teacher arrays again, which equal HF's top-k of the same rows; other settings are refused."""
    monkeypatch.chdir(tmp_path)
    hf = make_hf_model(tmp_path / "base")
    cfg = {"results_dir": "r", "seed": 0, "n_train": 2, "n_val": 1, "n_test": 1, "n_human": 1, "n_chat": 1,
           "max_new_tokens": 4, "gen_batch": 2, "max_prompt_tokens": 16, "teacher_k": 3,
           "shared_data": "rows", "device": "cpu", "dtype": "float32"}
    run = Run("a", cfg, "a.json", {}, smoke=False)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, 200, (n,), generator=g).tolist()
    rows = {s: [{"id": f"{s}-{i}", "kind": "k", "finished": i % 2 == 0, "prompt_ids": rand(5 + i),
                 "reply_ids": rand(3 + i), "messages": []} for i in range(n)]
            for s, n in (("train", 2), ("val", 1), ("test", 1), ("chat", 1))}
    for s, rs in rows.items():
        with open(run.data(f"{s}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    with open(run.data("prompts.json"), "w") as f:
        json.dump({"train": []}, f)
    run.manifest["replies"] = {"key": "k"}
    committed.export_rows(run)
    d = os.path.join(committed.COMMITTED, "rows")
    assert committed.committed_rows(run) == d
    assert committed.committed_rows(Run("b", {**cfg, "max_new_tokens": 5}, "b.json", {}, smoke=False)) is None
    shutil.rmtree("out")
    fresh = Run("a", cfg, "a.json", {}, smoke=False)
    base = Qwen2.from_pretrained(str(tmp_path / "base"))  # float32, as the replies stage runs
    hf = hf.double()  # the reference in float64: a mismatch is ours, not the reference's rounding
    monkeypatch.setattr(committed, "open_model", lambda path, run, dtype=None: (base, None))
    monkeypatch.setattr(committed, "template_tail", lambda tok: [7])
    committed.import_rows(fresh, committed.committed_rows(fresh))
    for s in rows:
        assert open(fresh.data(f"{s}.jsonl")).read() == open(os.path.join(d, f"{s}.jsonl")).read()
    for s in TEACHER_SPLITS:
        t = np.load(fresh.data(f"{s}_teacher.npz"))
        for i, r in enumerate(rows[s]):
            targets = r["reply_ids"] + ([7] if r["finished"] else [])
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([r["prompt_ids"] + targets])).logits[0], -1)
            logp = logp[len(r["prompt_ids"]) - 1:-1]  # output i-1 predicts target i
            top = logp.topk(3, -1)
            top4 = logp.topk(4, -1).values  # k + 1: the k-th against the first one left out too
            # no near-tie the float32 teacher could order otherwise: gaps measured >= 7.1e-4, float32's
            # error on these log-probs 4.5e-6
            assert (top4[:, :-1] - top4[:, 1:]).min() > 1e-4
            a, b = t["t_offsets"][i], t["t_offsets"][i + 1]
            assert np.array_equal(t["t_ids"][a:b], top.indices.numpy())
            # stored as float16: 4.9e-4 relative
            assert np.allclose(t["t_logp"][a:b].astype(np.float32), top.values.numpy(), rtol=1e-3, atol=1e-4)
            rest = 1 - top.values.exp().sum(-1)
            assert np.allclose(t["t_rest"][a:b], rest.numpy(), atol=1e-5)


def test_report_renders_the_committed_page_from_its_json_alone(monkeypatch):
    """report.py needs no model and no run dir: results/real_model/results.json (with the committed
    pilots' summaries) gives back the committed RESULTS.md and summary.json byte for byte, so the
    page can be regenerated, and a change to the page's code that alters it is seen here."""
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
    d = os.path.join("results", "real_model")
    res = json.load(open(os.path.join(d, "results.json")))
    assert report(res) == open(os.path.join(d, "RESULTS.md")).read()
    assert json.dumps(summary(res), indent=2) + "\n" == open(os.path.join(d, "summary.json")).read()
