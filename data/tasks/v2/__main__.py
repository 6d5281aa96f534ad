"""python -m data.tasks.v2: write the task set v2 (data/tasks/v2/__init__.py) as JSONL, and optionally
the token arrays train.py reads."""

from data.tasks.cli import main
from data.tasks.v2 import SIZES, build

main("python -m data.tasks.v2", __doc__, SIZES, build, "out/tasks2")
