"""Task set v2 (issue 61): more templates, split by story frame, with arithmetic a 135M model can
learn; the same rows as the task set of issue 54 (data/tasks/), so a protocol can swap it in.

Issue 61 compares MARS with AR SFT on SmolLM2-135M. The v1 set has 8 test templates (wide
intervals) and arithmetic beyond the model (AR SFT writes "29 * 4 = 108"; 12 % on the GSM-shaped
problems). Here a template is a pair (frame, chain): a FRAME is a story, a pair of units or a
kind of record, each told in two wordings; a CHAIN is what is done with it. Three families:

  gsm      18 story frames x 12 chains of one to three of + - * / (data/tasks/v2/frames.py)
  convert  14 unit frames x 5 conversion shapes (data/tasks/v2/units.py)
  extract  12 record frames x 3 fields asked (data/tasks/v2/records.py)

Numbers stay within the times table and sums under about 100 (frames.py says why and how).

Splits are by FRAME: per family a seeded shuffle of the frames gives HELD_OUT[family] = (test,
val) frames to test and val and the rest to train, every template of a frame in the frame's
split (`template_splits`), so a test story, unit pair or record was never trained on; the
chains, the solution lines and the nouns of data/tasks/pools.py are shared. Test holds 10 frames
and 72 templates (gsm 4 and 48, convert 3 and 15, extract 3 and 9), val 6 and 40, train 28 and
210; the seed chooses which. Row: "id"
("split-00000"), "family", "frame" ("gsm2/<frame>"), "template" ("gsm2/<frame>/<chain>"),
"answer", and "messages": the user turn (question, blank line, the family's INSTRUCTION, as in
v1) and the assistant turn (the steps, one per line, then "The answer is X."). Within a split
questions are distinct; the families share each split in the proportions SHARES, each family's
share evenly over its templates. Everything is a pure function of (sizes, seed).

    python -m data.tasks.v2 --out out/tasks2 [--seed 0] [--tokenizer out/smollm2]   # + train/val.npz

Graders: data/tasks/v2/grade.py. What this package does not know: models and tokens
(data/prepare.py), training, evaluation.
"""

import os
import random

from data.synthetic import shares
from data.tasks import INSTRUCTION, draw
from data.tasks.v2 import frames, records, units

MODULES = {"gsm": frames, "convert": units, "extract": records}
PREFIX = {"gsm": "gsm2", "convert": "convert2", "extract": "extract2"}
SHARES = {"gsm": 2, "convert": 1, "extract": 1}  # each split's problems, by family
HELD_OUT = {"gsm": (4, 2), "convert": (3, 2), "extract": (3, 2)}  # frames in (test, val), per family
SPLITS = ("train", "val", "test")
SIZES = {"train": 8000, "val": 400, "test": 800}  # the default: 400 gsm test problems, 48 templates


def chains(family, frame):
    """The chains of a frame: every chain of the family (an extraction frame: its fields)."""
    if family == "extract":
        return tuple(records.FRAMES[frame].asks)
    return tuple(MODULES[family].CHAINS)


def template_splits(seed=0):
    """{family: {split: [(frame, chain), ...]}}: per family, the frames in an order shuffled by
    (seed, family), test taking the first HELD_OUT[family][0] frames, val the next
    HELD_OUT[family][1], train the rest; each frame with all its chains."""
    out = {}
    for family, module in MODULES.items():
        order = list(module.FRAMES)
        random.Random(f"tasks2:{seed}:{family}:frames").shuffle(order)
        t, v = HELD_OUT[family]
        parts = {"test": order[:t], "val": order[t:t + v], "train": order[t + v:]}
        out[family] = {s: [(f, c) for f in fs for c in chains(family, f)] for s, fs in parts.items()}
    return out


def make_problem(rng, family, frame, chain):
    """One problem of the template (frame, chain) -> its row, without the id (module docstring)."""
    question, steps, answer = MODULES[family].make(rng, frame, chain)
    return {"family": family, "frame": f"{PREFIX[family]}/{frame}",
            "template": f"{PREFIX[family]}/{frame}/{chain}", "answer": str(answer),
            "messages": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION[family]}"},
                         {"role": "assistant", "content": "\n".join(steps + [f"The answer is {answer}."])}]}


def generate(sizes=None, seed=0):
    """{split: [row, ...]} with sizes[split] rows each (default SIZES), ids "split-00000" in a
    seeded order that interleaves the families."""
    sizes, by_template, out = sizes or SIZES, template_splits(seed), {}
    for split, n in sizes.items():
        rows = []
        for family, quota in zip(MODULES, shares(n, [SHARES[f] for f in MODULES])):
            templates, seen = by_template[family][split], set()
            for (frame, chain), q in zip(templates, shares(quota, [1] * len(templates))):
                rng = random.Random(f"tasks2:{seed}:{split}:{family}:{frame}:{chain}")
                rows += draw(rng, lambda r, f=family, fr=frame, c=chain: make_problem(r, f, fr, c), q, seen,
                             f"{PREFIX[family]}/{frame}/{chain}")
        random.Random(f"tasks2:{seed}:{split}:order").shuffle(rows)
        out[split] = [{"id": f"{split}-{i:05d}", **r} for i, r in enumerate(rows)]
    return out


def build(out_dir, seed=0, sizes=None, tokenizer=None, max_len=512):
    """Write SPLIT.jsonl for each split into out_dir and templates.json (per family and split,
    the frames and the templates); with a tokenizer directory also train.npz and val.npz
    (data/prepare.py: what train.py reads). -> the splits."""
    from data.synthetic import write_jsonl
    from util.atomic import write_json

    splits = generate(sizes, seed)
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in splits.items():
        write_jsonl(rows, os.path.join(out_dir, f"{name}.jsonl"))
    layout = {f: {s: {"frames": list(dict.fromkeys(fr for fr, _ in ts)),
                      "templates": [f"{PREFIX[f]}/{fr}/{c}" for fr, c in ts]} for s, ts in by.items()}
              for f, by in template_splits(seed).items()}
    write_json(os.path.join(out_dir, "templates.json"), {"seed": seed, **layout})
    if tokenizer:
        from data.prepare import prepare, save_npz, summary
        from tokenizer import Tokenizer

        tok = Tokenizer.from_dir(tokenizer)
        for name in ("train", "val"):
            arrays, stats = prepare(splits[name], tok, max_len=max_len)
            print(summary(stats, name))
            save_npz(arrays, os.path.join(out_dir, f"{name}.npz"))
    return splits
