"""A task set for a real instruct model, with checkable answers and splits by template (issue 54).

The paper's largest gains are on data with checkable answers (GSM8K; docs/spec.md §7). This
package generates such data offline, deterministic from a seed, in the chat JSONL that
data/prepare.py tokenises with a model's own chat template (§2: the loss on the assistant
turn). Three families, each a tuple of templates (a function rng -> question, worked steps,
answer):

  gsm      GSM8K-shaped word problems: two to four steps of arithmetic told in sentences, the
           solution in words and equations, one whole number (data/tasks/gsm.py)
  convert  unit conversions, the factor given: a number (data/tasks/convert.py)
  extract  one field of a short paragraph: an exact string (data/tasks/extract.py)

A problem is one user turn (the question, a blank line, the family's fixed INSTRUCTION) and
one assistant turn (the steps, one per line, then "The answer is X."); no system turn, so the
model's template adds its own default one, as it does for a prompt sent alone. Each row also
carries "id", "family", "template" and "answer" (data/prepare.py ignores them), and
grade.is_correct(row, reply) grades a reply (data/tasks/grade.py).

Splits are by TEMPLATE: per family a seeded shuffle of the templates gives HELD_OUT[family]
templates to test, as many to val, and the rest to train (`template_splits`), so a test
question's template, sentences and reasoning were never trained on; only the nouns and the
final line's form are shared (data/tasks/pools.py). Within a split problems are distinct by
question; the families share each split in the proportions SHARES, and each family's share
evenly over its templates. Everything is a pure function of (sizes, seed).

    python -m data.tasks --out out/tasks [--seed 0] [--tokenizer out/smollm2]   # + train/val.npz

What this package does not know: models and tokens (data/prepare.py), training, evaluation.
"""

import os
import random

from data.synthetic import shares
from data.tasks import convert, extract, gsm

FAMILIES = {"gsm": gsm.TEMPLATES, "convert": convert.TEMPLATES, "extract": extract.TEMPLATES}
SHARES = {"gsm": 2, "convert": 1, "extract": 1}  # each split's problems, by family
HELD_OUT = {"gsm": 4, "convert": 2, "extract": 2}  # templates in test, and as many in val, per family
SPLITS = ("train", "val", "test")
SIZES = {"train": 6000, "val": 300, "test": 400}  # the default: 200 gsm test problems
NUMBER_INSTRUCTION = 'Solve it step by step, then end with "The answer is" and the number.'
INSTRUCTION = {"gsm": NUMBER_INSTRUCTION, "convert": NUMBER_INSTRUCTION,
               "extract": 'Answer from the text, then end with "The answer is" and the exact value.'}


def template_splits(seed=0):
    """{family: {split: [template, ...]}}: per family, a shuffle seeded by (seed, family), test
    taking the first HELD_OUT[family] templates, val the next as many, train the rest."""
    out = {}
    for family, templates in FAMILIES.items():
        order = list(templates)
        random.Random(f"tasks:{seed}:{family}:templates").shuffle(order)
        k = HELD_OUT[family]
        out[family] = {"test": order[:k], "val": order[k:2 * k], "train": order[2 * k:]}
    return out


def make_problem(rng, family, template):
    """One problem of `template` -> its row (module docstring)."""
    question, steps, answer = template(rng)
    return {"family": family, "template": f"{family}/{template.__name__}", "answer": str(answer),
            "messages": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION[family]}"},
                         {"role": "assistant", "content": "\n".join(steps + [f"The answer is {answer}."])}]}


def draw(rng, make, n, seen, name):
    """n problems of make(rng) (one template's) whose questions are not in `seen` (which grows);
    ValueError naming the template when it has too few distinct questions."""
    out = []
    for _ in range(50 * n + 1000):
        if len(out) == n:
            return out
        p = make(rng)
        text = p["messages"][0]["content"]
        if text not in seen:
            seen.add(text)
            out.append(p)
    raise ValueError(f"{name}: fewer than {n} distinct problems")


def generate(sizes=None, seed=0):
    """{split: [row, ...]} with sizes[split] rows each (default SIZES), ids "split-00000" in a
    seeded order that interleaves the families."""
    sizes, by_template, out = sizes or SIZES, template_splits(seed), {}
    for split, n in sizes.items():
        rows = []
        for family, quota in zip(FAMILIES, shares(n, [SHARES[f] for f in FAMILIES])):
            templates, seen = by_template[family][split], set()
            for template, q in zip(templates, shares(quota, [1] * len(templates))):
                rows += draw(random.Random(f"tasks:{seed}:{split}:{template.__name__}"),
                             lambda r, f=family, t=template: make_problem(r, f, t), q, seen,
                             f"{family}/{template.__name__}")
        random.Random(f"tasks:{seed}:{split}:order").shuffle(rows)
        out[split] = [{"id": f"{split}-{i:05d}", **r} for i, r in enumerate(rows)]
    return out


def build(out_dir, seed=0, sizes=None, tokenizer=None, max_len=512):
    """Write SPLIT.jsonl for each split into out_dir and templates.json (the split of the
    templates, per family); with a tokenizer directory also train.npz and val.npz
    (data/prepare.py: what train.py reads). -> the splits."""
    from data.synthetic import write_jsonl
    from util.atomic import write_json

    splits = generate(sizes, seed)
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in splits.items():
        write_jsonl(rows, os.path.join(out_dir, f"{name}.jsonl"))
    write_json(os.path.join(out_dir, "templates.json"),
               {"seed": seed, **{f: {s: [t.__name__ for t in ts] for s, ts in by.items()}
                                 for f, by in template_splits(seed).items()}})
    if tokenizer:
        from data.prepare import prepare, save_npz, summary
        from tokenizer import Tokenizer

        tok = Tokenizer.from_dir(tokenizer)
        for name in ("train", "val"):
            arrays, stats = prepare(splits[name], tok, max_len=max_len)
            print(summary(stats, name))
            save_npz(arrays, os.path.join(out_dir, f"{name}.npz"))
    return splits
