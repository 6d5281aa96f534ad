"""python -m data.tasks.v2: write the task set v2 (data/tasks/v2/__init__.py) as JSONL, and optionally
the token arrays train.py reads."""

import argparse
from collections import Counter

from data.tasks.v2 import SIZES, build

ap = argparse.ArgumentParser(prog="python -m data.tasks.v2", description=__doc__.split("\n")[0])
ap.add_argument("--out", default="out/tasks2")
ap.add_argument("--seed", type=int, default=0)
for split, n in SIZES.items():
    ap.add_argument(f"--{split}", type=int, default=n, help=f"problems in {split} (default {n})")
ap.add_argument("--tokenizer", help="a tokenizer directory: also write train.npz and val.npz "
                "(data/prepare.py)")
ap.add_argument("--max-len", type=int, default=512, help="skip rows longer than this many tokens")
a = ap.parse_args()
splits = build(a.out, a.seed, {s: getattr(a, s) for s in SIZES}, a.tokenizer, a.max_len)
for name, rows in splits.items():
    by_family = Counter(r["family"] for r in rows)
    templates = len({r["template"] for r in rows})
    print(f"{name}: {len(rows)} problems from {templates} templates ({dict(by_family)})")
print(f"wrote {a.out}")
