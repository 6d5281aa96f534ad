"""The command line of a task set (python -m data.tasks, python -m data.tasks.v2): write its splits as
JSONL and, with a tokenizer, the token arrays train.py reads; print each split's size."""

import argparse
from collections import Counter


def main(prog, doc, sizes, build, out):
    """Parse the arguments of `prog` (its splits' default sizes `sizes`), run build(out, seed, sizes,
    tokenizer, max_len) and print what it wrote."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    ap.add_argument("--out", default=out)
    ap.add_argument("--seed", type=int, default=0)
    for split, n in sizes.items():
        ap.add_argument(f"--{split}", type=int, default=n, help=f"problems in {split} (default {n})")
    ap.add_argument("--tokenizer", help="a tokenizer directory: also write train.npz and val.npz "
                    "(data/prepare.py)")
    ap.add_argument("--max-len", type=int, default=512, help="skip rows longer than this many tokens")
    a = ap.parse_args()
    splits = build(a.out, a.seed, {s: getattr(a, s) for s in sizes}, a.tokenizer, a.max_len)
    for name, rows in splits.items():
        by_family = Counter(r["family"] for r in rows)
        templates = len({r["template"] for r in rows})
        print(f"{name}: {len(rows)} problems from {templates} templates ({dict(by_family)})")
    print(f"wrote {a.out}")
