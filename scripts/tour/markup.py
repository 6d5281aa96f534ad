"""How docs/tour.md prints: numbers safe to print on any machine, markdown tables, links to
the defining file, and the fixed-width pictures of inputs and masks.

`num` refuses a value near a rounding boundary and `far_from_ties` an argmax near a tie, so
another machine prints the same page. This module knows no model and no vocabulary; what is
printed is the sections' business (batch.py, step.py).
"""

import math


def prob(p):
    """A probability, 2 decimals (float32 softmax: its last bits differ between machines)."""
    return num(p, 2)


def num(x, nd=3):
    """x with nd decimals; refuses a value within 1e-6 of a rounding boundary, whose last digit
    another machine's rounding (float32 softmax: ~1e-7) could flip."""
    s = float(x) * 10**nd
    if abs(s - math.floor(s) - 0.5) < 1e-6 * 10**nd:
        raise AssertionError(f"{float(x)!r} is too close to a rounding boundary to print")
    return f"{float(x):.{nd}f}"


def far_from_ties(logits):
    """Every argmax the page shows wins by > 1e-6 (in float32, where the decoders take it)."""
    top = logits.float().topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min() > 1e-6, "an argmax is near a tie"


def fn(name):
    """`mars.pad_row` -> a link to the file that defines it (docs/ sits one level down)."""
    return f"[`{name}`](../{name.split('.')[0]}.py)"


def table(head, rows):
    """A markdown table: head (list of str), rows (lists of values)."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]


def grid(allowed, labels, heads, cuts, strong):
    """A bool (T, T) mask as an x/. picture, rows = queries (labels), columns = keys (heads, one
    character each); a gap before the indices in `cuts` (blocks, groups), a wider one before
    those in `strong` (streams, real tokens | masks)."""
    def line(chars):
        gap = lambda i: "   " if i in strong else "  " if i in cuts else " "
        return "".join(gap(i) + c for i, c in enumerate(chars))
    w = max(map(len, labels))
    out = [" " * w + line(heads)]
    for lab, row in zip(labels, allowed.tolist()):
        out.append(lab.ljust(w) + line(["x" if a else "." for a in row]))
    return ["```"] + out + ["```"]


def cells(label, values, width, gaps):
    """One line of a fixed-width picture: label, then values, with '|' before indices in gaps."""
    return label + "".join((" |" if i in gaps else "") + f" {v:>{width}}" for i, v in enumerate(values))
