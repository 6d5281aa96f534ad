"""The embedded default dataset: synthetic instructions in chat form, checkable answers.

The paper fine-tunes Qwen2.5-Instruct on real chat data (MARS_SPEC §2, §7); that
needs a GPU and a download. The default instead trains a tiny Qwen2 from scratch on
a generated dataset, on a CPU, so that every claim of the method can be measured.
What matters for MARS is the *mix*: each reply is mostly very predictable text
(fixed phrasing, copied words, EOS padding) around a few hard tokens (a sum, a
looked-up value), exactly where multi-token acceptance should be high and low.

Four task families, each answer checkable by string match on "The answer is X.":
  arith   add 2-4 one-digit numbers, with a worked step per addition
  list    reverse / take the maximum of a short list of numbers
  replace copy a word sequence, substituting one word for another
  lookup  read a value out of a small table given in the prompt

Splits are deterministic from a seed. A problem's split is decided by a hash of its
prompt, so the same question can never sit in both train and test.
"""

import hashlib
import json
import os
import random
import re

WORDS = ["cat", "dog", "fox", "owl", "bee", "cow", "hen", "pig", "rat", "yak", "ant", "bat",
         "red", "blue", "green", "gold", "pink", "gray", "sun", "moon", "star", "tree", "rock",
         "lake", "rain", "snow", "wind", "fire", "leaf", "seed"]
ITEMS = ["apple", "pear", "plum", "fig", "lime", "kiwi", "melon", "grape", "peach", "mango",
         "lemon", "berry", "olive", "date", "cherry", "guava"]
FAMILIES = ("arith", "list", "replace", "lookup")
ANSWER_RE = re.compile(r"The answer is (.+?)\.\s*$")


def _arith(rng):
    terms = [rng.randint(1, 9) for _ in range(rng.randint(2, 4))]
    prompt = f"Compute {' + '.join(map(str, terms))}."
    lines, total = ["Let's add step by step."], terms[0]
    for t in terms[1:]:
        lines.append(f"{total} + {t} = {total + t}.")
        total += t
    return prompt, lines, str(total)


def _list(rng):
    xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    shown = ", ".join(map(str, xs))
    if rng.random() < 0.5:
        ans = ", ".join(map(str, reversed(xs)))
        return (f"Reverse the list [{shown}].",
                [f"The list has {len(xs)} items.", f"Read from the end it is [{ans}]."], f"[{ans}]")
    ans = str(max(xs))
    return (f"What is the largest number in [{shown}]?",
            [f"The list has {len(xs)} items.", f"The largest of them is {ans}."], ans)


def _replace(rng):
    old, new = rng.sample(WORDS, 2)
    others = [w for w in WORDS if w not in (old, new)]
    seq = [rng.choice(others) for _ in range(rng.randint(3, 5))]
    for i in rng.sample(range(len(seq)), rng.randint(1, 2)):
        seq[i] = old
    out = " ".join(new if w == old else w for w in seq)
    return (f"In the words '{' '.join(seq)}', replace {old} with {new}.",
            [f"We replace each {old} with {new}, word by word.", f"This gives '{out}'."], out)


def _lookup(rng):
    names = rng.sample(ITEMS, rng.randint(3, 5))
    prices = {n: rng.randint(1, 99) for n in names}
    ask = rng.choice(names)
    table = ", ".join(f"{n} {prices[n]}" for n in names)
    return (f"Prices: {table}. What is the price of {ask}?",
            [f"We look for {ask} in the table.", f"The table says {ask} costs {prices[ask]}."],
            str(prices[ask]))


MAKERS = {"arith": _arith, "list": _list, "replace": _replace, "lookup": _lookup}


def make_problem(rng, family):
    prompt, steps, answer = MAKERS[family](rng)
    reply = "\n".join(steps + [f"The answer is {answer}."])
    return {"family": family, "answer": answer,
            "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}


def split_of(prompt, fractions=(("test", 0.05), ("val", 0.05))):
    """Hash-based split: a prompt always lands in the same split, whatever the seed."""
    h = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 16**8
    for name, frac in fractions:
        if h < frac:
            return name
        h -= frac
    return "train"


def generate(sizes, seed=0):
    """{split: [problem, ...]} with sizes[split] problems each, the four families in
    equal shares. Test and val prompts are distinct; train may repeat a prompt (small
    problem spaces) but never holds one from test or val (split_of)."""
    rng = random.Random(seed)
    out = {s: [] for s in sizes}
    for k, family in enumerate(FAMILIES):
        quota = {s: n // len(FAMILIES) + (k < n % len(FAMILIES)) for s, n in sizes.items()}
        got = {s: [] for s in sizes}
        seen = set()
        while any(len(got[s]) < quota[s] for s in sizes):
            p = make_problem(rng, family)
            prompt = p["messages"][0]["content"]
            s = split_of(prompt)
            if len(got[s]) >= quota[s] or (s != "train" and prompt in seen):
                continue
            seen.add(prompt)
            got[s].append(p)
        for s in sizes:
            out[s] += got[s]
    for s in sizes:  # interleave families so any prefix of a split is balanced
        rng.shuffle(out[s])
    return out


def extract_answer(text):
    """The X of the last line 'The answer is X.' (None when absent)."""
    m = ANSWER_RE.search(text.strip().split("\n")[-1]) if text.strip() else None
    return m.group(1) if m else None


def is_correct(problem, completion_text):
    return extract_answer(completion_text) == problem["answer"]


def write_jsonl(rows, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_default(out_dir, seed=0, sizes=None, n_merges=400):
    """Everything `python train.py` needs: JSONL splits, the default tokenizer (BPE
    trained on the train split, Qwen2's regex so digits stay single tokens), and the
    tokenised train/val .npz files."""
    from data.prepare import prepare, save_npz
    from tokenizer import Tokenizer, render_chat, train_bpe

    sizes = sizes or {"train": 40000, "val": 400, "test": 400}
    os.makedirs(out_dir, exist_ok=True)
    splits = generate(sizes, seed)
    for name, rows in splits.items():
        write_jsonl(rows, os.path.join(out_dir, f"{name}.jsonl"))
    tok_dir = os.path.join(out_dir, "tokenizer")
    sample = splits["train"][:5000]
    texts = [render_chat(p["messages"]) for p in sample]
    train_bpe(texts, n_merges).save(tok_dir)
    tok = Tokenizer.from_dir(tok_dir)
    for name in ("train", "val"):
        arrays, stats = prepare(splits[name], tok, max_len=512)
        save_npz(arrays, os.path.join(out_dir, f"{name}.npz"))
    return tok_dir


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser(description="generate the embedded default dataset")
    ap.add_argument("--out", default="data/default")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build_default(a.out, a.seed)
    print(f"wrote {a.out}")
