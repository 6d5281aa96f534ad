"""python -m data.tasks: write the task set (data/tasks/__init__.py) as JSONL, and optionally
the token arrays train.py reads."""

from data.tasks import SIZES, build
from data.tasks.cli import main

main("python -m data.tasks", __doc__, SIZES, build, "out/tasks")
