"""Training in a subprocess: train.py runs as its own process (as a user would run it), into
the run dir; this driver watches it and files each MARS checkpoint as a snapshot (the
learning curve without a second run), and the child dies with the driver.

What is trained (the settings, MARS or AR SFT) is decided by stages.py; this module only
starts train.py, waits, and links the checkpoints.
"""

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

from scripts.real_model.run import BASE_DIR
from util.atomic import replace_dir


def train(run, name, over, fresh):
    """train.py in a subprocess into run/NAME. A fresh stage (new key) starts from nothing:
    the old out_dir and its snapshots are removed, so no stale step is paired with a new run;
    a resumed one (same key) lets train.py continue from its checkpoint."""
    S, out, snaps = run.train_settings(), run.path(name), run.path("snapshots")
    if fresh:
        for d in (out, snaps) if name == "train" else (out,):
            shutil.rmtree(d, ignore_errors=True)
    cmd = [sys.executable, "train.py", "--config", run.cfg_path, f"--init_from={BASE_DIR}",
           f"--data_dir={run.path('data')}", f"--out_dir={out}", f"--device={run.cfg['device']}"]
    cmd += [f"--{k}={v}" for k, v in {**run.cfg.get("train_overrides", {}), **over}.items()]
    print(f"[{name}] " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(run.cfg["threads"])}
    take = (lambda: snapshot(out, snaps)) if name == "train" else (lambda: None)
    take()  # a checkpoint a killed driver had not linked yet
    child = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
    while child.poll() is None:
        time.sleep(2)
        take()
    if child.returncode:
        raise SystemExit(f"train.py failed (exit status {child.returncode})")
    take()
    if name == "train":
        shutil.rmtree(os.path.join(snaps, "incoming"), ignore_errors=True)
        print(f"[train] snapshots: {sorted(os.listdir(snaps))}, mars_steps {S['mars_steps']}")


def die_with_parent():
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def snapshot(out, snaps):
    """Hard-link out/ckpt's weights into snaps/step_N if it is a MARS checkpoint not linked yet.
    The step is read from the linked train_state.pt, so a checkpoint replaced meanwhile is
    never filed under the wrong step."""
    ckpt = os.path.join(out, "ckpt")
    try:
        names = [n for n in os.listdir(ckpt) if n != "train_state.pt"]
        tmp = os.path.join(snaps, "incoming")
        os.makedirs(tmp, exist_ok=True)
        for n in names + ["train_state.pt"]:
            if os.path.exists(os.path.join(tmp, n)):
                os.remove(os.path.join(tmp, n))
            os.link(os.path.join(ckpt, n), os.path.join(tmp, n))
    except FileNotFoundError:  # no checkpoint yet, or train.py is replacing it: next time
        return
    state = torch.load(os.path.join(tmp, "train_state.pt"), map_location="cpu", weights_only=True, mmap=True)
    os.remove(os.path.join(tmp, "train_state.pt"))
    final = os.path.join(snaps, f"step_{state['step']:05d}")
    if state["stage"] == "mars" and not os.path.isdir(final):
        replace_dir(final, lambda d: [os.link(os.path.join(tmp, n), os.path.join(d, n)) for n in names])
        print(f"[train] snapshot {final}", flush=True)
