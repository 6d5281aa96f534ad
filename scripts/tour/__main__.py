"""`python -m scripts.tour`: (re)writes docs/tour.md, or prints it with `--out -`; the
overview is the package docstring, scripts/tour/__init__.py, the page itself page.py's job.
"""

import argparse

import torch

from scripts import tour as package
from scripts.tour.page import render
from util.atomic import write_text


def main(argv=None):
    """Write the page (default docs/tour.md, atomically: util.atomic) or print it (--out -)."""
    p = argparse.ArgumentParser(prog="python -m scripts.tour", description=package.__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/tour.md", help="where to write the page; - prints it")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and leaves the other core free
    text = render()
    if args.out == "-":
        print(text, end="")
        return
    try:
        write_text(args.out, text)  # refuses a path that is not a regular file (a device, a folder)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
