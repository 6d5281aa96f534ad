"""The task protocol (issue 54), its --smoke run once for the module on a tiny random base: the
stages keep the protocol; every reply of the sweep is a JSONL row whose verdict is the grader's and
whose counts a re-decode gives back; the page comes back from results.json alone; a lost piece of
the evaluation is made again and only it; its numbers are counts of the rows and its targets
turn at their bounds. Its pilot (--pilot): the proposal's candidate reuses the run's stages, another
trains its own; the numbers are counts of validation replies and the choice is the rule written out;
each candidate has its own run dir; the committed config runs what the committed pilot chose.
The committed task pages (the run, and the proposal's before the pilot) are their replies re-graded
and counted, and record the committed config's settings."""

import json
import os
import shutil

import pytest
import torch
from conftest import page_through_report, task_smoke_root

from data.prepare import load_npz
from decoding import Generation
from tokenizer import Tokenizer

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
    from data.tasks import generate

    rows = generate({"train": 40, "val": 8, "test": 8}, seed=0)
    return task_smoke_root(tmp_path_factory, "task_smoke", rows, "task")


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


def counted(rows):
    """(accuracy, tokens per forward) of reply rows, counted: the share graded correct, and all their
    tokens over all their forwards."""
    return (sum(r["correct"] for r in rows) / len(rows),
            sum(r["tokens"] for r in rows) / sum(r["forwards"] for r in rows))


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
        assert (d["accuracy"], d["tokens_per_forward"]) == counted(mine)
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


def test_task_page_regenerates_from_saved_results_alone(task_smoke, tmp_path):
    """The report stage's RESULTS.md comes back byte for byte from its results.json alone: in a directory
    holding nothing else (task_page.rewrite), and through `--report` with the run's pieces gone."""
    from scripts.real_model.task_page import rewrite

    res_dir, eval_dir = task_smoke / TASK_RUN / "results", task_smoke / TASK_RUN / "eval"
    page = (res_dir / "RESULTS.md").read_text()
    for heading in ("## Accuracy at tau = 1", "## The tau sweep", "## Exact mode", "## Wall clock",
                    "## The tau rule's ceiling", "## Targets"):
        assert heading in page
    shutil.copy(res_dir / "results.json", tmp_path / "results.json")
    rewrite(str(tmp_path))
    assert (tmp_path / "RESULTS.md").read_text() == page and (tmp_path / "tau_sweep.png").stat().st_size > 0
    assert page_through_report(task_smoke, "task", res_dir, eval_dir, tmp_path) == page


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


@pytest.fixture(scope="module")
def speed_smoke(task_smoke):
    """`python -m scripts.real_model --config task --smoke --speed` (issue 62) in the smoke's root, after
    its stages: every decoder on the reference, the engine (eager in the smoke), its loops and HF, timed
    -> (the run dir, speed.json)."""
    from scripts.real_model.__main__ import main

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(task_smoke)
        main(["--config", "task", "--smoke", "--speed"])
    run_dir = task_smoke / TASK_RUN
    return run_dir, json.load(open(run_dir / "results" / "speed.json"))


def test_speed_run_records_every_decoder_and_compares_replies(speed_smoke):
    """Every decoder of every path at every batch size has a record with the issue's fields; HF's prompt
    lookup at batch 1 only (HF takes one row); the replies each record's counts come from are the saved
    piece's: identical_to_ar is the share of replies equal to its own path's AR, recounted here; exact
    mode gives AR's replies on every path, and (float64) every engine decoder gives the reference's
    replies, in the clock's run and in the untimed check."""
    from scripts.real_model.task_speed import SMOKE, decoder_names

    run_dir, res = speed_smoke
    names = decoder_names(SMOKE)
    want = {(d, p, b) for b in SMOKE["batches"] for p in ("reference", "engine") for d in names}
    want |= {(d, "engine loop", b) for b in SMOKE["batches"] for d in names if not d.endswith("block")}
    want |= {("ar", "hf", b) for b in SMOKE["batches"]} | {("prompt lookup", "hf", 1)}
    got = {(r["decoder"], r["path"], r["batch"]): r for r in res["records"]}
    assert set(got) == want and len(res["records"]) == len(want)
    assert "machine" in res and res["machine"].startswith("machine: cpu")
    for r in res["records"]:
        for k in ("ms_per_reply", "tokens_per_s", "tokens_per_forward", "speed_vs_engine_ar",
                  "identical_to_ar"):
            assert isinstance(r[k], float) and r[k] >= 0, (k, r)
    for b in SMOKE["batches"]:
        piece = json.load(open(run_dir / "speed" / f"batch_{b}.json"))["piece"]
        replies = {(r["path"], r["decoder"]): r["replies"] for r in piece["records"]}
        forwards = {(r["path"], r["decoder"]): r["forwards"] for r in piece["records"]}
        assert all(len(v) == SMOKE["n"] for v in replies.values())
        for (path, d), ids in replies.items():
            same = sum(a == c for a, c in zip(ids, replies[(path, "ar")])) / len(ids)
            assert got[(d, path, b)]["identical_to_ar"] == same
            assert got[(d, path, b)]["tokens_per_forward"] == sum(map(len, ids)) / sum(forwards[(path, d)])
            if d.startswith("exact"):
                assert same == 1.0, (path, d, b)
            if path in ("engine", "engine loop"):
                assert ids == replies[("reference", d)], (path, d, b)
    assert all(v == 1.0 for path in res["equal_fp32"].values() for v in path.values())
    assert set(res["equal_fp32"]["engine"]) == set(names) and "exact K=2" in res["equal_fp32"]["engine loop"]


def median(xs):
    """The median, written out."""
    xs, h = sorted(xs), len(xs) // 2
    return xs[h] if len(xs) % 2 else (xs[h - 1] + xs[h]) / 2


def check_speed_json(res):
    """speed.json's numbers recomputed by brute force from the times it recorded (rounds x items):
    ms per reply from the median round, speed against the engine's faster AR and HF's faster AR the
    median of the per-round paired ratios; every round runs every (decoder, path) on every item once,
    and the recorded order is rotated by one decoder each round."""
    for b, times in res["times"].items():
        rounds = {k: [sum(r) for r in v] for k, v in times.items()}
        base = min((k for k in ("engine | ar", "engine loop | ar") if k in rounds),
                   key=lambda k: median(rounds[k]))
        hf_base = min((k for k in ("hf | ar", "hf | ar static") if k in rounds),
                      key=lambda k: median(rounds[k]))
        assert res["engine_ar_path"][b] == {"engine": base.split(" | ")[0], "hf": hf_base.split(" | ")[1]}
        for r in (x for x in res["records"] if str(x["batch"]) == b):
            k = f"{r['path']} | {r['decoder']}"
            assert r["ms_per_reply"] == pytest.approx(1000 * median(rounds[k]) / r["n"], rel=1e-12)
            ratios = [a / d for a, d in zip(rounds[base], rounds[k])]
            assert r["speed_vs_engine_ar"] == pytest.approx(median(ratios), rel=1e-12)
            hf = [a / d for a, d in zip(rounds[hf_base], rounds[k])]
            assert r["speed_vs_hf"] == pytest.approx(median(hf), rel=1e-12)
            lo, hi = r["speed_vs_engine_ar_ci95"]
            assert lo <= hi
        order = res["order"][b]
        names = list(dict.fromkeys(n for _, _, n in order))
        n_items = len(res["times"][b]["engine | ar"][0])
        R = len(res["times"][b]["engine | ar"])
        assert len(order) == R * n_items * len(names)
        for r in range(R):
            calls = [(i, n) for rr, i, n in order if rr == r]
            assert sorted(calls) == sorted((i, n) for i in range(n_items) for n in names)
            first_item = [n for i, n in calls if i == 0]
            assert first_item == names[r % len(names):] + names[:r % len(names)]


def test_speed_ratios_are_the_recorded_times_and_rounds_alternate(speed_smoke):
    """check_speed_json on the smoke's speed.json."""
    check_speed_json(speed_smoke[1])


def test_the_committed_speed_page_is_its_json():
    """results/real_model/task/v1/SPEED.md (issue 62) is task_speed.speed_page of the committed speed.json,
    whose numbers are its recorded times (check_speed_json); on the real model exact mode gave its
    path's AR replies on every timed problem, every path and batch, and the engine's dtype was the one
    the page names."""
    from scripts.real_model.task_speed import speed_page

    d = os.path.join(REPO, "results", "real_model", "task", "v1")
    res = json.load(open(os.path.join(d, "speed.json")))
    assert open(os.path.join(d, "SPEED.md")).read() == speed_page(res)
    check_speed_json(res)
    exact = [r for r in res["records"] if r["decoder"].startswith("exact")]
    assert exact and all(r["identical_to_ar"] == 1.0 for r in exact)
    assert {r["batch"] for r in res["records"]} == set(res["settings"]["batches"])


def test_speed_page_regenerates_from_speed_json_alone(speed_smoke, tmp_path):
    """SPEED.md comes back byte for byte from speed.json alone (task_speed.rewrite, as --speed --report)."""
    from scripts.real_model.task_speed import rewrite

    run_dir, _ = speed_smoke
    page = (run_dir / "results" / "SPEED.md").read_text()
    assert "## Batch 1" in page and "| exact K=2 | engine loop |" in page
    shutil.copy(run_dir / "results" / "speed.json", tmp_path / "speed.json")
    rewrite(str(tmp_path))
    assert (tmp_path / "SPEED.md").read_text() == page and (tmp_path / "speed.png").stat().st_size > 0


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
            assert (v["accuracy"], v["tokens_per_forward"]) == counted(rows)
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
    """configs/smollm2-task.json's settings are the ones its committed pilot (results/real_model/task/v1/
    pilot.json) chose on validation, that choice is the rule's on the pilot's recorded numbers, and the
    committed PILOT.md is its page, rendered from pilot.json alone."""
    from scripts.real_model.task_pilot import pilot_page

    cfg = json.load(open(os.path.join(REPO, "configs", "smollm2-task.json")))
    res_dir = os.path.join(REPO, cfg["_real_model"]["results_dir"])
    res = json.load(open(os.path.join(res_dir, "pilot.json")))
    assert open(os.path.join(res_dir, "PILOT.md")).read() == pilot_page(res)
    p = cfg["_real_model"]["pilot"]
    assert [c["settings"] for c in res["candidates"]] == p["candidates"]
    assert [res[k] for k in ("tau", "min_tokens_per_forward", "n_eval")] == \
        [p[k] for k in ("tau", "min_tokens_per_forward", "n_eval")]
    best = rule_choice(res["candidates"], res["tau"], res["min_tokens_per_forward"])
    assert res["chosen_settings"] == best["settings"]
    assert all(cfg[k] == v for k, v in best["settings"].items())


@pytest.mark.parametrize("sub", ["", "proposal"])
def test_the_committed_task_pages_are_their_replies_counted(sub):
    """The committed task run's pages (results/real_model/task/v1/: the run of the committed config;
    proposal/: the run before the pilot, of its first candidate): RESULTS.md is task_page's page of
    results.json alone; every reply's verdict is the family's grader on its text; results.json's
    accuracies and tokens per forward are counts of replies.jsonl; the settings it records are the
    committed config's (proposal/: the config with the pilot's first candidate)."""
    from data.tasks.grade import is_correct
    from scripts.real_model.run import load_config, train_settings
    from scripts.real_model.task_page import page

    path, full, cfg = load_config(os.path.join(REPO, "configs", "smollm2-task.json"), False)
    d = os.path.join(REPO, cfg["results_dir"], sub)
    res = json.load(open(os.path.join(d, "results.json")))
    assert open(os.path.join(d, "RESULTS.md")).read() == page(res)
    rows = read_jsonl(os.path.join(d, "replies.jsonl"))
    assert all(r["correct"] == is_correct(r, r["reply"]) for r in rows)
    assert len(res["decode"]) == len({(r["model"], r["tau"]) for r in rows})
    for dec in res["decode"].values():
        mine = [r for r in rows if (r["model"], r["tau"]) == (dec["model"], dec["tau"])]
        assert len(mine) == cfg["n_eval"]
        assert (dec["accuracy"], dec["tokens_per_forward"]) == counted(mine)
    want = train_settings(full, cfg)
    if sub == "proposal":
        want = {**want, **cfg["pilot"]["candidates"][0]}
    assert res["train_settings"] == want
