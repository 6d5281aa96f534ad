"""The embedded default dataset (data/synthetic.py): deterministic, disjoint splits in
the stated shares, answers that are right (recomputed here from the prompt text,
independently of the generator), a hard split longer than anything trained on, and rows
whose reply phase against the blocks of B takes every value."""

import re
from collections import defaultdict

import pytest

from data.synthetic import (
    FAMILIES,
    HARD_SIZE,
    build_default,
    extract_answer,
    generate,
    generate_hard,
    is_correct,
    read_jsonl,
)
from tokenizer import Tokenizer

SIZES = {"train": 2000, "val": 100, "test": 100}


def solve(prompt):
    """The answer, worked out from the prompt text alone."""
    if m := re.fullmatch(r"Compute ([\d + ]+)\.", prompt):
        return str(sum(int(t) for t in m.group(1).split(" + ")))
    if m := re.fullmatch(r"What is the (largest|smallest) number in \[([\d, ]+)\]\?", prompt):
        xs = [int(x) for x in m.group(2).split(", ")]
        return str(max(xs) if m.group(1) == "largest" else min(xs))
    if m := re.fullmatch(r"Repeat the words: ([a-z ]+)\.", prompt):
        return m.group(1)
    if m := re.fullmatch(r"Sort the digits (\d+)\.", prompt):
        return "".join(sorted(m.group(1)))
    raise AssertionError(f"unknown prompt {prompt!r}")


@pytest.fixture(scope="module")
def splits():
    return generate(SIZES, seed=3)


def test_same_seed_same_data_other_seed_other_data(splits):
    assert generate(SIZES, seed=3) == splits
    assert generate(SIZES, seed=4)["train"] != splits["train"]


def test_sizes_families_and_disjoint_splits(splits):
    for name, n in SIZES.items():
        rows = splits[name]
        assert len(rows) == n
        per_family = {f: sum(r["family"] == f for r in rows) for f in FAMILIES}
        if name == "train":  # arith and words at twice the share of list and sort (2:1:2:1)
            want = {"arith": n / 3, "list": n / 6, "words": n / 3, "sort": n / 6}
            assert all(abs(per_family[f] - want[f]) < 1 for f in FAMILIES), per_family
        else:  # held-out splits: equal shares, the overall accuracy the mean of the families
            assert max(per_family.values()) - min(per_family.values()) <= 1, (name, per_family)
    prompts = {name: {r["messages"][1]["content"] for r in rows} for name, rows in splits.items()}
    assert not prompts["test"] & prompts["train"]
    assert not prompts["val"] & prompts["train"]
    assert not prompts["test"] & prompts["val"]
    assert len(prompts["test"]) == SIZES["test"]  # held-out prompts are distinct


def item_count(prompt):
    """Terms, list items, words or digits a prompt asks about."""
    body = re.sub(r"^(Compute|What is the \w+ number in|Repeat the words:|Sort the digits) ", "", prompt)
    return len(re.findall(r"\d|[a-z]+", body))


def test_hard_split_is_distinct_balanced_and_longer_than_training(splits):
    hard = generate_hard(HARD_SIZE, seed=3)
    assert hard == generate_hard(HARD_SIZE, seed=3)
    prompts = [r["messages"][1]["content"] for r in hard]
    assert len(set(prompts)) == len(hard) == HARD_SIZE
    assert {f: sum(r["family"] == f for r in hard) for f in FAMILIES} == {f: HARD_SIZE // 4 for f in FAMILIES}
    counts = lambda rows, f: [item_count(r["messages"][1]["content"]) for r in rows if r["family"] == f]  # noqa: E731
    for f in FAMILIES:
        assert min(counts(hard, f)) > max(counts(splits["train"], f)), f


def test_every_answer_is_right_and_checkable(splits):
    for rows in [*splits.values(), generate_hard(HARD_SIZE, seed=3)]:
        for r in rows:
            system, user, assistant = r["messages"]
            assert (system["role"], user["role"], assistant["role"]) == ("system", "user", "assistant")
            assert r["answer"] == solve(user["content"])
            assert extract_answer(assistant["content"]) == r["answer"]
            assert is_correct(r, assistant["content"])
            assert not is_correct(r, assistant["content"].replace(f"is {r['answer']}.", "is 0 0."))


def test_reply_phase_takes_every_value_within_each_task_shape(tmp_path):
    """Blocks are anchored at index 0 (docs/spec.md §2), so a reply token's lookahead in
    training is fixed by its position mod B. Rows of one task shape (family and item
    count: the reply text then sits at fixed offsets from its start) must still start
    their reply at every residue mod 4, or a token is only ever trained at one lookahead."""
    build_default(str(tmp_path), seed=1, sizes=SIZES)
    tok = Tokenizer.from_dir(str(tmp_path / "tokenizer"))
    phases = defaultdict(list)
    for r in read_jsonl(str(tmp_path / "train.jsonl")):
        n_prompt = len(tok.encode_chat(r["messages"][:-1], add_generation_prompt=True))
        shape = (r["family"], len(r["messages"][1]["content"].split()))
        phases[shape].append(n_prompt % 4)
    common = [shape for shape, seen in phases.items() if len(seen) >= 40]
    assert {family for family, _ in common} == set(FAMILIES)
    for shape in common:
        assert set(phases[shape]) == {0, 1, 2, 3}, (shape, sorted(set(phases[shape])))
