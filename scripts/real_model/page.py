"""Which page a results.json gets, and writing it: round 2's (report.py) or round 3's
(round3.py), with summary.json and the figures, into one directory.

This module sits above both renderers, so imports run one way: page -> round3 -> report
(round3.py reads report.py's shared cells; report.py reads nothing of round3.py). The
results stage (stages.py) and `--report` (__main__.py) call it; it measures nothing and
runs no model.
"""

import json
import os

from scripts.real_model import round3
from scripts.real_model.report import plot_taus, report, summary
from util.atomic import write_json, write_text


def write_page(res, d):
    """summary.json, the figures and RESULTS.md in d, from results.json's content `res`: round 2's
    page, or round 3's for a results.json with its reliability evaluation."""
    if round3.is_round3(res):
        s = round3.summary(res, summary(res, ar_sft="ar_ce"))
        text = round3.page(res, s, d)
    else:
        s, text = summary(res), report(res)
        plot_taus(res["b_taus"], os.path.join(d, "tau_sweep.png"))
    write_json(os.path.join(d, "summary.json"), s)
    write_text(os.path.join(d, "RESULTS.md"), text)


def rewrite(d):
    """--report: the page of d again from d/results.json alone (no model, no run dir)."""
    res = json.load(open(os.path.join(d, "results.json")))
    missing = [k for k in ("run", "side_by_side") if k not in res]
    if missing:
        raise SystemExit(f"{d}/results.json has no {missing}: it predates --report; run the results stage")
    write_page(res, d)
    print(f"[report] {d}: RESULTS.md, tau_sweep.png and summary.json from results.json", flush=True)
