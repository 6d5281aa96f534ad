"""The embedded default dataset (data/synthetic.py): deterministic, disjoint splits,
answers that are right (recomputed here from the prompt text, independently of the
generator), and rows whose reply phase against the blocks of B takes every value."""

import re
from collections import defaultdict

import pytest

from data.synthetic import FAMILIES, build_default, extract_answer, generate, is_correct, read_jsonl
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
    if m := re.fullmatch(r"Look up ([a-z]+) in the table: ([a-z, ]+)\.", prompt):
        table = dict(pair.split(" ") for pair in m.group(2).split(", "))
        return table[m.group(1)]
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
        assert max(per_family.values()) - min(per_family.values()) <= 1, (name, per_family)
    prompts = {name: {r["messages"][1]["content"] for r in rows} for name, rows in splits.items()}
    assert not prompts["test"] & prompts["train"]
    assert not prompts["val"] & prompts["train"]
    assert not prompts["test"] & prompts["val"]
    assert len(prompts["test"]) == SIZES["test"]  # held-out prompts are distinct


def test_every_answer_is_right_and_checkable(splits):
    for rows in splits.values():
        for r in rows:
            system, user, assistant = r["messages"]
            assert (system["role"], user["role"], assistant["role"]) == ("system", "user", "assistant")
            assert r["answer"] == solve(user["content"])
            assert extract_answer(assistant["content"]) == r["answer"]
            assert is_correct(r, assistant["content"])
            assert not is_correct(r, assistant["content"].replace(f"is {r['answer']}.", "is 0 0."))


def test_reply_phase_takes_every_value_within_each_task_shape(tmp_path):
    """Blocks are anchored at index 0 (MARS_SPEC §2), so a reply token's lookahead in
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
