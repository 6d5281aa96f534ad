"""`python -m scripts.reproduce`: the options and the order of the stages (plan, data set,
train and evaluate, benchmarks, plots, RESULTS.md); the overview is the package docstring,
scripts/reproduce/__init__.py.

Each stage lives in its own module: runs.py plans, training.py runs, report.py writes the page.
This file only parses the options, sequences the stages and describes the run (`meta`) for
the page.
"""

import argparse
import os
import platform
import sys
import time

from data.synthetic import read_jsonl
from scripts import reproduce as package
from scripts.reproduce.report import plot_sweep, saved_records, write_results
from scripts.reproduce.runs import HERE, TAUS, plan
from scripts.reproduce.training import benchmarks, pending, run, train_all, typed


def parse_args(argv):
    """The options (the help text is the package docstring's first line and its examples)."""
    doc = package.__doc__
    p = argparse.ArgumentParser(prog="python -m scripts.reproduce", description=doc.split("\n")[0],
                                epilog=doc.split("\n\n")[-1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="steps x 0.25, 100 test problems, small benchmarks, seed 0 unless --seeds")
    p.add_argument("--steps-scale", type=float, help="multiply the config's ar_steps, mars_steps (default 1)")
    p.add_argument("--seeds", help="comma-separated training seeds (default 0,1,2; 0 with --quick)")
    p.add_argument("--limit", type=int, help="test problems per evaluation (default all)")
    p.add_argument("--taus", default=",".join(map(str, TAUS)))
    p.add_argument("--config", default="configs/default.json")
    p.add_argument("--out", default="out/reproduce", help="checkpoints go to OUT/<A>+<M>-<hash>/s<seed>/")
    p.add_argument("--results", default="results", help="paths are relative to the repository root")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process (a 1M-parameter model gains little from more, and "
                        "threads contend badly on a shared machine)")
    p.add_argument("--jobs", type=int, help="variants trained at once, each in its own process "
                   "(default: CPUs / threads, at most 4); on 2 cores two 1-thread jobs finish far "
                   "sooner than one 2-thread job")
    p.add_argument("--only", help="comma-separated variants to run (the AR stage is always run)")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--replot", action="store_true",
                   help="redraw RESULTS/tau_sweep.png from RESULTS/runs/*.json alone (no training), and stop")
    return p.parse_args(argv)


def main(argv=None):
    """Plan, build the data set, train and evaluate what is not done, benchmark, write results/."""
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    os.chdir(HERE)  # every path is relative to the repository
    if a.replot:
        plot_sweep(a.results, saved_records(a.results))
        return print(f"wrote {a.results}/tau_sweep.png from {a.results}/runs/*.json")
    t_start = time.time()
    since = lambda: f"{(time.time() - t_start) / 60:.1f} min so far"
    P, vs = plan(a)
    print(f"reproduce: {len(vs)} runs (seeds {P['seeds']}), A={P['A']} AR + M={P['M']} MARS steps, eval on "
          f"{P['limit'] or 'all'} test problems at τ in {P['taus']}; {P['jobs']} job(s) of {a.threads} "
          f"thread(s); checkpoints in {P['root']}, results in {a.results}", flush=True)
    if not a.dry_run:
        os.makedirs(f"{a.results}/runs", exist_ok=True)
    cmds, data_dir = [], P["data_dir"]
    if data_dir != P["S"].data_dir:  # the default data set, built from the sources hashed into root
        dcmd = [sys.executable, "data/synthetic.py", f"--out={data_dir}", f"--seed={P['S'].seed}"]
        cmds.append(typed(dcmd))
        if not os.path.isfile(f"{data_dir}/val.npz") and not a.dry_run and not run(dcmd, P["env"]):
            raise SystemExit("building the data set failed")
    results, todo = pending(a, P, vs, cmds)
    if a.dry_run:
        return
    for r in train_all(a, P, todo, since).values():
        results.setdefault(r["name"], {})[r["seed"]] = r
    names = list(dict.fromkeys(v["name"] for v in vs))  # run order
    results = {n: dict(sorted(results.get(n, {}).items())) for n in names}
    benchmarks(a, P, results, cmds, since)
    run([sys.executable, "-m", "scripts.plot_mask", f"--out={a.results}/mask.png"], P["env"])
    plot_sweep(a.results, results)
    limit = P["limit"]
    n_of = lambda split: min(limit or 10**9, len(read_jsonl(f"{data_dir}/{split}.jsonl")))
    meta = {"mode": "quick" if a.quick else "full" if P["scale"] == 1 and limit is None else "custom",
            "argv": "".join(" " + x for x in argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "config": a.config, "A": P["A"], "M": P["M"], "root": P["root"], "taus": P["taus"],
            "seeds": P["seeds"], "minutes": (time.time() - t_start) / 60,
            "variant_minutes": sum((r.get("train_s") or 0) + r["eval_s"]
                                   for rs in results.values() for r in rs.values()) / 60,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{a.threads} thread(s) per process, {P['jobs']} job(s) at once",
            "n_test": n_of("test"), "n_hard": n_of("hard")}
    write_results(a.results, results, meta, cmds)
    print(f"\nwrote {a.results}/RESULTS.md, runs/, tau_sweep.png, mask.png; {since()}", flush=True)


if __name__ == "__main__":
    main()
