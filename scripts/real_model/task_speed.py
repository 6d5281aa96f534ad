"""The speed MARS gives the task model, as a user would run it (issue 62; docs/spec.md §5, §6, §8):
`python -m scripts.real_model --config task --speed` after stage 2 (protocol.py's stages up to
mars, run first when missing), the page `--speed --report` rewrites from speed.json alone.

Every decoder runs greedy on stage 2's MARS weights, on the first n test problems (their templates
never trained on), at each batch size of "batches", on each PATH:

  reference    the core as `python generate.py` decodes: float32, the plain model.py, the host
               loops of generate.py and exact.py
  engine       `generate.py --compile`: fast.make_fast in the dtype auto picks (bf16 where the
               CPU has bf16 units), the decoding step compiled (fast.step.compile_step), the same
               host loops
  engine loop  `generate.py --device-loop`: the whole step compiled (fast/loop.py), a host read
               every 8 steps; AR, the τ window and exact mode (no block cache there)
  hf           transformers' generate on the same weights and dtype, greedy: AR (its default
               dynamic cache, or its static cache compiled with "hf_static"), and prompt-lookup
               decoding (lossless, no training; batch 1 only: HF's assisted generation takes one row)

and DECODERS: "ar", "exact K=k" (k in "drafts"), "tau T" (the τ rule with the window cache, T in
"taus") and "tau T block" (the block cache of B_cache = "block_cache" slots, T = "block_tau").

The clock (speed.time_decoders): one warm-up call of every (decoder, path) (the compiles), then
"rounds" rounds, each item (a batch of prompts) run by every (decoder, path) in turn, the order
rotated each round and recorded. A record's ms_per_reply is the median round's total over its
replies, tokens_per_s the tokens of a round over the median round, speed_vs_engine_ar the median
over rounds of the paired ratio (the engine's AR round / this round, speed.paired_speed) with an
interval over items resampled by template, against the faster of the engine's two AR paths
(engine or engine loop); speed_vs_hf the same against the faster of hf's ARs. identical_to_ar: the share of
replies equal, token for token, to its own path's AR (same weights, dtype and kernels: exact mode
must be 1.0). Every reply is graded (data/tasks/grade.py): accuracy is on these n problems.

Beside the clock, one untimed check: each engine decoder of both engine paths run eagerly in
float32 on the first n_check problems at batch 1 and 4, against the reference's replies
("equal_fp32": the engine is the reference, made fast).

Each batch size is a piece (speed/batch_N.json under the run dir, with its key): a killed run
resumes at the piece it was in. speed.json (results_dir): "machine" and one record per decoder,
path and batch; SPEED.md and speed.png are made from speed.json alone (`--speed --report`).
"""

import json
import os
import statistics
import time

import torch

from checkpoint import load_checkpoint
from data.tasks.grade import is_correct
from decoding import Generation
from exact import generate_exact
from generate import generate, generate_ar
from scripts.common import machine
from scripts.real_model.run import BASE_DIR, digest, eos_of, run_dtype
from scripts.real_model.speed import paired_speed, time_decoders
from scripts.real_model.task_eval import prompt_of
from util.atomic import write_json, write_text

PATHS = ("reference", "engine", "engine loop", "hf")
SMOKE = {"n": 4, "batches": [1, 2], "rounds": 2, "drafts": [1, 2], "taus": [0.03], "block_tau": 0.03,
         "block_cache": 4, "max_new_tokens": 12, "n_check": 4, "compile": False, "hf_static": False}
SPEED_CODE = ("exact.py", "generate.py", "decoding.py", "kvcache.py", "model.py", "sampling.py",
              "fast/loop.py", "fast/step.py", "fast/linear.py", "fast/cache.py", "fast/attention.py",
              "fast/argmax.py", "scripts/real_model/speed.py", "scripts/real_model/task_speed.py")
PAPER_7B = [  # the paper's wall clock (7B, GSM8K, τ = 0.95, block cache, a GPU): batch, speed, share kept
    (4, 1.71, 71.0 / 73.2), (8, 1.60, 71.0 / 73.2), (16, 1.34, 71.0 / 73.2)]


def settings(run):
    """The speed run's settings: the config's "speed" (--smoke: shrunk by SMOKE)."""
    s = dict(run.cfg["speed"])
    return {**s, **SMOKE} if run.smoke else s


def decoder_names(s):
    return (["ar"] + [f"exact K={k}" for k in s["drafts"]] + [f"tau {t:g}" for t in s["taus"]] +
            [f"tau {s['block_tau']:g} block"])


def core_decoders(model, s, B, mask_id, eos):
    """decoder -> fn(batch of prompts) -> [Generation] through the core's host loops (generate.py,
    exact.py), on `model`: the plain model (the reference) or the engine (FastQwen2)."""
    n = s["max_new_tokens"]
    out = {"ar": lambda b: generate_ar(model, b, n, eos)}
    for K in s["drafts"]:
        out[f"exact K={K}"] = lambda b, K=K: generate_exact(model, b, block_size=B, drafts=K, eos_ids=eos,
                                                            max_new_tokens=n, mask_id=mask_id)
    for t in s["taus"]:
        out[f"tau {t:g}"] = lambda b, t=t: generate(model, b, block_size=B, tau=t, max_new_tokens=n,
                                                    mask_id=mask_id, eos_ids=eos, cache="window")
    out[f"tau {s['block_tau']:g} block"] = lambda b: generate(
        model, b, block_size=B, tau=s["block_tau"], max_new_tokens=n, mask_id=mask_id, eos_ids=eos,
        cache="block", block_cache_size=s["block_cache"])
    return out


def loop_decoders(model, s, B, mask_id, eos, compile):
    """The same decoders (but the block cache) with the whole step on the device (fast/loop.py),
    each step compiled (fast.loop.compiled_steps) or, without `compile`, run eagerly."""
    from fast.loop import (
        ar_step,
        compiled_steps,
        exact_step,
        generate_ar_device,
        generate_exact_device,
        generate_window_device,
        window_step,
    )

    plain = {f: f for f in (ar_step, window_step, exact_step)}
    step = compiled_steps(model.lm_head.weight.device) if compile else plain
    n = s["max_new_tokens"]
    out = {"ar": lambda b: generate_ar_device(model, b, n, eos, step=step[ar_step])}
    for K in s["drafts"]:
        out[f"exact K={K}"] = lambda b, K=K: generate_exact_device(
            model, b, K, n, mask_id, eos, step=step[exact_step], block_size=B)
    for t in s["taus"]:
        out[f"tau {t:g}"] = lambda b, t=t: generate_window_device(model, b, B, t, n, mask_id, eos,
                                                                  step=step[window_step])
    return out


def hf_decoders(path, dtype, s, tok):
    """transformers' greedy generate on the weights in `path` -> {name: fn}: "ar" (its default dynamic
    cache; batches left-padded), with s["hf_static"] also "ar static" (its static cache, the forward
    compiled by generate on any device), and "prompt lookup" (batch 1: HF's assisted generation takes
    one row). Forwards are counted by a hook on the model's forward; a reply is cut after its first EOS."""
    from transformers import AutoModelForCausalLM, CompileConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    calls, eos = [0], list(eos_of(tok))
    hf.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))

    @torch.no_grad()
    def run(batch, **kw):
        width = max(map(len, batch))
        x = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in batch])
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        calls[0] = 0
        y = hf.generate(x, attention_mask=att, max_new_tokens=s["max_new_tokens"], do_sample=False,
                        eos_token_id=eos, pad_token_id=tok.pad_id, **kw)
        out = []
        for row in y[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            out.append(Generation(row[:cut], calls[0]))  # a batch's forwards: every row's
        return out

    def lookup(batch):
        return [g for p in batch for g in run([p], prompt_lookup_num_tokens=s["prompt_lookup"])]
    out = {"ar": run, "prompt lookup": lookup}
    if s.get("hf_static"):
        cc = CompileConfig(mode="default")  # inductor; "reduce-overhead" is CUDA graphs
        cc._compile_all_devices = True  # generate compiles on CUDA only unless told (transformers 5.24)
        out["ar static"] = lambda b: run(b, cache_implementation="static", compile_config=cc)
    return out


def reference_dtype(run):
    """The reference's dtype: float32, as `python generate.py` decodes (float64 in the smoke)."""
    return torch.float64 if run.smoke else torch.float32


def reference_decoders(run, model_dir, s, tok):
    """The reference path's decoders: the plain model of model.py in reference_dtype."""
    ref = load_checkpoint(model_dir, run.cfg["device"], reference_dtype(run)).model
    return core_decoders(ref, s, run.train_settings()["block_size"], tok.mask_id, eos_of(tok))


def open_paths(run, model_dir, s, tok):
    """path -> {decoder: fn}, and the engine's dtype: the reference (float32, plain), the engine (the
    dtype auto picks; compiled step), the engine's loops (its own copy of the weights), hf."""
    dev, B = run.cfg["device"], run.train_settings()["block_size"]
    eng_dtype = run_dtype(run, s.get("dtype"))
    import fast

    eng = fast.make_fast(load_checkpoint(model_dir, dev, eng_dtype).model, compile=s["compile"])
    loop = fast.make_fast(load_checkpoint(model_dir, dev, eng_dtype).model)
    eos, mask = eos_of(tok), tok.mask_id
    paths = {"reference": reference_decoders(run, model_dir, s, tok),
             "engine": core_decoders(eng, s, B, mask, eos),
             "engine loop": loop_decoders(loop, s, B, mask, eos, s["compile"]),
             "hf": hf_decoders(model_dir, eng_dtype, s, tok)}
    return paths, eng_dtype


def fp32_check(run, model_dir, s, tok, problems, ref_fns):
    """The engine's decoders (both paths, eager) in the reference's dtype against the reference's
    replies on the first n_check problems at batch 1 and 4 -> {path: {decoder: share equal}}."""
    import fast

    dev, B = run.cfg["device"], run.train_settings()["block_size"]
    ref_dtype = reference_dtype(run)
    eng = fast.make_fast(load_checkpoint(model_dir, dev, ref_dtype).model)
    eos, mask = eos_of(tok), tok.mask_id
    prompts = [prompt_of(tok, p) for p in problems[:s["n_check"]]]
    paths = {"engine": core_decoders(eng, s, B, mask, eos),
             "engine loop": loop_decoders(eng, s, B, mask, eos, False)}
    out = {}
    for bs in (1, 4):
        items = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
        want = {d: [g.ids for it in items for g in f(it)] for d, f in ref_fns.items()}
        for path, fns in paths.items():
            for d, f in fns.items():
                got = [g.ids for it in items for g in f(it)]
                out.setdefault(path, {}).setdefault(d, []).append(
                    sum(a == b for a, b in zip(got, want[d])) / len(got))
    res = {p: {d: min(v) for d, v in r.items()} for p, r in out.items()}
    print(f"[speed] engine = reference in {ref_dtype} (batch 1 and 4, {len(prompts)} problems): {res}",
          flush=True)
    return res


def batch_piece(run, fns, problems, tok, bs, s):
    """One batch size's clock: every (decoder, path) of `fns` ({(decoder, path): fn}) on the items,
    s["rounds"] rounds -> {"order", "records"} (module docstring), with every reply."""
    prompts = [prompt_of(tok, p) for p in problems]
    items = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
    groups = [problems[i]["template"] for i in range(0, len(prompts), bs)]  # an item: its first problem's
    names = {f"{path} | {d}": fn for (d, path), fn in fns.items() if bs == 1 or d != "prompt lookup"}
    for name in (n for n in names if n.endswith("ar static")):  # a new prompt length can recompile it:
        for item in items:  # all before the clock (its replies do not change)
            names[name](item)
        print(f"[speed] batch {bs}: {name} warmed up on every item", flush=True)
    order, t0 = [], time.time()

    def progress(r, i):
        if i == len(items) - 1 or i % max(1, len(items) // 4) == 0:
            print(f"[speed] batch {bs}: round {r + 1}/{s['rounds']}, item {i + 1}/{len(items)}, "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
    t, outs = time_decoders(names, items, s["rounds"], run.cfg["device"], order, progress)
    recs = []
    for name in names:
        path, d = name.split(" | ")
        gens = outs[name]
        recs.append({"decoder": d, "path": path, "batch": bs, "times_s": t[name]["times_s"],
                     "replies": [g.ids for g in gens], "forwards": [g.forwards for g in gens],
                     "correct": [is_correct(p, tok.decode(strip_eos(g.ids, tok)))
                                 for p, g in zip(problems, gens)]})
    return {"order": order, "groups": groups, "n": len(prompts), "records": recs}


def strip_eos(ids, tok):
    return ids[:-1] if ids and ids[-1] in eos_of(tok) else ids


def summarise(piece):
    """A batch piece's records -> the rows of speed.json (module docstring), computed from the recorded
    times and replies alone."""
    recs, groups = piece["records"], piece["groups"]
    by = {(r["path"], r["decoder"]): r for r in recs}
    round_s = {k: [sum(x) for x in r["times_s"]] for k, r in by.items()}

    def fastest(keys):
        return min((k for k in keys if k in by), key=lambda k: statistics.median(round_s[k]))
    eng_ar = fastest([("engine", "ar"), ("engine loop", "ar")])
    hf_ar = fastest([("hf", "ar"), ("hf", "ar static")])
    rows = []
    for (path, d), r in by.items():
        med = statistics.median(round_s[(path, d)])
        tokens = sum(len(x) for x in r["replies"])
        fwd = sum(r["forwards"])
        ar_ref = by[(path, "ar")]["replies"]
        row = {"decoder": d, "path": path, "batch": r["batch"], "n": len(r["replies"]),
               "ms_per_reply": 1000 * med / len(r["replies"]), "tokens_per_s": tokens / med,
               "tokens_per_forward": tokens / fwd,
               "identical_to_ar": sum(a == b for a, b in zip(r["replies"], ar_ref)) / len(ar_ref),
               "accuracy": sum(r["correct"]) / len(r["correct"])}
        for key, base in (("engine_ar", eng_ar), ("hf", hf_ar)):
            v, ci = paired_speed(by[base]["times_s"], r["times_s"], groups)
            row[f"speed_vs_{key}"], row[f"speed_vs_{key}_ci95"] = v, ci
        rows.append(row)
    return rows, {"engine": eng_ar[0], "hf": hf_ar[1]}


def piece_key(run, s, model_dir, bs, problems):
    return digest("speed", bs, s, run.manifest.get("mars", {}).get("key"), [p["id"] for p in problems],
                  *[("file", f) for f in SPEED_CODE], ("file", os.path.join(model_dir, "model.safetensors")))


def stage_speed(run, model_dir):
    """The speed run (module docstring): the pieces not yet on disk with their key, then speed.json and
    the page from it."""
    from tokenizer import Tokenizer

    s = settings(run)
    torch.manual_seed(run.cfg["seed"])
    tok = Tokenizer.from_dir(BASE_DIR)
    with open(run.path("data", "test.jsonl")) as f:
        problems = [json.loads(line) for line in f][:s["n"]]
    pieces, paths, dtype = {}, None, None
    os.makedirs(run.path("speed"), exist_ok=True)
    for bs in s["batches"]:
        out, key = run.path("speed", f"batch_{bs}.json"), piece_key(run, s, model_dir, bs, problems)
        if os.path.isfile(out) and json.load(open(out))["key"] == key:
            print(f"[speed] batch {bs}: done before, skipped", flush=True)
        else:
            if paths is None:
                paths, dtype = open_paths(run, model_dir, s, tok)
            fns = {(d, p): f for p, table in paths.items() for d, f in table.items()}
            print(f"[speed] batch {bs}: {len(fns)} decoders x paths, {s['rounds']} rounds", flush=True)
            write_json(out, {"key": key, "dtype": str(dtype), "piece": batch_piece(run, fns, problems, tok,
                                                                                  bs, s)})
        pieces[bs] = json.load(open(out))
    check_out, check_key = run.path("speed", "check_fp32.json"), piece_key(run, s, model_dir, 0, problems)
    if not (os.path.isfile(check_out) and json.load(open(check_out))["key"] == check_key):
        ref_fns = paths["reference"] if paths else reference_decoders(run, model_dir, s, tok)  # not all paths
        equal = fp32_check(run, model_dir, s, tok, problems, ref_fns)
        write_json(check_out, {"key": check_key, "equal": equal})
    res = results(run, s, pieces, json.load(open(check_out))["equal"])
    os.makedirs(run.results, exist_ok=True)
    write_json(os.path.join(run.results, "speed.json"), res)
    write_speed_page(res, run.results)
    print(f"[speed] {run.results}: speed.json, SPEED.md, speed.png", flush=True)


def results(run, s, pieces, equal):
    rows, order, base = [], {}, {}
    for bs, p in pieces.items():
        r, base[str(bs)] = summarise(p["piece"])
        rows += r
        order[str(bs)] = p["piece"]["order"]
    dtypes = {p["dtype"] for p in pieces.values()}
    return {"machine": machine(run.cfg["device"]), "engine_dtype": sorted(dtypes)[0], "settings": s,
            "model": "stage 2 (MARS) of " + run.name, "records": rows, "engine_ar_path": base,
            "equal_fp32": equal, "order": order,
            "times": {str(bs): {f"{r['path']} | {r['decoder']}": r["times_s"] for r in p["piece"]["records"]}
                      for bs, p in pieces.items()}}


# ------------------------------------------------------------------ the page, from speed.json alone
def fmt_ci(v, ci):
    return f"{v:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]"


def speed_page(res):
    s = res["settings"]
    lines = ["# The speed MARS gives the task model (issue 62)", "",
             "Generated by `python -m scripts.real_model --config task --speed` from speed.json "
             "(`--speed --report` rewrites it); what each column means: "
             "scripts/real_model/task_speed.py.", "",
             f"- {res['machine']}",
             f"- model: {res['model']}; the engine in {res['engine_dtype']}, the reference in float32",
             f"- {s['n']} test problems per batch size (templates never trained on), at most "
             f"{s['max_new_tokens']} new tokens, greedy; {s['rounds']} rounds after a warm-up, every "
             "(decoder, path) alternated, the order rotated each round",
             "- speed: the median over rounds of the paired ratio of round times against the engine's "
             "fastest AR (and HF's AR), 95 % interval over items resampled by template"]
    lines += [f"- {n}" for n in res.get("notes", [])] + [""]
    for bs in s["batches"]:
        rows = [r for r in res["records"] if r["batch"] == bs]
        base = res["engine_ar_path"][str(bs)]
        lines += [f"## Batch {bs}", "",
                  f"The engine's AR (the speeds' base): the `{base['engine']}` path; HF's: `{base['hf']}`.",
                  "",
                  "| decoder | path | ms per reply | tokens/s | tokens/forward | vs engine AR | vs HF AR | "
                  "= AR | accuracy |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            vs_hf = fmt_ci(r["speed_vs_hf"], r["speed_vs_hf_ci95"]) if "speed_vs_hf" in r else "—"
            lines.append(f"| {r['decoder']} | {r['path']} | {r['ms_per_reply']:.0f} | "
                         f"{r['tokens_per_s']:.1f} | {r['tokens_per_forward']:.2f} | "
                         f"{fmt_ci(r['speed_vs_engine_ar'], r['speed_vs_engine_ar_ci95'])} | {vs_hf} | "
                         f"{r['identical_to_ar']:.0%} | {r['accuracy']:.0%} |")
        lines.append("")
    lines += ["## The engine is the reference", "",
              "Untimed: each engine decoder run eagerly in the reference's dtype on the first "
              f"{s['n_check']} problems at batch 1 and 4; share of replies equal to the reference's:", ""]
    for path, d in res["equal_fp32"].items():
        lines.append(f"- {path}: " + ", ".join(f"{k} {v:.0%}" for k, v in d.items()))
    lines += ["", "The paper's 7B points in the figure (GSM8K, τ = 0.95, block cache, a GPU): " +
              ", ".join(f"batch {b} {v:.2f}x keeping {k:.0%}" for b, v, k in PAPER_7B) + ".", ""]
    return "\n".join(lines)


def write_speed_page(res, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_text(os.path.join(out_dir, "SPEED.md"), speed_page(res))
    shown = [b for b in (1, 4) if b in res["settings"]["batches"]] or res["settings"]["batches"][:1]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.2), squeeze=False)
    for ax, bs in zip(axes[0], shown):
        rows = [r for r in res["records"] if r["batch"] == bs and r["path"] in ("engine", "engine loop")]
        ar = {r["path"]: r["accuracy"] for r in rows if r["decoder"] == "ar"}
        for r in rows:
            kept = r["accuracy"] / ar[r["path"]] if ar[r["path"]] else float("nan")
            ax.scatter(r["speed_vs_engine_ar"], 100 * kept, marker="o" if r["path"] == "engine" else "s",
                       color="C0" if r["decoder"].startswith(("ar", "exact")) else "C1")
            ax.annotate(r["decoder"], (r["speed_vs_engine_ar"], 100 * kept), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        for b, v, k in PAPER_7B:
            ax.scatter(v, 100 * k, marker="x", color="grey")
            ax.annotate(f"paper 7B, batch {b}", (v, 100 * k), fontsize=7, color="grey", xytext=(3, -9),
                        textcoords="offset points")
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.set(title=f"batch {bs}: o engine, s engine loop; blue lossless, orange the τ rule",
               xlabel="speed against the engine's AR (x)", ylabel="accuracy kept, % of its path's AR")
        ax.title.set_fontsize(8)
    fig.tight_layout()
    tmp = os.path.join(out_dir, ".speed.png.tmp.png")
    fig.savefig(tmp, dpi=110, metadata={"Software": None})
    plt.close(fig)
    os.replace(tmp, os.path.join(out_dir, "speed.png"))


def rewrite(out_dir):
    """SPEED.md and speed.png again from speed.json alone (--speed --report)."""
    write_speed_page(json.load(open(os.path.join(out_dir, "speed.json"))), out_dir)
    print(f"{out_dir}: SPEED.md and speed.png rewritten from speed.json", flush=True)
