"""The page: results/GPU.md and results/gpu.json, rewritten after each section (`Budget.save`), so
a run cut short keeps what it measured."""

import json
import time

from scripts.bench_gpu.decode import ar_of
from util.atomic import atomic_write


class Budget:
    def __init__(self, minutes, path):
        self.end, self.path = time.perf_counter() + 60 * minutes, path

    def left(self):
        return self.end - time.perf_counter()

    def save(self, out):
        slim = json.loads(json.dumps(out, default=str))
        for r in slim.get("decode", {}).get("rows", []):
            r.pop("ids", None)
        atomic_write(self.path + ".json", lambda f: json.dump(slim, f, indent=1))
        atomic_write(self.path + ".md", lambda f: f.write(page(slim)))


def page(out):
    lines = ["# GPU results (python -m scripts.bench_gpu)", "", out.get("machine", ""), ""]
    d = out.get("decode")
    if d:
        lines += decode_page(d)
    lines += check_lines(out.get("exact", []) + out.get("alone", []))
    t = out.get("train")
    if t:
        lines += [
            "",
            f"## Training step: {t.get('shape', '0.5B shape')}, {t['micro_batch']} rows x "
            f"{t['row_tokens']} tokens, bf16, "
            f"gradient checkpointing unless the row says not (estimate for {t['config']}: "
            f"{t['estimate_GiB']:.1f} GiB)",
            "",
            "| loss | compiled | ms/step | model TFLOP | MFU | x AR (same kind) | peak GiB | estimate GiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        ar = {(r["loss"], r["compiled"]): r["ms"] for r in t["rows"] if r["loss"].startswith("AR")}
        lines += [
            f"| {r['loss']} | {r['compiled']} | {r['ms']:.0f} | {r.get('tflops', float('nan')):.2f} | "
            + (f"{100 * r['mfu']:.1f} % | " if r.get("mfu") is not None else "- | ")
            + (f"{r['ms'] / ar[ar_kind(r), r['compiled']]:.2f} | " if (ar_kind(r), r["compiled"]) in ar
               else "- | ")
            + (f"{r['peak_GiB']:.2f} |" if r["peak_GiB"] is not None else "- |")
            + (f" {r['estimate_GiB']:.2f} |" if r.get("estimate_GiB") is not None else " - |")
            for r in t["rows"]
        ]
    m = out.get("main")
    if m:
        lines += (
            [
                "",
                f"## Main job: {m.get('command', 'python train.py --device=cuda')}: "
                f"{m['seconds'] / 60:.1f} min, "
                f"exit {m['returncode']}",
                "",
                "```",
            ]
            + m["last_lines"]
            + ["```"]
        )
    lines += toy_page(out.get("toy"))
    lines += [f"- section {k} failed: {v}" for k, v in out.get("errors", {}).items()]
    lines += [
        "",
        f"Sections not reached in the time budget: {', '.join(out.get('skipped', [])) or 'none'}",
        "",
    ]
    return "\n".join(lines)


def ar_kind(r):
    """The AR training row a row is held against: "MARS static flex" and "MARS static, no
    checkpointing" against "AR static", "MARS static, 8 x 1024" against "AR static, 8 x 1024",
    "MARS" against "AR"."""
    return r["loss"].replace(" flex", "").replace(", no checkpointing", "").replace("MARS", "AR")


def decode_page(d):
    """The decode table (steady state: the forwards after the prefill) and the issue-49 targets."""
    bw = d["bandwidth"]
    lines = [
        f"## Decoding: {d['model']}, {d['params'] / 1e6:.0f}M params ({d['weight_bytes'] / 1e9:.2f} GB), "
        f"{d['new_tokens']} new tokens, greedy",
        "",
        "ms/forward: the whole request over its forwards; steady: the forwards after the prefill; x AR: "
        "steady, against the AR row of the same kind (eager, compiled step loop, device loop); % of "
        "bandwidth: the weights read once per steady forward; syncs per token per row, kernels per "
        "forward: one more run, observed (the device loops, the compiled AR and exact K = 2 step loops).",
        "",
        "| batch | decoder | tokens/s | ms/forward | steady ms/forward | x AR | tokens/forward | "
        "% of bandwidth | syncs/token | kernels/forward | recompiles after warm-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ar = ar_of(d["rows"])
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for r in sorted(d["rows"], key=lambda r: r["batch"]):
        steady = r.get("steady_ms_per_forward")
        a = ar(r)
        a_steady = a.get("steady_ms_per_forward") if a else None
        x_ar = steady / a_steady if steady and a_steady else None
        pct = 100 * d["weight_bytes"] / (steady / 1000) / bw if bw and steady else None
        lines.append(f"| {r['batch']} | {r['decoder']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ms_per_forward']:.2f} | {fmt(steady, '.2f')} | {fmt(x_ar, '.2f')} | "
                     f"{r['tokens_per_forward']:.2f} | {fmt(pct, '.1f')} | "
                     f"{fmt(r.get('syncs_per_token'), '.2f')} | {fmt(r.get('kernels_per_forward'), '.0f')} | "
                     f"{r.get('recompiles_after_warmup', '-')} |")
    return lines + [""] + target_lines(d["rows"]) + [""]


def target_lines(rows):
    """Issue 49's targets, read off the rows: the AR device loop's steady tokens/s against HF's static
    cache at each batch, and the exact K = 2 and window device steps against the AR device step."""
    by = {(r["decoder"], r["batch"]): r for r in rows}
    lines = []
    for (name, batch), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        if name != "AR device loop compiled" or not r.get("steady_ms_per_forward"):
            continue
        ms = r["steady_ms_per_forward"]
        rate = 1000 * batch / ms
        hf = by.get(("HF generate (static cache)", batch))
        vs = f", {rate / (1000 * batch / hf['steady_ms_per_forward']):.2f}x HF's static cache" if hf else ""
        steps = [f"{k} {by[k + ' device loop compiled', batch]['steady_ms_per_forward'] / ms:.2f}x"
                 for k in ("exact K=2", "exact K=4", "tau=0.95 window")
                 if (k + " device loop compiled", batch) in by]
        lines.append(f"- batch {batch}: AR device loop {rate:.0f} tokens/s steady{vs}; a device step against "
                     f"its AR step: {', '.join(steps) or '-'}")
    return lines


def toy_page(t):
    if not t:
        return []
    lines = [
        "",
        f"## Decoding the trained toy: {t['model']}, {t['params'] / 1e6:.1f}M params, the test prompts "
        f"to EOS or {t['new_tokens']} tokens, greedy",
        "",
        "| batch | decoder | tokens/s | x AR tokens/s | ms/forward | x AR ms/forward | tokens/forward "
        "| recompiles after warm-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ar = ar_of(t["rows"])
    for r in sorted(t["rows"], key=lambda r: r["batch"]):
        a = ar(r)
        x_tok = f"{r['tokens_per_s'] / a['tokens_per_s']:.2f}" if a else "-"
        x_ms = f"{r['ms_per_forward'] / a['ms_per_forward']:.2f}" if a else "-"
        lines.append(f"| {r['batch']} | {r['decoder']} | {r['tokens_per_s']:.0f} | {x_tok} | "
                     f"{r['ms_per_forward']:.2f} | {x_ms} | {r['tokens_per_forward']:.2f} | "
                     f"{r.get('recompiles_after_warmup', '-')} |")
    lines.append("")
    return lines + check_lines(t.get("exact", []))


def check_lines(checks):
    return [f"- {c['check']}, batch {c['batch']}: {c['rows_equal']}/{c['rows']} rows identical"
            for c in checks]
