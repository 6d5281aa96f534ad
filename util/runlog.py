"""The run log of train.py: out_dir/log.jsonl, one JSON record per line (train, val, ckpt),
and its picture, out_dir/loss.png (`plot_losses`).

On resume the records past the checkpoint belong to steps that will be redone, so they
are dropped (the file is rewritten atomically) before the run appends again. A last
line cut short by a kill is skipped when reading.
"""

import json
import math
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


def plot_losses(out_dir, totals):
    """out_dir/loss.png from out_dir/log.jsonl: loss, L_mask, L_AR and val loss over both stages,
    the MARS stage's steps counted after the AR stage's `totals["ar"]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(os.path.join(out_dir, "log.jsonl"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, key, style in (("train", "loss", "-"), ("train", "l_mask", ":"), ("train", "l_ar", "--"),
                             ("val", "val_loss", "o-")):
        pts = [(r["step"] + (totals["ar"] if r["stage"] == "mars" else 0), r[key]) for stage in STAGES
               for r in recs + [{"kind": kind, "stage": stage, "step": 0, key: math.nan}]  # NaN: a gap
               if r["kind"] == kind and r["stage"] == stage and r.get(key) is not None]
        if any(not math.isnan(y) for _, y in pts):
            ax.plot(*zip(*pts), style, label=key, markersize=3)
    ax.axvline(totals["ar"], color="gray", lw=0.8)
    ax.set(xlabel="optimizer step (AR SFT, then MARS)", ylabel="loss", yscale="log")
    ax.legend()
    atomic_write(os.path.join(out_dir, "loss.png"), lambda f: fig.savefig(f, format="png", dpi=100), "wb")
    plt.close(fig)
