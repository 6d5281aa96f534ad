"""The main job (python train.py --device=cuda, the toy) and the toy section, which decodes the
checkpoint the main job wrote."""

import os
import subprocess
import sys
import time

import torch

from exact import generate_exact
from generate import generate, generate_ar
from scripts.bench_gpu import common
from scripts.bench_gpu.common import engine
from scripts.bench_gpu.decode import exact_checks, run_ours


def toy_section(args, out, budget, work):
    """The main job's MARS checkpoint (the toy, trained a minute ago by section main) decoding
    the toy's test prompts, bf16, to EOS or 96 tokens: AR, the τ = 0.9 window and exact K = 2,
    eager and compiled, at each batch size. Here the drafts are trained, so tokens per forward
    show as tokens per second (the random 0.5B model's drafts are noise)."""
    from checkpoint import load_checkpoint
    from data.synthetic import read_jsonl

    path = os.path.join(work, "out", "mars")
    if not os.path.isdir(path):
        raise RuntimeError(f"no checkpoint at {path}: the toy section needs section main before it")
    ck = load_checkpoint(path, common.RUN.device, torch.bfloat16)
    (model, step), B = engine(ck.model), ck.block_size
    new = common.RUN.toy_tokens or args.new_tokens
    problems = read_jsonl(os.path.join("data", "default", "test.jsonl"))[: 2 * max(args.batch_sizes)]
    chats = [ck.tok.encode_chat(x["messages"][:-1], add_generation_prompt=True) for x in problems]
    kw = dict(block_size=B, mask_id=ck.mask_id, eos_ids=ck.eos_ids)
    decs = {
        "AR": lambda p, n: generate_ar(model, p, n, ck.eos_ids),
        "tau=0.9 window": lambda p, n: generate(model, p, tau=0.9, max_new_tokens=n, **kw),
        "exact K=2": lambda p, n: generate_exact(model, p, drafts=2, max_new_tokens=n, **kw),
    }
    out["toy"] = dict(model=f"the main job's MARS checkpoint (B = {B}), bf16", params=model.num_params(),
                      new_tokens=new, rows=[])
    rows = out["toy"]["rows"]
    for compiled in (None, step):
        for batch in args.batch_sizes:
            for name, dec in decs.items():
                if budget.left() > (90 if compiled else 30):
                    p = chats[batch : 2 * batch]  # the prompts after the first `batch`: a new batch
                    run_ours(model, compiled, name, dec, p, new, rows)
        budget.save(out)
    out["toy"]["exact"] = exact_checks(rows)


def main_job_section(out, budget, d):
    """python train.py into d/out (the toy section decodes its checkpoint)."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "train.py", f"--device={common.RUN.device}", f"--out_dir={d}/out"]
        + common.RUN.main_flags,
        capture_output=True,
        text=True,
        timeout=max(60, budget.left()),
    )
    out["main"] = dict(
        command=" ".join(["python"] + r.args[1:]).replace(d, "TMP"),
        seconds=time.perf_counter() - t0,
        returncode=r.returncode,
        last_lines=r.stdout.strip().splitlines()[-4:] + r.stderr.strip().splitlines()[-2:],
    )
