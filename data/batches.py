"""The rows each optimizer step trains on, and their tensors (train.py's data, docs/spec.md §2).

What it holds: `step_rows`, the row indices of step s of a stage, a pure function of (seed,
stage, s): epochs of permutations seeded by (seed, stage, epoch), optionally cut into batches
of similar lengths (so a resumed run takes the same rows, with no RNG state to save);
`batch_rows`, the same for a prepared file and the run's settings; `make_batch`, those rows
EOS-padded to a multiple of B and right-padded into (ids, labels) (mars.pad_row /
mars.collate, §2); `make_teacher`, the stored teacher top-k of those rows when L_AR is a KL
(ar_target = "teacher"); `fingerprint`, the hash a resume point must match.

What it leaves to others: the prepared arrays (data/prepare.py), the loss (mars.py), the
training loop that asks for each step's batch (train.py).
"""

import hashlib
from functools import lru_cache

import numpy as np
import torch

from mars import collate, pad_row


def _perm(n, *key):
    """A permutation of range(n) seeded by a hash of `key` (no global RNG state)."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


@lru_cache(maxsize=4)
def _epoch_perm(n, seed, stage, epoch):
    return _perm(n, seed, stage, epoch)


def _samples(n, count, seed, stage, i):
    """Samples i*count .. (i+1)*count-1 of a sequence of epochs, epoch e a permutation of
    the n rows seeded by (seed, stage, e): every row once per epoch."""
    k = torch.arange(i * count, (i + 1) * count)
    out = torch.empty(count, dtype=torch.long)
    for e in (k // n).unique().tolist():
        out[k // n == e] = _epoch_perm(n, seed, stage, e)[k[k // n == e] % n]
    return out


def step_rows(n, batch, seed, stage, step, lengths=None, window=1):
    """Row indices of optimizer step `step` of `stage`. A pure function of its arguments (no
    RNG state to save, so a resumed run takes the same rows), every row once per epoch.

    window = 1: samples step*batch .. (step+1)*batch-1 of the epoch sequence (_samples).
    window = W > 1 (length buckets): the W steps of window w = step // W share its W*batch
    samples; sorted by length (`lengths`, per row) they are cut into W batches of similar
    lengths, which the W steps take in an order seeded by (seed, stage, w). Less padding
    (data/default: 77% of batch tokens real at W = 1, 94% at W = 8), the same rows."""
    if window == 1:
        return _samples(n, batch, seed, stage, step)
    w, i = divmod(step, window)
    rows = _samples(n, batch * window, seed, stage, w)
    rows = rows[torch.argsort(torch.as_tensor(lengths)[rows], stable=True)]  # shortest first
    pick = int(_perm(window, seed, stage, "window", w)[i])
    return rows[pick * batch:(pick + 1) * batch]


def batch_rows(d, S, stage, step):
    """The rows of a prepared file that optimizer step `step` of `stage` trains on."""
    off = d["offsets"]
    return step_rows(len(off) - 1, S.batch_size, S.seed, stage, step, off[1:] - off[:-1], S.bucket_window)


def make_batch(d, rows, S, special, device):
    """Rows of a prepared file -> ids, labels (N, l), EOS-padded to a multiple of B then
    right-padded (mars.pad_row, mars.collate, §2), and the number of tokens before padding."""
    off, padded = d["offsets"], []
    for i in rows.tolist():
        a, b = int(off[i]), int(off[i + 1])
        padded.append(pad_row(d["ids"][a:b].tolist(), d["loss"][a:b].astype(bool).tolist(), S.block_size,
                              special["eos"]))
    return *collate(padded, special["pad"], device), sum(len(r[0]) for r in padded)


def make_teacher(d, rows, S, special, device):
    """The teacher of those rows for L_AR = KL (ar_target = "teacher", mars.teacher_kl): one
    entry per target in mars._targets' order, the row's stored top-k (data/prepare.py) and,
    for each EOS pad that pad_row adds, a one-hot EOS (its KL is the CE on the pad).
    None when L_AR is CE on the tokens (ar_target = "tokens", the paper's)."""
    if S.ar_target != "teacher":
        return None
    off, t_off, B = d["offsets"], d["t_offsets"], S.block_size
    k, eos = d["t_logp"].shape[1], special["eos"]
    logp, ids, rest = [], [], []
    for i in rows.tolist():
        a, b = int(off[i]), int(off[i + 1])
        if d["loss"][a]:
            raise ValueError(f"row {i}: a loss token at index 0 has no output to predict it (§3)")
        n_pad = -(b - a) % B
        logp += [d["t_logp"][t_off[i]:t_off[i + 1]], np.full((n_pad, k), -np.inf, np.float16)]
        logp[-1][:, 0] = 0.0  # log 1 at the EOS
        ids += [d["t_ids"][t_off[i]:t_off[i + 1]], np.full((n_pad, k), eos, np.int32)]
        rest += [d["t_rest"][t_off[i]:t_off[i + 1]], np.zeros(n_pad, np.float32)]
    cat = lambda xs: torch.from_numpy(np.concatenate(xs)).to(device)  # noqa: E731
    return {"logp": cat(logp), "ids": cat(ids), "rest": cat(rest)}


def fingerprint(d):
    """A short hash of a prepared file's arrays (the teacher's too, where it has them)."""
    h = hashlib.blake2b(digest_size=8)
    for k in ("ids", "loss", "offsets", "t_logp", "t_ids", "t_rest"):
        if k in d:  # the teacher arrays, where the file has them
            h.update(d[k].tobytes())
    return h.hexdigest()
