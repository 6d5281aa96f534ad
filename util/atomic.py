"""Atomic file and directory writes: a reader (or a resumed run) sees the old file or the
new one, never half of one. Every output of the project is written through here."""

import json
import os
import shutil


def atomic_write(path, write, mode="w"):
    """Write `path` through `path.tmp` and a rename. `write(f)` gets the open temp file
    (text or binary by `mode`); it is flushed to disk and closed before the rename, and
    removed if `write` raises (including KeyboardInterrupt). A `path` that exists and is not
    a regular file (a directory, a device such as /dev/null, a pipe) is refused: the rename
    would replace it by a file."""
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ValueError(f"{path}: exists and is not a regular file; refusing to replace it")
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text(path, text):
    atomic_write(path, lambda f: f.write(text))


def write_json(path, obj, indent=2):
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def replace_dir(final, write, *args):
    """Write a directory atomically: write(tmp, *args) fills final.tmp, then final -> final.old,
    final.tmp -> final, delete final.old. A reader sees the old or the new directory, never
    half of one; recover_dir repairs a kill between the two renames. If `write` raises,
    final.tmp is removed and `final` is untouched."""
    tmp, old = final + ".tmp", final + ".old"
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write(tmp, *args)
        for name in os.listdir(tmp):  # on disk before the rename makes them visible
            p = os.path.join(tmp, name)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(final):
    """Finish or undo what replace_dir left: an only .old comes back; .tmp and .old go."""
    tmp, old = final + ".tmp", final + ".old"
    if not os.path.exists(final) and os.path.exists(old):
        os.replace(old, final)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
