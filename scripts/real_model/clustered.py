"""A clustered, paired bootstrap: two arms on the same problems, the problems in clusters
(templates), and the 95 % interval of a difference between the arms (issue 61).

Problems of one template share their story and their arithmetic, so they are not independent:
an interval that resamples problems alone is too narrow. Here each resample is two-stage: the
templates with replacement (as many as there are), then, within each drawn template, its
problems with replacement (as many as it has); the statistic is computed on the union, the
same draw for both arms (paired: the arms' difference, not each arm, is resampled). A drawn
template's problems are indices into the table; `resamples` fixes the order of the draws
(tests/test_tasks_v2.py writes them out in plain loops):

  for each resample: picks = rng.integers(0, G, G)        # G templates, in first-seen order
                     u = rng.random(sum of the picks' sizes)
                     the k-th problem of a pick of template g (m problems): its int(u[..] * m)-th

Two statistics: `accuracy_difference` (B's accuracy minus A's, in points) and
`ratio_difference` (B's sum(num) / sum(den) minus A's: tokens per forward). Each returns the
estimate on the table, the percentile interval (2.5, 97.5) of the resampled statistic and its
half-width. What this module does not know: where the results come from, grading, pages.
"""

import numpy as np


def resamples(groups, n=2000, seed=0):
    """n index arrays into the table, each a two-stage resample (module docstring)."""
    labels = np.array(groups, dtype=object)
    members = [np.flatnonzero(labels == g) for g in dict.fromkeys(groups)]
    order = np.concatenate(members)  # each template's problems side by side
    sizes = np.array([len(m) for m in members])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rng = np.random.default_rng(seed)
    for _ in range(n):
        picks = rng.integers(0, len(members), len(members))
        m = sizes[picks]
        within = (rng.random(m.sum()) * np.repeat(m, m)).astype(int)
        yield order[np.repeat(starts[picks], m) + within]


def paired_bootstrap(stat, groups, n=2000, seed=0):
    """stat(index array) -> a number: its value on the whole table, the 95 % percentile interval
    over n two-stage resamples, and the half-width of that interval."""
    draws = np.array([stat(idx) for idx in resamples(groups, n, seed)])
    lo, hi = float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))
    return {"estimate": float(stat(np.arange(len(groups)))), "ci95": [lo, hi], "half_width": (hi - lo) / 2,
            "problems": len(groups), "templates": len(set(groups)), "draws": n}


def accuracy_difference(a, b, groups, n=2000, seed=0):
    """B's accuracy minus A's, in points, from each problem's 0/1 (or bool) result in both arms."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    return paired_bootstrap(lambda idx: 100 * (b[idx].mean() - a[idx].mean()), groups, n, seed)


def ratio_difference(num_a, den_a, num_b, den_b, groups, n=2000, seed=0):
    """B's sum(num) / sum(den) minus A's (tokens per forward: num tokens, den forwards)."""
    na, da, nb, db = (np.asarray(x, float) for x in (num_a, den_a, num_b, den_b))
    return paired_bootstrap(lambda idx: nb[idx].sum() / db[idx].sum() - na[idx].sum() / da[idx].sum(),
                            groups, n, seed)
