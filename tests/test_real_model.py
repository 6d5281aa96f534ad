"""The real-model pipeline's pure parts (scripts/real_model/, data/prompts.py), no real model needed:
prompts are deterministic and their splits disjoint by coarse source group (near-duplicate
modules and sibling paragraphs on one side), the agreement metrics equal a brute-force count,
the rows whose generated ids differ from their text re-tokenised are counted exactly, the
timing interleaves warmed-up decoders, the bootstrap interval is the percentile rule, a stage
is skipped exactly when its key matches (and its key follows the code it runs), a
training checkpoint is filed under its own step, the pilots' table has a row per pilot, and
committed rows go out and come back (the teacher recomputed equal to HF's on a tiny model),
and the committed page is rendered again, byte for byte, from its results.json alone.

The task protocol (issue 54), its --smoke run once for the module on a tiny random base: the
stages keep the protocol; every reply of the sweep is a JSONL row whose verdict is the grader's and
whose counts a re-decode gives back; the page comes back from results.json alone; a lost piece of
the evaluation is made again and only it; its numbers are counts of the rows and its targets
turn at their bounds. Its pilot (--pilot): the proposal's candidate reuses the run's stages, another
trains its own; the numbers are counts of validation replies and the choice is the rule written out;
each candidate has its own run dir; the committed config runs what the committed pilot chose."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import make_hf_model

from data.bpe import train_bpe
from data.prepare import load_npz
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def task_run_dir():
    """The smoke's run dir, in its root: protocol.run_name's for the config's settings (the pilot's first
    candidate runs in smollm2-task-smoke, another in smollm2-task-smoke-KEYVALUE)."""
    from scripts.real_model.protocol import run_name, smoke_config
    from scripts.real_model.run import load_config, train_settings

    _, full, cfg = load_config(os.path.join(REPO, "configs", "smollm2-task.json"), True)
    cfg = smoke_config(cfg)
    return os.path.join("out", "real_model", run_name("smollm2-task-smoke", cfg, train_settings(full, cfg)))


TASK_BASE = os.path.join("out", "real_model", "smollm2-task-smoke")
TASK_RUN = task_run_dir()


@pytest.fixture(scope="module")
def task_smoke(tmp_path_factory):
    """`python -m scripts.real_model --config task --smoke` (configs/smollm2-task.json, issue 54) run once
    for this module, on a tiny random base in SmolLM2's place (its BPE trained on the task set) -> the
    root it ran in: the repository seen through links, with an out/ of its own."""
    from chat_template import render_chat
    from data.tasks import generate
    from scripts.real_model.__main__ import main

    root = tmp_path_factory.mktemp("task_smoke")
    for name in set(os.listdir(REPO)) - {"out", ".git"}:
        os.symlink(os.path.join(REPO, name), root / name)
    small = generate({"train": 40, "val": 8, "test": 8}, seed=0)
    tok = train_bpe([render_chat(r["messages"]) for rows in small.values() for r in rows], 400)
    make_hf_model(root / "out" / "smollm2", vocab_size=tok.mask_id + 1)  # the base the stages read
    tok.save(root / "out" / "smollm2")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        main(["--config", "task", "--smoke"])
    return root


def test_task_protocol_smoke_keeps_the_protocol(task_smoke):
    """The smoke's training stages: the task set is made and tokenised with the base's chat template,
    stage 1 (AR SFT), stage 2 (MARS from stage 1's saved weights) and the AR arm run as train.py
    subprocesses, as in a real run, and the settings each stage recorded keep the protocol
    (protocol.json: no violation); the same records with one thing changed are caught."""
    from scripts.real_model.protocol import violations

    run_dir = task_smoke / TASK_RUN
    record = json.load(open(run_dir / "protocol.json"))
    assert record["violations"] == []
    S = record["settings"]
    sft_dir = os.path.join(TASK_RUN, "sft", "ar")
    assert S["mars"]["init_from"] == S["ar_sft"]["init_from"] == sft_dir == record["sft_dir"]
    assert (S["sft"]["ar_steps"], S["mars"]["mars_steps"], S["ar_sft"]["ar_steps"]) == (2, 2, 2)
    for name, release in (("sft", "ar"), ("mars", "mars"), ("ar_sft", "ar")):
        assert (run_dir / name / release / "model.safetensors").is_file()
    off = load_npz(str(run_dir / "data" / "train.npz"))["offsets"]
    lengths = (off[1:] - off[:-1]).tolist()
    for stage, key, value in (("ar_sft", "lr", 2 * S["ar_sft"]["lr"]), ("mars", "init_from", "out/smollm2"),
                              ("mars", "w_ar", 4.0), ("ar_sft", "ar_steps", 3), ("mars", "warmup_frac", 0.5)):
        bad = {**S, stage: {**S[stage], key: value}}
        assert violations(bad, sft_dir, lengths), (stage, key)
    assert any("same rows" in v for v in violations(S, sft_dir, lengths + [7]))  # 5 rows: no whole epoch


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_task_replies_regrade_and_redecode(task_smoke):
    """The smoke's replies.jsonl: one row per test problem, model and τ, with the issue's keys; each
    row's `correct` is the grader's verdict on its own reply and answer (and reply_row grades a right
    reply right), its reply is its ids' text, results.json's accuracy and tokens per forward are counts
    of its rows; and a row decoded again alone by generate.generate (the reference model, float64,
    batch 1) gives its ids, tokens and forwards: at a τ where steps kept several tokens, and at τ = 1
    (our AR decoder there is the τ rule in AR mode)."""
    from checkpoint import load_checkpoint
    from data.tasks.grade import is_correct
    from generate import generate, mars_decode
    from scripts.real_model.protocol import SMOKE
    from scripts.real_model.run import chat_ids, eos_of
    from scripts.real_model.task_eval import reply_row

    run_dir = task_smoke / TASK_RUN
    rows = read_jsonl(run_dir / "results" / "replies.jsonl")
    res = json.load(open(run_dir / "results" / "results.json"))
    problems = {p["id"]: p for p in read_jsonl(run_dir / "data" / "test.jsonl")}
    keys = {"problem", "model", "tau", "reply", "tokens", "forwards", "answer", "correct", "family"}
    assert all(keys <= set(r) for r in rows)
    runs = (("base", SMOKE["taus_ar"]), ("ar_sft", SMOKE["taus_ar"]), ("mars", SMOKE["taus"]))
    want = {(p, m, t) for p in list(problems)[:SMOKE["n_eval"]] for m, taus in runs for t in taus}
    assert sorted((r["problem"], r["model"], r["tau"]) for r in rows) == sorted(want)
    tok = Tokenizer.from_dir(task_smoke / "out" / "smollm2")
    for r in rows:
        p = problems[r["problem"]]
        assert (r["answer"], r["family"]) == (p["answer"], p["family"])
        assert r["correct"] == is_correct(p, r["reply"])
        assert r["tokens"] == len(r["ids"])
        assert r["reply"] == tok.decode(r["ids"][:-1] if r["finished"] else r["ids"])
    p = problems[rows[0]["problem"]]  # the smoke's replies are all wrong: the grader on a right one too
    right = tok.encode(p["messages"][1]["content"]) + [tok.eos_id]
    assert reply_row(tok, p, "mars", 1.0, Generation(right, 9))["correct"]
    assert not reply_row(tok, p, "mars", 1.0, Generation(right[:-4], 9))["correct"]  # cut mid-answer
    for d in res["decode"].values():
        mine = [r for r in rows if (r["model"], r["tau"]) == (d["model"], d["tau"])]
        assert d["accuracy"] == sum(r["correct"] for r in mine) / len(mine)
        assert d["tokens_per_forward"] == sum(r["tokens"] for r in mine) / sum(r["forwards"] for r in mine)
    multi = max((r for r in rows if r["tau"] < 1), key=lambda r: r["tokens"] - r["forwards"])
    assert multi["forwards"] < multi["tokens"]  # steps that kept several tokens
    model = load_checkpoint(str(run_dir / "mars" / "mars"), "cpu", torch.float64).model
    for r in (multi, next(r for r in rows if (r["model"], r["tau"]) == ("mars", 1.0))):
        prompt = chat_ids(tok, problems[r["problem"]]["messages"][0]["content"])
        kw = dict(block_size=4, tau=r["tau"], max_new_tokens=SMOKE["max_new_tokens"], mask_id=tok.mask_id,
                  eos_ids=eos_of(tok))
        g = generate(model, [prompt], **kw)[0]
        assert (g.ids, len(g.ids), g.forwards) == (r["ids"], r["tokens"], r["forwards"])
        conf = [c for s in mars_decode(model, [prompt], **kw) if s.conf for c in s.conf[0][1:]]
        assert all(abs(c - r["tau"]) > 1e-9 for c in conf)  # no confidence float64's 1e-16 could move past τ


def test_task_page_regenerates_from_saved_results_alone(task_smoke, tmp_path, monkeypatch):
    """The report stage's RESULTS.md comes back byte for byte from its results.json alone: in a directory
    holding nothing else (task_page.rewrite), and through `--report` with the run's pieces gone."""
    from scripts.real_model.__main__ import main
    from scripts.real_model.task_page import rewrite

    res_dir, eval_dir = task_smoke / TASK_RUN / "results", task_smoke / TASK_RUN / "eval"
    page = (res_dir / "RESULTS.md").read_text()
    for heading in ("## Accuracy at tau = 1", "## The tau sweep", "## Exact mode", "## Wall clock",
                    "## The tau rule's ceiling", "## Targets"):
        assert heading in page
    shutil.copy(res_dir / "results.json", tmp_path / "results.json")
    rewrite(str(tmp_path))
    assert (tmp_path / "RESULTS.md").read_text() == page and (tmp_path / "tau_sweep.png").stat().st_size > 0
    monkeypatch.chdir(task_smoke)
    os.rename(eval_dir, tmp_path / "eval")
    try:
        (res_dir / "RESULTS.md").unlink()
        main(["--config", "task", "--smoke", "--report"])
    finally:
        os.rename(tmp_path / "eval", eval_dir)
    assert (res_dir / "RESULTS.md").read_text() == page


def test_task_evaluation_resumes_skipping_finished_pieces(task_smoke, monkeypatch, capsys):
    """A piece of the evaluation lost (a run killed before it was written) is made again by the next
    run, and only it: every other piece is skipped, its file untouched; the piece made again is the
    lost one."""
    from scripts.real_model.__main__ import main

    monkeypatch.chdir(task_smoke)
    eval_dir = task_smoke / TASK_RUN / "eval"
    lost = eval_dir / "decode_mars_tau0.03.json"
    before = json.load(open(lost))["result"]
    kept = {f: os.stat(eval_dir / f).st_mtime_ns for f in os.listdir(eval_dir) if f != lost.name}
    lost.unlink()
    capsys.readouterr()
    main(["--config", "task", "--smoke", "--until", "evaluate"])
    out = capsys.readouterr().out
    assert json.load(open(lost))["result"] == before
    assert {f: os.stat(eval_dir / f).st_mtime_ns for f in kept} == kept
    skipped = [line for line in out.splitlines() if line.startswith("[evaluate]") and "skipped" in line]
    assert len(skipped) == len(kept) - 1  # every piece but the lost one (ceiling_r3.json is a stage's)


def test_task_numbers_are_counts_of_the_rows():
    """decode_summary's accuracy (all, per family), tokens per forward, EOS share and identical share,
    and paired_change (paired by problem, whatever the order), equal plain counts of hand-made rows,
    each interval holding its estimate."""
    from scripts.real_model.task_eval import decode_summary, paired_change

    fam = ["gsm", "gsm", "convert", "extract", "gsm", "convert"]

    def rows(correct, forwards, ids):
        return [{"problem": f"p{i}", "family": f, "correct": bool(c), "tokens": 5 + i, "forwards": n,
                 "finished": i % 2 == 0, "ids": d}
                for i, (f, c, n, d) in enumerate(zip(fam, correct, forwards, ids))]
    ref = rows([1, 1, 0, 1, 0, 1], [5, 6, 7, 8, 9, 10], [[i] for i in range(6)])
    new = rows([1, 0, 0, 1, 1, 0], [3, 3, 4, 4, 5, 5], [[i] if i < 3 else [9] for i in range(6)])
    meta = {"model": "mars", "tau": 0.9, "decoder": "window", "block_size": 4, "max_new_tokens": 12}
    s = decode_summary({**meta, "rows": new}, {**meta, "tau": 1.0, "rows": ref})
    assert (s["accuracy"], s["correct"], s["families"]["gsm"]["accuracy"]) == (3 / 6, 3, 2 / 3)
    assert (s["families"]["convert"]["accuracy"], s["families"]["extract"]["accuracy"]) == (0.0, 1.0)
    assert (s["tokens_per_forward"], s["finished"], s["identical_to_tau1"]) == (45 / 24, 0.5, 0.5)
    change = paired_change(new[::-1], ref)
    assert change["change"] == (3 - 4) / 6 == s["vs_tau1"]["change"]
    assert change["ci95"][0] <= change["change"] <= change["ci95"][1] and s["ci95"][0] <= 0.5 <= s["ci95"][1]


def test_task_targets_are_reached_exactly_at_their_bounds():
    """The page's targets (issue 54) say "yes" at their bounds and "no" just past them: MARS at τ = 1
    against AR SFT (-1 point), τ = 0.95's tokens per forward (1.5) and accuracy change (-2 points), the
    sweep's largest step down (10 points), the block cache's speed at batch 4 (1.3x)."""
    from scripts.real_model.task_page import target_rows

    def res(vs_ar, tpf, change, last_acc, speed):
        point = lambda t, acc, f, c: {"model": "mars", "tau": t, "accuracy": acc, "tokens_per_forward": f,  # noqa: E731
                                      "tpf_ci95": [f, f], "vs_tau1": {"change": c, "ci95": [c, c]}}
        decode = {"a": point(1.0, 0.60, 1.0, 0.0), "b": point(0.95, 0.60 + change, tpf, change),
                  "c": point(0.5, last_acc, 2.5, last_acc - 0.6),
                  "d": {**point(1.0, 0.6, 1.0, 0.0), "model": "ar_sft"}}
        block = {"speed_paired": speed, "speed_paired_ci95": [speed, speed], "tokens_per_forward": 1.5}
        return {"decode": decode, "mars_vs_ar_sft": {"change": vs_ar, "ci95": [vs_ar, vs_ar]},
                "ceiling": {"mars": {"ceilings": [{"tau": 0.95, "tokens_per_forward": 1.7}]}},
                "timing": {"batches": {"batch 4": {"block tau=0.95": block}}}}
    at = [r[2] for r in target_rows(res(-0.01, 1.5, -0.02, 0.48, 1.3))]
    past = [r[2] for r in target_rows(res(-0.0101, 1.499, -0.0201, 0.479, 1.299))]
    assert at == ["yes"] * 5 and past == ["no"] * 5



STAGE_RELEASES = (("sft", "ar"), ("mars", "mars"))


def rule_choice(cands, tau, min_tpf):
    """The pilot's rule written out: the best accuracy at τ among those reaching min_tpf tokens per forward
    there (all, if none does), τ = 1's accuracy next, then the list's order (sorted is stable)."""
    t = f"{tau:g}"
    pool = [c for c in cands if c["val"][t]["tokens_per_forward"] >= min_tpf] or cands
    return sorted(pool, key=lambda c: (-c["val"][t]["accuracy"], -c["val"]["1"]["accuracy"]))[0]


def release_stats(run_dir):
    return {s: os.stat(run_dir / s / r / "model.safetensors").st_mtime_ns for s, r in STAGE_RELEASES}


def test_task_pilot_chooses_on_validation_by_its_rule(task_smoke, monkeypatch, capsys):
    """`--pilot` on the smoke: the candidate with the config's own settings reuses the smoke run's stages
    1 and 2 (skipped, their weights untouched); the other trains its own, both stages at its lr, stage 2
    from its own stage 1; each candidate's numbers are counts of MARS's replies to the first n_eval
    validation problems (none of them a test problem); the choice is the rule written out here."""
    from scripts.real_model.__main__ import main
    from scripts.real_model.protocol import SMOKE

    monkeypatch.chdir(task_smoke)
    main_run = task_smoke / TASK_RUN
    weights = release_stats(main_run)
    capsys.readouterr()
    main(["--config", "task", "--smoke", "--pilot"])
    out = capsys.readouterr().out
    res = json.load(open(main_run / "results" / "pilot.json"))
    cands, tau, n = res["candidates"], SMOKE["pilot_overrides"]["tau"], SMOKE["pilot_overrides"]["n_eval"]
    assert [c["run_dir"] for c in cands] == [TASK_BASE, TASK_BASE + "-lr3e-05"]
    assert TASK_RUN in (TASK_BASE, TASK_BASE + "-lr3e-05")
    for c, printed in zip(cands, out.split("[pilot] candidate ")[1:]):
        done = "done before" if c["run_dir"] == TASK_RUN else "starting"
        assert f"[sft] {done}" in printed and f"[mars] {done}" in printed
        d = task_smoke / c["run_dir"]
        sft, mars = (json.load(open(d / s / r / "mars.json"))["settings"] for s, r in STAGE_RELEASES)
        assert sft["lr"] == mars["lr"] == c["settings"]["lr"]
        assert mars["init_from"] == os.path.join(c["run_dir"], "sft", "ar")
    assert release_stats(main_run) == weights
    for c in cands:
        d = task_smoke / c["run_dir"]
        val = [p["id"] for p in read_jsonl(d / "data" / "val.jsonl")][:n]
        test = {p["id"] for p in read_jsonl(d / "data" / "test.jsonl")}
        assert c["problems"] == val and not set(val) & test
        for t in (1.0, tau):
            rows = json.load(open(d / "eval_val" / f"decode_mars_tau{t:g}.json"))["result"]["rows"]
            assert [r["problem"] for r in rows] == val
            v = c["val"][f"{t:g}"]
            assert v["accuracy"] == sum(r["correct"] for r in rows) / len(rows)
            tokens, forwards = sum(r["tokens"] for r in rows), sum(r["forwards"] for r in rows)
            assert v["tokens_per_forward"] == tokens / forwards
    best = rule_choice(cands, tau, 1.5)
    assert res["chosen"] == cands.index(best) and res["chosen_settings"] == best["settings"]
    assert "**yes**" in (main_run / "results" / "PILOT.md").read_text()


def test_task_pilot_rule_on_hand_made_numbers():
    """choose(): the τ rule's accuracy decides among those reaching the tokens per forward; a more
    accurate candidate below it loses; τ = 1's accuracy breaks a tie, then the list's order; none
    reaching it: all."""
    from scripts.real_model.task_pilot import choose

    def c(acc1, acc, tpf):
        return {"val": {"1": {"accuracy": acc1}, "0.95": {"accuracy": acc, "tokens_per_forward": tpf}}}
    assert choose([c(0.3, 0.25, 1.6), c(0.3, 0.28, 1.49), c(0.3, 0.26, 1.5)], 0.95, 1.5) == 2
    assert choose([c(0.3, 0.26, 1.6), c(0.31, 0.26, 1.5)], 0.95, 1.5) == 1
    assert choose([c(0.3, 0.26, 1.6), c(0.3, 0.26, 1.7)], 0.95, 1.5) == 0
    assert choose([c(0.3, 0.20, 1.2), c(0.3, 0.22, 1.1)], 0.95, 1.5) == 1


def test_task_pilot_run_dirs_and_bad_candidates():
    """protocol.run_name: each candidate its own run dir, the first the config's name, also a candidate
    sharing the first's lr and differing in steps only (one matched the first by its lr alone once, and
    trained into the first's dir); settings no candidate lists, or no pilot: the config's name.
    check_pilot stops, naming the file, on candidates naming different settings, a setting the config
    lacks, or one candidate twice."""
    from scripts.real_model.protocol import check_pilot, run_name

    cands = [{"lr": 1e-4, "ar_steps": 64}, {"lr": 3e-5, "ar_steps": 64}, {"lr": 1e-4, "ar_steps": 112}]
    cfg, S = {"pilot": {"candidates": cands}}, {"lr": 1e-4, "ar_steps": 64, "mars_steps": 112}
    assert [run_name("t", cfg, {**S, **c}) for c in cands] == ["t", "t-lr3e-05", "t-ar_steps112"]
    assert run_name("t", cfg, {**S, "lr": 5e-5}) == run_name("t", {}, S) == "t"
    check_pilot(cfg, "c.json", S)
    for bad in ([cands[0], {"lr": 3e-5}], [{"lr": 1e-4, "warm": 1}], [cands[1], cands[2], cands[1]]):
        with pytest.raises(SystemExit, match="c.json: "):
            check_pilot({"pilot": {"candidates": bad}}, "c.json", S)


def test_task_config_runs_what_the_committed_pilot_chose():
    """configs/smollm2-task.json's settings are the ones its committed pilot (results/real_model/task/
    pilot.json) chose on validation, and that choice is the rule's on the pilot's recorded numbers."""
    cfg = json.load(open(os.path.join(REPO, "configs", "smollm2-task.json")))
    res = json.load(open(os.path.join(REPO, cfg["_real_model"]["results_dir"], "pilot.json")))
    p = cfg["_real_model"]["pilot"]
    assert [c["settings"] for c in res["candidates"]] == p["candidates"]
    assert [res[k] for k in ("tau", "min_tokens_per_forward", "n_eval")] == \
        [p[k] for k in ("tau", "min_tokens_per_forward", "n_eval")]
    best = rule_choice(res["candidates"], res["tau"], res["min_tokens_per_forward"])
    assert res["chosen_settings"] == best["settings"]
    assert all(cfg[k] == v for k, v in best["settings"].items())
