"""The real-model prompts' split holds (issue 33; data/prompts.py): near-duplicates are found
exactly (against an all-pairs brute force), no cluster and no near-duplicate pair crosses
two splits, the human paragraphs come from clusters with no prompt of any kind, the test
set is spread over >= 20 clusters, and everything is a pure function of (seed, sizes)."""

import itertools
import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from data import prompts as P


def jaccard(a, b):
    a, b = P.content_words(a), P.content_words(b)
    return len(a & b) / len(a | b) if a | b else 0.0


@pytest.fixture(scope="module")
def split():
    return P.candidates(0)


def test_near_duplicates_equal_an_all_pairs_brute_force():
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(12)]
    texts = [" ".join(rng.sample(vocab, rng.randint(0, 9))) for _ in range(300)]
    texts += ["a b c d e", "a b c d f", "a b c d e `name`", "a b c d"]  # J = 4/6, 1 (names dropped), 4/5
    for t in (0.8, 0.5, 1.0):
        brute = [(i, j) for i, j in itertools.combinations(range(len(texts)), 2)
                 if P.content_words(texts[i]) and jaccard(texts[i], texts[j]) >= t - 1e-12]
        assert P.near_duplicates(texts, t) == brute
    n = len(texts)
    pairs = set(P.near_duplicates(texts, 0.8))
    assert (n - 4, n - 2) in pairs and (n - 4, n - 1) in pairs and (n - 4, n - 3) not in pairs


def test_no_cluster_and_no_near_duplicate_pair_crosses_splits(split):
    where = defaultdict(set)
    for s, items in split.items():
        for it in items:
            where[it["group"]].add(s)
    assert all(len(v) == 1 for v in where.values()), {g: v for g, v in where.items() if len(v) > 1}
    # every near-duplicate pair of contents, by brute force over all pairs, lies in one split
    items = [it for it in P.sources(0) if P.content_words(it["content"])]
    split_of_key = {it["key"]: s for s, its in split.items() for it in its}
    by_words = [(P.content_words(it["content"]), it["key"]) for it in items]
    crossing = 0
    for (a, ka), (b, kb) in itertools.combinations(by_words, 2):
        if len(a & b) >= 0.8 * len(a | b) and ka in split_of_key and kb in split_of_key:
            crossing += split_of_key[ka] != split_of_key[kb]
    assert crossing == 0


def test_the_shared_exception_docstring_stays_in_one_split(split):
    doc = "Common base class for all non-exit exceptions."
    keys = {it["key"] for it in P.sources(0) if it["content"] == doc}
    assert len(keys) >= 5  # many modules' exceptions carry it
    splits = {s for s, its in split.items() for it in its if it["key"] in keys}
    assert len(splits) == 1


def test_human_paragraphs_come_from_clusters_with_no_prompt(split):
    prompt_groups = {it["group"] for s in ("train", "val", "test") for it in split[s]}
    assert split["human"] and not {h["group"] for h in split["human"]} & prompt_groups
    prompt_text = " ".join(it["text"] for s in ("train", "val", "test") for it in split[s])
    assert all(h["text"] not in prompt_text for h in split["human"])
    # and the clusters of every kind of source (api, facts, pairs too) are split the same way
    kinds = Counter(it["key"].split(":")[0] for s in ("val", "test") for it in split[s])
    assert len(kinds) >= 3


def test_build_is_deterministic_spread_and_sized():
    a = P.build(0, 300, 48, 64, 40, 32)
    assert a == P.build(0, 300, 48, 64, 40, 32) and a != P.build(1, 300, 48, 64, 40, 32)
    assert {s: len(v) for s, v in a.items()} == {"train": 300, "val": 48, "test": 64, "human": 40, "chat": 32}
    assert len({it["group"] for it in a["test"]}) >= 20
    # round-robin: the first test prompts are one per cluster, as many as there are clusters
    clusters = len({it["group"] for it in P.candidates(0)["test"]})
    first = [it["group"] for it in a["test"][:min(clusters, 64)]]
    assert len(set(first)) == len(first)
    assert len({it["kind"] for it in a["train"]}) >= 6
    with pytest.raises(ValueError, match="human"):
        P.build(0, 10, 1, 1, 10**6)


def test_preferred_train_prompts_come_first():
    pool = [it["text"] for it in P.candidates(0)["train"]]
    prefer = set(random.Random(1).sample(pool, 50))
    b = P.build(0, 60, 4, 4, 4, prefer=prefer)
    assert {it["text"] for it in b["train"][:50]} == prefer
    assert all(it["text"] not in prefer for it in b["train"][50:])


def test_prompts_do_not_depend_on_what_was_imported():
    """torch (imported by every test and by the pipeline) replaces inspect.getfile: a listing of
    the stdlib's functions must not change with it, or one item shifts every later template."""
    import torch  # noqa: F401

    here = P.build(0, 300, 48, 64, 40, 32)
    code = ("import json, sys; from data import prompts as P; assert 'torch' not in sys.modules; "
            "print(json.dumps(P.build(0, 300, 48, 64, 40, 32)))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert json.loads(out.stdout) == here
