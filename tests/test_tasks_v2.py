"""Task set v2 (data/tasks/v2/), its graders and the clustered bootstrap (issue 61), proven on the
problems themselves: template and frame counts per split; splits disjoint by template, frame and
question text; a fixed seed gives the same problems in any process; every worked solution's
arithmetic recomputes, within the ranges the docstrings promise, to the answer the v2 grader
extracts and grades right; the graders on hand-written replies (each accepted form, wrong
numbers, cut mid-answer, no answer sentence); the bootstrap equal to its two-stage draws written
out in loops, and its resampled distribution equal to the exact one on a two-template table."""

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from data.bpe import train_bpe
from data.prepare import load_npz
from data.tasks import INSTRUCTION
from data.tasks.v2 import HELD_OUT, MODULES, PREFIX, SIZES, SPLITS, build, generate, template_splits
from data.tasks.v2.grade import final_answer, grade_exact, grade_number, is_correct
from scripts.real_model.clustered import accuracy_difference, ratio_difference, resamples
from tokenizer import Tokenizer

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


@pytest.fixture(scope="module")
def splits():
    return generate({"train": 1200, "val": 300, "test": 400}, seed=0)


def question(row):
    """The user turn without the family's fixed instruction."""
    text = row["messages"][0]["content"]
    suffix = "\n\n" + INSTRUCTION[row["family"]]
    assert text.endswith(suffix)
    return text[:-len(suffix)]


def test_template_and_frame_counts():
    by = template_splits(0)
    count = {s: sum(len(by[f][s]) for f in MODULES) for s in SPLITS}
    assert sum(count.values()) >= 120 and count["test"] >= 40 and count["val"] >= 20, count
    for family, parts in by.items():
        frames = {s: {fr for fr, _ in parts[s]} for s in SPLITS}
        assert (len(frames["test"]), len(frames["val"])) == HELD_OUT[family]
        assert set.union(*frames.values()) == set(MODULES[family].FRAMES)  # every frame in a split
        assert sum(map(len, frames.values())) == len(MODULES[family].FRAMES)  # ... in one only
        assert len(frames["train"]) > len(frames["test"]) + len(frames["val"])


def test_default_sizes_give_each_template_its_share():
    rows = generate(seed=0)
    assert {s: len(r) for s, r in rows.items()} == SIZES
    by = template_splits(0)
    for split in SPLITS:
        counts = {f"{PREFIX[f]}/{fr}/{c}": 0 for f in MODULES for fr, c in by[f][split]}
        for r in rows[split]:
            counts[r["template"]] += 1  # a KeyError: a template from another split
        for f in MODULES:
            mine = [n for t, n in counts.items() if t.startswith(PREFIX[f] + "/")]
            assert min(mine) > 0 and max(mine) - min(mine) <= 1
    assert [r["id"] for r in rows["test"]] == [f"test-{i:05d}" for i in range(SIZES["test"])]


def test_splits_disjoint_by_template_frame_and_text(splits):
    for s in SPLITS:
        texts = [r["messages"][0]["content"] for r in splits[s]]
        assert len(set(texts)) == len(texts)  # distinct within a split
        for r in splits[s]:
            assert r["template"].startswith(r["frame"] + "/")
            assert r["frame"].split("/")[0] == PREFIX[r["family"]]
    of = lambda key, s: {r[key] if key != "text" else question(r) for r in splits[s]}  # noqa: E731
    for key in ("template", "frame", "text"):
        for a, b in itertools.combinations(SPLITS, 2):
            assert not of(key, a) & of(key, b), (key, a, b)
    for family in MODULES:  # all three splits hold problems of every family
        assert all(any(r["family"] == family for r in splits[s]) for s in SPLITS)


def test_a_seed_gives_the_same_problems_in_any_process():
    sizes = {"train": 200, "val": 50, "test": 50}
    digest = lambda s: hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()  # noqa: E731
    here = digest(generate(sizes, seed=3))
    code = ("import data.tasks.v2 as t, hashlib, json; "
            f"rows = t.generate({sizes}, 3); "
            "print(hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert here == other == digest(generate(sizes, seed=3))
    assert template_splits(0) != template_splits(1)  # the seed chooses the held-out frames
    three, four = generate(sizes, seed=3)["train"], generate(sizes, seed=4)["train"]
    common = {r["template"] for r in three} & {r["template"] for r in four}  # in train for both seeds
    texts = [{r["messages"][0]["content"] for r in rows if r["template"] in common} for rows in (three, four)]
    assert len(texts[0]) > 50 and len(texts[0] & texts[1]) < 0.1 * len(texts[0])  # ... and the problems


def in_range(a, op, b, c):
    """The arithmetic of the docstrings: sums under 100, differences from at most 108 (a product)
    leaving at least 2, the times table (factors 2..9 and 2..12) and its exact divisions."""
    if op == "+":
        return c <= 99
    if op == "-":
        return a <= 108 and c >= 2
    x, y = (a, b) if op == "*" else (b, c)
    return min(x, y) <= 9 and max(x, y) <= 12 and min(x, y) >= 2


def test_worked_solutions_recompute_within_the_ranges(splits):
    for row in (r for rows in splits.values() for r in rows):
        lines = row["messages"][1]["content"].split("\n")[:-1]
        if row["family"] == "extract":  # the answer is read off the paragraph
            assert len(lines) == 1 and row["answer"] in question(row) and row["answer"] in lines[0]
            continue
        known = {int(x) for x in re.findall(r"\d+", question(row))}
        if row["family"] == "gsm":
            unit = MODULES["gsm"].FRAMES[row["frame"].split("/")[1]].unit
            assert re.fullmatch(rf"At first there are (\d+) {unit}\.", lines[0]), lines[0]
            assert int(lines[0].split()[4]) in known
            lines = lines[1:]
        result = None
        for line in lines:
            eqs = EQUATION.findall(line)
            assert len(eqs) == 1, f"{row['template']}: not one equation: {line!r}"
            a, op, b, c = (int(x) if x.isdigit() else x for x in eqs[0])
            assert {a, b} <= known, f"{row['template']}: {line!r} uses a number from nowhere"
            assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op], line
            assert op != "/" or a % b == 0, line  # exact
            assert in_range(a, op, b, c), (row["template"], line)
            known.add(c)
            result = c
        assert result == int(row["answer"]), row["template"]  # the last step's result is the answer


def test_every_solution_is_graded_right(splits):
    for row in (r for rows in splits.values() for r in rows):
        reply = row["messages"][1]["content"]
        assert reply.endswith(f"\nThe answer is {row['answer']}.")
        assert final_answer(reply) == row["answer"]
        assert is_correct(row, reply) and is_correct(row, reply, stopped=True)
        wrong = str(int(row["answer"]) + 1) if row["family"] != "extract" else row["answer"] + "X"
        assert not is_correct({**row, "answer": wrong}, reply)


NUMBER_CASES = [  # (reply, expected, stopped, right?)
    ("6 + 12 = 18.\nThe answer is 18.", 18, False, True),
    ("The answer is: 18.", 18, False, True),
    ("the answer is 18.", 18, False, True),
    ("THE ANSWER IS 18.", 18, False, True),
    ("The final answer is 18.", 18, False, True),
    ("The answer is 18 apples.", 18, False, True),
    ("The answer is $18.", 18, False, True),
    ("The answer is 18 dollars.", 18, False, True),
    ("The answer is **18**.", 18, False, True),
    ("**The answer is 18.**", 18, False, True),
    ("The answer is 18.00.", 18, False, True),
    ("The answer is 1,800.", 1800, False, True),
    ("The answer is 18. Hope this helps!", 18, False, True),
    ("Answer: 18\n", 18, False, True),  # the line ended: a whole answer
    ("**Answer:** 18.", 18, False, True),
    ("Answer: 18", 18, True, True),  # the reply stopped by itself
    ("The answer is 18", 18, True, True),
    ("The answer is 20.\nAnswer: 18\n", 18, False, True),  # the last cue counts
    ("The answer is 18", 18, False, False),  # cut at the cap before the period
    ("Answer: 18", 18, False, False),
    ("6 + 12 = 18.\nThe answer is 1", 1, False, False),  # cut mid-number, the prefix the expected value
    ("The answer is ", 18, False, False),
    ("The answer is 19.", 18, False, False),
    ("The answer is 180.", 18, False, False),
    ("The answer is 1,8.", 18, False, False),  # not a thousands separator
    ("The answer is 18 or 19.", 18, False, False),  # not one number
    ("The answer is 6 + 12 = 18.", 18, False, False),
    ("The answer is eighteen.", 18, False, False),
    ("So the total is 18 apples.", 18, True, False),  # no answer sentence
    ("The answer is 18.\nNo wait, the answer is 20.", 18, False, False),
]
EXACT_CASES = [
    ("The train goes to Oslo.\nThe answer is Oslo.", "Oslo", False, True),
    ('The answer is "Oslo".', "Oslo", False, True),
    ("The answer is: \u201cOslo\u201d.", "Oslo", False, True),
    ("The answer is oslo.", "Oslo", False, True),  # case-insensitive (grade.py's docstring)
    ("The answer is **Oslo**.", "Oslo", False, True),
    ("Answer: Oslo\n", "Oslo", False, True),
    ("The answer is Oslo", "Oslo", True, True),
    ("The answer is qx-4471.", "QX-4471", False, True),
    ("The answer is Hall  C.", "Hall C", False, True),
    ("The answer is 35 km/h.", "35 km/h", False, True),
    ("The answer is 09:30.", "09:30", False, True),
    ("The answer is Bergen.", "Oslo", False, False),
    ("The answer is Oslo, Norway.", "Oslo", False, False),
    ("The answer is QX-4472.", "QX-4471", False, False),
    ("The answer is 5 km/h.", "35 km/h", False, False),
    ("The answer is Osl", "Oslo", False, False),  # cut mid-answer
    ("The answer is Oslo", "Oslo", False, False),  # cut before the period
    ("The train goes to Oslo.", "Oslo", True, False),  # no answer sentence
]


@pytest.mark.parametrize("reply, expected, stopped, right", NUMBER_CASES)
def test_grade_number(reply, expected, stopped, right):
    assert grade_number(reply, expected, stopped) is right
    assert is_correct({"family": "gsm", "answer": str(expected)}, reply, stopped) is right


@pytest.mark.parametrize("reply, expected, stopped, right", EXACT_CASES)
def test_grade_exact(reply, expected, stopped, right):
    assert grade_exact(reply, expected, stopped) is right
    assert is_correct({"family": "extract", "answer": expected}, reply, stopped) is right


def test_build_writes_the_rows(tmp_path):
    sizes = {"train": 60, "val": 20, "test": 20}
    splits = build(str(tmp_path), 0, sizes)
    for s in SPLITS:
        assert [json.loads(line) for line in open(tmp_path / f"{s}.jsonl")] == splits[s] == generate(sizes)[s]
    layout = json.load(open(tmp_path / "templates.json"))
    by = template_splits(0)
    for family in MODULES:
        for s in SPLITS:
            assert layout[family][s]["templates"] == [f"{PREFIX[family]}/{fr}/{c}" for fr, c in by[family][s]]
            assert {r["frame"] for r in splits[s] if r["family"] == family} <= \
                {f"{PREFIX[family]}/{fr}" for fr in layout[family][s]["frames"]}


def test_build_with_a_tokenizer_writes_what_prepare_reads(tmp_path):
    """With a tokenizer, train.npz and val.npz hold every row, the loss exactly on the reply, its
    <|im_end|> and the newline after it (data/prepare.py, as for v1)."""
    sizes = {"train": 30, "val": 8, "test": 8}
    small = generate(sizes, seed=0)
    train_bpe([m["content"] for rows in small.values() for r in rows for m in r["messages"]], 60).save(
        tmp_path / "tok")
    build(str(tmp_path / "out"), 0, sizes, tokenizer=str(tmp_path / "tok"))
    tok = Tokenizer.from_dir(tmp_path / "tok")
    for split in ("train", "val"):
        d = load_npz(str(tmp_path / "out" / f"{split}.npz"))
        assert len(d["offsets"]) - 1 == len(small[split])
        for i, r in enumerate(small[split]):
            a, b = d["offsets"][i], d["offsets"][i + 1]
            ids, loss = d["ids"][a:b], d["loss"][a:b].astype(bool)
            assert tok.decode(ids[loss].tolist()) == r["messages"][1]["content"] + "<|im_end|>\n"


def two_stage_in_loops(groups, n, seed, stat):
    """The resampled statistics of clustered.py's draws, written out: templates in first-seen
    order, then for each resample G picks and one uniform per drawn problem, in that order."""
    labels = list(dict.fromkeys(groups))
    members = [[i for i, g in enumerate(groups) if g == label] for label in labels]
    rng, out = np.random.default_rng(seed), []
    for _ in range(n):
        picks = rng.integers(0, len(labels), len(labels))
        u = rng.random(sum(len(members[g]) for g in picks))
        idx, k = [], 0
        for g in picks:
            for _ in members[g]:
                idx.append(members[g][int(u[k] * len(members[g]))])
                k += 1
        out.append(stat(idx))
    return out


def test_bootstrap_equals_its_draws_written_out():
    rng = np.random.default_rng(7)
    groups = ["t3", "t1", "t3", "t2", "t2", "t3", "t4", "t4", "t4", "t4", "t4"]  # sizes 3, 1, 2, 5
    a, b = rng.integers(0, 2, len(groups)), rng.integers(0, 2, len(groups))
    num_a, den_a = rng.integers(20, 60, len(groups)), rng.integers(20, 60, len(groups))
    num_b, den_b = rng.integers(20, 60, len(groups)), rng.integers(5, 30, len(groups))
    acc = lambda idx: 100 * (sum(b[i] for i in idx) - sum(a[i] for i in idx)) / len(idx)  # noqa: E731
    ratio = lambda idx: (sum(num_b[i] for i in idx) / sum(den_b[i] for i in idx)  # noqa: E731
                         - sum(num_a[i] for i in idx) / sum(den_a[i] for i in idx))
    for got, stat in ((accuracy_difference(a, b, groups, 300, 5), acc),
                      (ratio_difference(num_a, den_a, num_b, den_b, groups, 300, 5), ratio)):
        draws = two_stage_in_loops(groups, 300, 5, stat)
        assert got["ci95"] == pytest.approx(list(np.percentile(draws, [2.5, 97.5])), rel=1e-12, abs=1e-12)
        assert got["estimate"] == pytest.approx(stat(range(len(groups))), rel=1e-12)
        assert got["half_width"] == pytest.approx((got["ci95"][1] - got["ci95"][0]) / 2)
        assert (got["problems"], got["templates"], got["draws"]) == (11, 4, 300)
    same = accuracy_difference(a, a, groups, 300, 5)  # an arm against itself: paired, no spread
    assert same["estimate"] == 0 and same["ci95"] == [0, 0]


def exact_distribution(groups, stat):
    """{value: probability} of stat over every two-stage resample of the table, enumerated."""
    labels = list(dict.fromkeys(groups))
    members = [[i for i, g in enumerate(groups) if g == label] for label in labels]
    out = {}
    for picks in itertools.product(range(len(labels)), repeat=len(labels)):
        within = [itertools.product(members[g], repeat=len(members[g])) for g in picks]
        p = len(labels) ** -len(labels) * np.prod([len(members[g]) ** -len(members[g]) for g in picks])
        for draw in itertools.product(*within):
            v = round(stat([i for part in draw for i in part]), 9)
            out[v] = out.get(v, 0) + p
    return out


def test_bootstrap_matches_the_exact_two_stage_distribution():
    """On two templates (2 and 3 problems) the distribution of B - A over every two-stage resample
    (961 of them, each with its probability) is enumerated; the empirical CDF of 20000 resamples
    must lie within 0.02 of it at every value: by the DKW inequality a correct sampler strays that
    far with probability 2 exp(-2 * 20000 * 0.02**2) < 1e-6, while resampling templates only
    (0.23 away), problems only (0.10) or the arms independently (0.08) is further than 0.05 (the
    last is the statistic's doing, not the draws': the test above catches it)."""
    groups = ["x", "x", "y", "y", "y"]
    a, b = np.array([1, 0, 1, 1, 0]), np.array([1, 1, 0, 1, 1])
    stat = lambda idx: 100 * (b[idx].mean() - a[idx].mean())  # noqa: E731
    exact = exact_distribution(groups, lambda idx: stat(np.array(idx)))
    assert sum(exact.values()) == pytest.approx(1)
    values = np.array(sorted(exact))
    cdf = np.cumsum([exact[v] for v in values])
    draws = np.array([round(stat(idx), 9) for idx in resamples(groups, 20000, 11)])
    assert set(draws) <= set(values)
    empirical = np.searchsorted(np.sort(draws), values, side="right") / len(draws)
    assert np.max(np.abs(empirical - cdf)) < 0.02
    got = accuracy_difference(a, b, groups, 20000, 11)  # the interval: within the DKW band's quantiles
    q = lambda p: values[np.searchsorted(cdf, p - 1e-12)]  # noqa: E731
    assert q(0.025 - 0.02) <= got["ci95"][0] <= q(0.025 + 0.02)
    assert q(0.975 - 0.02) <= got["ci95"][1] <= q(0.975 + 0.02)
