"""The embedded default dataset: synthetic instructions in chat form, checkable answers.

The paper fine-tunes Qwen2.5-Instruct on real chat data (docs/spec.md §2, §7); that
needs a GPU and a download. The default instead trains a tiny Qwen2 from scratch on
a generated dataset, on a CPU, so that every claim of the method can be measured.
What matters for MARS is the *mix*: each reply is mostly very predictable text
(fixed phrasing, copied words, EOS padding) around a few hard tokens (a sum, a
sorted list), exactly where multi-token acceptance should be high and low.

Four task families, each answer checkable by string match on "The answer is X.":
  arith   add 2-4 one-digit numbers, with a worked step per addition
  list    the largest / smallest number of a short list
  words   repeat a sequence of distinct words (retrieval: each word is copied from the prompt)
  sort    sort 3-5 distinct digits (several hard tokens in one line)

"sort" replaced "lookup" (a word read out of a key/value table in the prompt): the 0.85M
default model stayed at chance on it in every form tried, alone for 6,000 steps included
(results/SPEED.md, "Why the main job's bar is luck"). The train split weights the
families 2:1:2:1 (TRAIN_SHARES): words and arith are the ones that lag at some seeds with
equal shares. Val and test keep equal shares, so the overall accuracy is the mean of the
four families. The "hard" split (HARDER, harder_problem) holds longer problems of each
family than training ever shows, scored on its own, for comparisons that would otherwise
all sit at the ceiling. Measured at seed 0 it is near the floor instead (τ = 1: arith 0,
list 100, words 2, sort 2 %; results/SEEDS.md): the model does not generalise to longer
problems, except for list.

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
FAMILIES = ("arith", "list", "words", "sort")
TRAIN_SHARES = {"arith": 2, "list": 1, "words": 2, "sort": 1}
# Short system turns instead of Qwen2.5's default one (18 tokens on every row): on a
# CPU every token of a row costs training time. Four of them, 4 to 7 tokens long with
# the default tokenizer, drawn at random per row: they set the row's *phase*, the
# offset of its reply against the blocks of B (anchored at index 0, docs/spec.md §2).
# Templated replies put every answer token at a position fixed by the task's shape,
# so with one system turn each answer token would be trained at a single lookahead
# (§3) and asked at another at inference, where a step starts anywhere (§5); the
# model's confident guesses there were the whole loss of accuracy at τ < 1. On real
# chat data lengths vary by themselves.
SYSTEMS = ("Solve the task.", "Solve the next task.", "Please solve the next task.",
           "Please solve the next task now.")
ANSWER_RE = re.compile(r"The answer is (.+?)\.\s*$")


def _arith(rng, n_terms=(2, 4)):
    terms = [rng.randint(1, 9) for _ in range(rng.randint(*n_terms))]
    prompt = f"Compute {' + '.join(map(str, terms))}."
    lines, total = ["Let's add step by step."], terms[0]
    for t in terms[1:]:
        lines.append(f"{total} + {t} = {total + t}.")
        total += t
    return prompt, lines, str(total)


def _list(rng, n_items=(3, 7)):
    xs = [rng.randint(0, 9) for _ in range(rng.randint(*n_items))]
    shown = ", ".join(map(str, xs))
    word, ans = ("largest", max(xs)) if rng.random() < 0.5 else ("smallest", min(xs))
    return (f"What is the {word} number in [{shown}]?",
            [f"The list has {len(xs)} items.", f"The {word} of them is {ans}."], str(ans))


def _words(rng, n_words=(3, 6)):
    seq = rng.sample(WORDS, rng.randint(*n_words))
    ans = " ".join(seq)
    return (f"Repeat the words: {ans}.",
            [f"There are {len(seq)} words.", f"In the same order they are: {ans}."], ans)


def _sort(rng, n_digits=(3, 5)):
    # Distinct digits: each output digit is the smallest one above the last written, so the
    # sorted line is a chain of min-like steps (the list family's circuit) with no ties to
    # count. The reply first copies the digits from the prompt: a second copying task beside
    # "words" (with only "words" to copy from, the 0.85M model had not learned to copy at
    # all after 3,000 of 4,000 AR steps at seed 0). Written without spaces (one token a
    # digit, not two): a row about as long as the others.
    xs = "".join(map(str, rng.sample(range(10), rng.randint(*n_digits))))
    ans = "".join(sorted(xs))
    return f"Sort the digits {xs}.", [f"The digits are {xs}.", f"In order: {ans}."], ans


MAKERS = {"arith": _arith, "list": _list, "words": _words, "sort": _sort}
# The "hard" split: each family past what training shows (more terms, items, words,
# digits), so an answer there is not a memorised shape.
HARDER = {"arith": {"n_terms": (5, 6)}, "list": {"n_items": (8, 9)}, "words": {"n_words": (7, 8)},
          "sort": {"n_digits": (6, 7)}}
HARD_SIZE = 200


def _chat(rng, family, prompt, steps, answer):
    reply = "\n".join(steps + [f"The answer is {answer}."])
    return {"family": family, "answer": answer,
            "messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                         {"role": "user", "content": prompt},
                         {"role": "assistant", "content": reply}]}


def make_problem(rng, family):
    return _chat(rng, family, *MAKERS[family](rng))


def harder_problem(rng, family):
    return _chat(rng, family, *MAKERS[family](rng, **HARDER[family]))


def split_of(prompt, fractions=(("test", 0.05), ("val", 0.05))):
    """Hash-based split: a prompt always lands in the same split, whatever the seed."""
    h = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 16**8
    for name, frac in fractions:
        if h < frac:
            return name
        h -= frac
    return "train"


def shares(n, weights):
    """n split in proportion to weights: floors, the remainder one each to the first."""
    total = sum(weights)
    out = [n * w // total for w in weights]
    return [q + (k < n - sum(out)) for k, q in enumerate(out)]


def generate(sizes, seed=0):
    """{split: [problem, ...]} with sizes[split] problems each: the train split in the
    proportions of TRAIN_SHARES, the others in equal shares. Test and val prompts are
    distinct; train may repeat a prompt (small problem spaces) but never holds one from
    test or val (split_of)."""
    rng = random.Random(seed)
    out = {s: [] for s in sizes}
    quotas = {s: shares(n, [TRAIN_SHARES[f] if s == "train" else 1 for f in FAMILIES])
              for s, n in sizes.items()}
    for k, family in enumerate(FAMILIES):
        quota = {s: q[k] for s, q in quotas.items()}
        got = {s: [] for s in sizes}
        seen = set()
        for _ in range(100 * sum(quota.values()) + 100000):
            if all(len(got[s]) >= quota[s] for s in sizes):
                break
            p = make_problem(rng, family)
            prompt = p["messages"][1]["content"]
            s = split_of(prompt)
            if len(got[s]) >= quota[s] or (s != "train" and prompt in seen):
                continue
            seen.add(prompt)
            got[s].append(p)
        else:
            raise ValueError(f"{family}: too few distinct prompts for the split sizes {sizes}")
        for s in sizes:
            out[s] += got[s]
    for s in sizes:  # interleave families so any prefix of a split is balanced
        rng.shuffle(out[s])
    return out


def generate_hard(n, seed=0):
    """The "hard" split: n distinct problems, equal shares, each longer than any of
    generate's (HARDER), so none can be a training prompt."""
    rng = random.Random(f"hard:{seed}")
    out = []
    for q, family in zip(shares(n, [1] * len(FAMILIES)), FAMILIES):
        got = {}
        while len(got) < q:
            p = harder_problem(rng, family)
            got.setdefault(p["messages"][1]["content"], p)
        out += got.values()
    rng.shuffle(out)
    return out


def extract_answer(text):
    """The X of the last line 'The answer is X.' (None when absent)."""
    m = ANSWER_RE.search(text.strip().split("\n")[-1]) if text.strip() else None
    return m.group(1) if m else None


def is_correct(problem, completion_text):
    return extract_answer(completion_text) == problem["answer"]


def write_jsonl(rows, path):
    from util.atomic import write_text  # here: `python data/synthetic.py` puts the repo on the path first

    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path):
    """The records of a .jsonl file, blank lines skipped; a line that is not JSON (or not
    UTF-8) is a BadFileError naming the file and the line."""
    from util.files import BadFileError  # here: `python data/synthetic.py` puts the repo on the path late

    rows = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                rows += [json.loads(line)] if line.strip() else []
            except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
                raise BadFileError(path, f"line {n} is not valid JSON ({e})") from None
    return rows


# The default system turn of the data's chat template (a prompt sent without one, as
# `generate.py --prompt` sends it, gets this one): one the model saw in training, not
# Qwen2.5's "You are Qwen, ...", which the data never contains.
DEFAULT_SYSTEM = SYSTEMS[0]


def build_default(out_dir, seed=0, sizes=None, n_merges=400):
    """Everything `python train.py` needs: JSONL splits (and the hard split, for
    evaluate.py only), the default tokenizer (BPE trained on the train split, Qwen2's
    regex so digits stay single tokens, a ChatML template whose default system turn is
    DEFAULT_SYSTEM), and the tokenised train/val .npz files."""
    from chat_template import chatml_template, render_chat
    from data.bpe import train_bpe
    from data.prepare import prepare, save_npz
    from tokenizer import Tokenizer

    sizes = sizes or {"train": 40000, "val": 400, "test": 400}
    os.makedirs(out_dir, exist_ok=True)
    splits = generate(sizes, seed)
    splits["hard"] = generate_hard(HARD_SIZE, seed)
    for name, rows in splits.items():
        write_jsonl(rows, os.path.join(out_dir, f"{name}.jsonl"))
    tok_dir = os.path.join(out_dir, "tokenizer")
    sample = splits["train"][:5000]
    texts = [render_chat(p["messages"]) for p in sample]
    train_bpe(texts, n_merges, chat_template=chatml_template(DEFAULT_SYSTEM)).save(tok_dir)
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
