"""The run log of train.py: out_dir/log.jsonl, one JSON record per line (train, val, ckpt).

On resume the records past the checkpoint belong to steps that will be redone, so they
are dropped (the file is rewritten atomically) before the run appends again. A last
line cut short by a kill is skipped when reading.
"""

import json
import os

from util.atomic import atomic_write

STAGES = ("ar", "mars")


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class RunLog:
    """Appends records to log.jsonl; on rank > 0 (or with enabled=False) it writes nothing."""

    def __init__(self, path, resume_at=None, enabled=True):
        """resume_at: (stage, step) of the checkpoint the run resumes from, or None (fresh)."""
        self.file = None
        if not enabled:
            return
        here = (STAGES.index(resume_at[0]), resume_at[1]) if resume_at else (-1, 0)
        kept = [r for r in read_log(path) if (STAGES.index(r["stage"]), r["step"]) <= here]
        atomic_write(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in kept))
        self.file = open(path, "a")

    def __call__(self, rec):
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.close()
