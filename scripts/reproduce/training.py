"""Training and evaluating every run of the plan (runs.py), --jobs at a time, then the
benchmarks; each record saved to <results>/runs/<variant>.s<seed>.json.

Every run is a subprocess in the repository: train.py (skipped when its checkpoint exists;
a killed run resumes from its own checkpoint), then evaluate.py on the test and hard splits.
A MARS run waits for its seed's AR stage; a failure stops the queue and is raised. What the
runs are is runs.py's business; turning the saved records into RESULTS.md is report.py's.
"""

import json
import os
import subprocess
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from scripts.reproduce.runs import HERE, bench_commands
from util.atomic import write_json


def typed(cmd):
    """The command as a reader types it: `python script.py ...` (not this interpreter's path)."""
    return " ".join(["python", *cmd[1:]])


def shown(cmd):
    """The command as RESULTS.md shows it: `$ python script.py ...`."""
    return "$ " + typed(cmd)


def run(cmd, env, log=None, out=None):
    """Run a command in the repo, its output shown (and copied to `log`), or with `out` sent to
    that file only (parallel jobs would interleave on the terminal); False on failure."""
    print("$ " + " ".join(cmd) + (f"   (output: {out})" if out else ""), flush=True)
    if out is not None:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "a") as f:
            return subprocess.run(cmd, cwd=HERE, env=env, stdout=f, stderr=subprocess.STDOUT).returncode == 0
    if log is None:
        return subprocess.run(cmd, cwd=HERE, env=env).returncode == 0
    p = subprocess.run(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, text=True)
    print(p.stdout, end="", flush=True)
    with open(log, "w") as f:
        f.write(shown(cmd) + "\n" + p.stdout)
    return p.returncode == 0


def load_json(path):
    """The JSON at path, or None when it is missing or unreadable (a run not done yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def first_line(path):
    """A log's first line (the command that wrote it), or None when there is no log."""
    try:
        with open(path) as f:
            return f.readline().rstrip("\n")
    except OSError:
        return None


save_json = lambda obj, path: write_json(path, obj)


def run_variant(v, P, env, old):
    """Train (unless its checkpoint exists) and evaluate one variant at one seed -> its results
    record. With parallel jobs the output goes to <out_dir>/output.txt instead of the terminal."""
    key, ckpt, t0 = v["key"], v["ckpt"], time.time()
    out = f"{v['out_dir']}/output.txt" if P["jobs"] > 1 else None
    train_s = old.get("train_s") if old and old.get("ckpt") == ckpt else None
    if not os.path.isfile(f"{ckpt}/model.safetensors"):  # train.py resumes a killed run itself
        if not run(v["train_cmd"], env, out=out):
            raise SystemExit(f"{key}: training failed{f' (see {out})' if out else ''}; fix it and re-run "
                             "(finished variants are kept)")
        train_s = time.time() - t0
    t1, evs = time.time(), []
    for i, cmd in enumerate(v["eval_cmds"]):
        tmp = f"{P['R']}/runs/{key}.eval{i}.tmp"
        if not run(cmd + [f"--json={tmp}"], env, out=out):
            raise SystemExit(f"{key}: evaluation failed{f' (see {out})' if out else ''}; fix it and re-run "
                             "(finished variants are kept)")
        evs.append(load_json(tmp))
        os.remove(tmp)
    return {"name": v["name"], "seed": v["seed"], "label": v["label"], "steps": v["steps"], "ckpt": ckpt,
            "eval_key": P["eval_key"], "train_command": " ".join(v["train_cmd"][1:]),
            "eval_commands": [" ".join(c[1:]) for c in v["eval_cmds"]], "limit": P["limit"],
            "train_s": train_s, "eval_s": time.time() - t1,
            "results": {str(float(t)): r for t, r in evs[0].items()}, "hard": evs[1]["1.0"]}


def progress(vs, running, stop, since, every=60):
    """Every `every` seconds, the last step line of each running variant's output file."""
    seen = {}
    while not stop.wait(every):
        for v in [v for v in vs if v["key"] in running]:
            try:
                with open(f"{v['out_dir']}/output.txt") as f:
                    line = next((x for x in reversed(f.readlines()) if " step " in x and "/" in x), "")
            except OSError:
                continue
            if line and seen.get(v["key"]) != line:
                seen[v["key"]] = line
                print(f"[progress] {v['key']}: {line.strip()}  ({since()})", flush=True)


def pending(a, P, vs, cmds):
    """-> (results of the runs done before, {variant: {seed: record}}; the runs still to run);
    adds the first seed's commands to `cmds`."""
    results, todo = {}, []
    for i, v in enumerate(vs):
        key = v["key"]
        if v["seed"] == P["seeds"][0]:
            cmds += [typed(v["train_cmd"])] + [typed(c) for c in v["eval_cmds"]]
        old = load_json(f"{a.results}/runs/{key}.json")
        done = (os.path.isfile(f"{v['ckpt']}/model.safetensors") and old is not None
                and old.get("ckpt") == v["ckpt"] and old.get("eval_key") == P["eval_key"])
        skip = " (done, skipped)" if done else ""
        print(f"[{i + 1}/{len(vs)}] {key}: {v['label']}, seed {v['seed']}, {v['steps']} steps{skip}",
              flush=True)
        if a.dry_run:
            print("\n".join("$ " + " ".join(c) for c in (v["train_cmd"], *v["eval_cmds"])))
        elif done:
            results.setdefault(v["name"], {})[v["seed"]] = old
        else:
            todo.append(v)
    return results, todo


def train_all(a, P, todo, since):
    """Train and evaluate the runs still to run -> {key: record}, `jobs` at a time: every seed's
    AR stage first (its MARS variants start from it and wait for it), then the rest in order."""
    running, jobs = set(), P["jobs"]  # keys of the runs being trained or evaluated now
    futures, halt, failures = {}, threading.Event(), []  # halt: a run failed, start no other

    def one(v):
        if halt.is_set():
            raise SystemExit(f"{v['key']}: not started (an earlier run failed)")
        dep = futures.get(f"ar_stage.s{v['seed']}")
        if v["name"] != "ar_stage" and v.get("stage") != "ar" and dep is not None:
            dep.result()  # submitted before this one, so already running or done: raises its failure
        print(f"\n[start] {v['key']}; {since()}", flush=True)
        running.add(v["key"])
        try:
            r = run_variant(v, P, P["env"], load_json(f"{a.results}/runs/{v['key']}.json"))
        except BaseException as e:
            failures.append(e)
            halt.set()
            print(f"\n[failed] {v['key']}: {e}; {since()}", flush=True)
            raise
        finally:
            running.discard(v["key"])
        save_json(r, f"{a.results}/runs/{v['key']}.json")
        print(f"\n[done] {v['key']}: accuracy at τ=1 {r['results'].get('1.0', {}).get('accuracy')}%, "
              f"NLL {r['results'].get('1.0', {}).get('reply_nll')}; {since()}", flush=True)
        return r

    order = [v for v in todo if v["name"] == "ar_stage"] + [v for v in todo if v["name"] != "ar_stage"]
    stop = threading.Event()
    if jobs > 1:  # their output goes to files: show each running training's latest progress line
        threading.Thread(target=progress, args=(todo, running, stop, since), daemon=True).start()
    pool = ThreadPoolExecutor(jobs)
    try:
        for v in order:
            futures[v["key"]] = pool.submit(one, v)
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)  # all done, or a failure
        if any(f.exception() is not None for f in done):
            raise failures[0] if failures else next(f.exception() for f in done if f.exception())
        return {k: f.result() for k, f in futures.items()}
    finally:  # on a failure or Ctrl-C nothing new starts; the runs under way finish
        pool.shutdown(wait=True, cancel_futures=True)
        stop.set()


def benchmarks(a, P, results, cmds, since):
    """Run the benchmarks on the first seed's mars_b4 (each skipped if its log shows it ran before)."""
    first = (results.get("mars_b4") or {}).get(P["seeds"][0])
    for name, cmd in bench_commands(P, (first or {}).get("ckpt"), a.quick).items():
        log = f"{a.results}/{name}.txt"
        if a.skip_bench or first is None:
            continue
        cmds.append(typed(cmd) + f" > {log}")
        if first_line(log) == shown(cmd):  # this very benchmark ran before
            print(f"\n[bench] {name}: done, skipped ({log})", flush=True)
            continue
        print(f"\n[bench] {name}; {since()}", flush=True)
        if not run(cmd, P["env"], log=log):
            print(f"{name} failed (its output is in {a.results}/{name}.txt); going on", flush=True)
