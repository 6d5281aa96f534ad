"""The task set (data/tasks/) and its graders, proven on the problems themselves: splits disjoint by
template and by text, and no sentence shared by two templates; a fixed seed gives the same
problems in any process; every worked solution's arithmetic recomputes, from numbers of its
question, to the answer the grader extracts; every extraction answer stands in its paragraph;
the rows are what data/prepare.py reads; and the graders on hand-written replies: right, wrong,
right but formatted otherwise, cut mid-answer."""

import hashlib
import json
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from data.bpe import train_bpe
from data.prepare import load_npz
from data.tasks import FAMILIES, HELD_OUT, INSTRUCTION, SIZES, SPLITS, build, generate, template_splits
from data.tasks.extract import BANDS, DEPARTMENTS, GENRES
from data.tasks.grade import final_answer, grade_exact, grade_number, is_correct
from data.tasks.pools import WORDS
from tokenizer import Tokenizer

EQUATION = re.compile(r"((?:\d+ [-+*/] )+\d+) = (\d+)")
CONSTANTS = {1, 2, 3, 4, 6, 100}  # what a step may use unsaid: twice, half, a third, legs, "six", percent


@pytest.fixture(scope="module")
def splits():
    return generate(seed=0)  # the default sizes: what a run trains and tests on


def question(row):
    """The user turn without the family's fixed instruction."""
    text = row["messages"][0]["content"]
    suffix = "\n\n" + INSTRUCTION[row["family"]]
    assert text.endswith(suffix)
    return text[:-len(suffix)]


def skeletons(text):
    """The sentences of a question with what varies between problems of one template masked: pool
    words (names, places, objects, ...), pronouns, codes and numbers."""
    words = sorted(set(WORDS + DEPARTMENTS + GENRES + BANDS), key=len, reverse=True)
    text = re.sub(r"\b(" + "|".join(map(re.escape, words)) + r")\b", "W", text)
    text = re.sub(r"\b(she|he|her|his|him|She|He|Her|His)\b", "P", text)
    text = re.sub(r"\b[A-Z]{1,3}-\d+\b|\d+", "N", text)
    return {s for s in re.split(r"(?<=[.?!:;])\s+|\n+", text) if s}


def test_sizes_and_families(splits):
    assert {s: len(rows) for s, rows in splits.items()} == SIZES
    assert len(splits["train"]) >= 2000 and len(splits["test"]) >= 200
    assert sum(r["family"] == "gsm" for r in splits["test"]) >= 200  # the headline family alone
    for split, rows in splits.items():
        for family in FAMILIES:
            counts = [sum(r["template"] == f"{family}/{t.__name__}" for r in rows)
                      for t in template_splits(0)[family][split]]
            assert min(counts) > 0 and max(counts) - min(counts) <= 1  # each template its even share
    assert [r["id"] for r in splits["test"]] == [f"test-{i:05d}" for i in range(SIZES["test"])]


def test_splits_disjoint_by_template_and_text(splits):
    by = template_splits(0)
    for family, templates in FAMILIES.items():
        parts = [set(by[family][s]) for s in SPLITS]
        assert sum(map(len, parts)) == len(templates) == len(set.union(*parts))  # each template once
        assert len(parts[1]) == len(parts[2]) == HELD_OUT[family]
    templates = {s: {r["template"] for r in rows} for s, rows in splits.items()}
    texts = {s: [r["messages"][0]["content"] for r in rows] for s, rows in splits.items()}
    for s in SPLITS:
        assert len(set(texts[s])) == len(texts[s])  # distinct within a split
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert not templates[a] & templates[b]
        assert not set(texts[a]) & set(texts[b])


def test_no_two_templates_share_a_sentence(splits):
    """Wordings never seen in training, whatever the seed's split: no sentence of a question or of
    a worked solution (the fixed final line and instruction aside) is shared by two templates, once
    the names, objects, pronouns and numbers are masked."""
    owners = {}
    for row in (r for rows in splits.values() for r in rows):
        steps = "\n".join(row["messages"][1]["content"].split("\n")[:-1])
        for sentence in skeletons(question(row)) | skeletons(steps):
            owners.setdefault(sentence, set()).add(row["template"])
    shared = {s: sorted(t) for s, t in owners.items() if len(t) > 1}
    assert not shared, f"sentences of more than one template: {shared}"
    assert len(owners) > 5 * sum(map(len, FAMILIES.values()))  # the masking leaves sentences apart


def test_a_seed_gives_the_same_problems_in_any_process():
    sizes = {"train": 300, "val": 30, "test": 30}
    digest = lambda s: hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()  # noqa: E731
    here = digest(generate(sizes, seed=3))
    code = ("import data.tasks, hashlib, json; "
            f"rows = data.tasks.generate({sizes}, 3); "
            "print(hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert here == other == digest(generate(sizes, seed=3))
    assert digest(generate(sizes, seed=4)) != here
    assert template_splits(0) != template_splits(1)  # the seed chooses the held-out templates too


def test_worked_solutions_recompute_to_the_graded_answer(splits):
    for row in (r for rows in splits.values() for r in rows):
        reply = row["messages"][1]["content"]
        assert final_answer(reply) == row["answer"] and is_correct(row, reply)
        if row["family"] == "extract":  # the answer is read off the paragraph
            assert row["answer"] in question(row) and row["answer"] in reply.split("\n")[0]
            continue
        assert not is_correct({**row, "answer": str(int(row["answer"]) + 1)}, reply)
        known = {int(x) for x in re.findall(r"\d+", question(row))} | CONSTANTS
        lines = reply.split("\n")[:-1]
        result = None
        for line in lines:
            eqs = EQUATION.findall(line)
            assert eqs, f"{row['template']}: a step without arithmetic: {line!r}"
            for left, right in eqs:
                operands = [int(x) for x in re.findall(r"\d+", left)]
                assert set(operands) <= known, f"{row['template']}: {left} uses a number from nowhere"
                value = eval_exact(left)
                assert value == int(right) and value.denominator == 1 and value > 0, (row["template"], left)
                known.add(int(right))
                result = int(right)
        assert result == int(row["answer"]), row["template"]  # the last step's result is the answer


def eval_exact(expr):
    """An arithmetic line "a op b op c" in exact fractions, * and / before + and - (Python's order)."""
    tokens = expr.split()
    terms, sign, term = [], 1, Fraction(int(tokens[0]))
    for op, x in zip(tokens[1::2], tokens[2::2]):
        x = Fraction(int(x))
        if op in "*/":
            term = term * x if op == "*" else term / x
        else:
            terms.append(sign * term)
            sign, term = (1 if op == "+" else -1), x
    return sum(terms) + sign * term


def test_rows_are_what_prepare_reads(tmp_path):
    """build() writes JSONL rows that data/prepare.py tokenises with a chat template, every row kept,
    the loss exactly on the reply, its <|im_end|> and the newline after it (§2)."""
    small = generate({"train": 40, "val": 8, "test": 8}, seed=0)
    texts = [m["content"] for rows in small.values() for r in rows for m in r["messages"]]
    tok_dir = tmp_path / "tok"
    train_bpe(texts, 60).save(tok_dir)
    build(str(tmp_path / "out"), 0, {"train": 40, "val": 8, "test": 8}, tokenizer=str(tok_dir))
    tok = Tokenizer.from_dir(tok_dir)
    for split in ("train", "val"):
        rows = [json.loads(line) for line in open(tmp_path / "out" / f"{split}.jsonl")]
        assert rows == small[split]
        d = load_npz(str(tmp_path / "out" / f"{split}.npz"))
        assert len(d["offsets"]) - 1 == len(rows)
        for i, r in enumerate(rows):
            a, b = d["offsets"][i], d["offsets"][i + 1]
            ids, loss = d["ids"][a:b], d["loss"][a:b].astype(bool)
            assert tok.decode(ids[loss].tolist()) == r["messages"][1]["content"] + "<|im_end|>\n"
    assert json.load(open(tmp_path / "out" / "templates.json"))["gsm"]["test"] == \
        [t.__name__ for t in template_splits(0)["gsm"]["test"]]


NUMBER_CASES = [  # (reply, expected, right?)
    ("So 3 * 400 = 1200.\nThe answer is 1200.", 1200, True),
    ("The answer is 1,200.", 1200, True),
    ("The answer is $1200.", 1200, True),
    ("The answer is 1200.0.", 1200, True),
    ("The answer is $1,200.00.", "1200", True),
    ("the answer is: 1200 dollars.", 1200, True),
    ("**The answer is 1200.**", 1200, True),
    ("The answer is 1200. Hope this helps!", 1200, True),
    ("The answer is 5.\nWait, I misread. The answer is 1200.\n", 1200, True),  # the last one counts
    ("The answer is 1201.", 1200, False),
    ("The answer is 120.", 1200, False),
    ("The answer is 1200.5.", 1200, False),
    ("The answer is 1,20.", 120, False),  # not a thousands separator
    ("The answer is 1200 or 1300.", 1200, False),  # not one number
    ("The answer is twelve hundred.", 1200, False),
    ("So the total is 1200 dollars.", 1200, False),  # no answer line
    ("The answer is 1200.\nNo, the answer is 5.", 1200, False),
    ("The answer is 1200", 1200, False),  # cut before the period
    ("The answer is 12", 12, False),  # cut mid-number, even where the prefix is the expected value
    ("The answer is 1,2", 12, False),
    ("The answer is ", 1200, False),
]
EXACT_CASES = [
    ("The parcel left from Oslo.\nThe answer is Oslo.", "Oslo", True),
    ('The answer is "Oslo".', "Oslo", True),
    ("The answer is **Oslo**.", "Oslo", True),
    ("The answer is:  row 5  seat 12.", "row 5 seat 12", True),
    ("The answer is QX-4471.\n", "QX-4471", True),
    ("The answer is Bergen.", "Oslo", False),
    ("The answer is oslo.", "Oslo", False),  # the exact string, case included
    ("The answer is Oslo, Norway.", "Oslo", False),
    ("The answer is QX-4472.", "QX-4471", False),
    ("The answer is Osl", "Oslo", False),  # cut mid-answer
    ("The answer is QX-44", "QX-44", False),
    ("The answer is Oslo", "Oslo", False),  # cut before the period
]


@pytest.mark.parametrize("reply,expected,right", NUMBER_CASES)
def test_number_grader(reply, expected, right):
    assert grade_number(reply, expected) is right
    assert is_correct({"family": "gsm", "answer": str(expected)}, reply) is right


@pytest.mark.parametrize("reply,expected,right", EXACT_CASES)
def test_exact_grader(reply, expected, right):
    assert grade_exact(reply, expected) is right
    assert is_correct({"family": "extract", "answer": expected}, reply) is right
