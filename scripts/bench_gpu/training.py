"""The train section: one optimizer step at the 0.5B shape (train.py's default losses, mars.ar_loss
and fast/window.py's windowed MARS loss, and fast/train.py's static step, eager and compiled), its
model FLOPs, MFU and peak memory against util/memory.py's estimate for configs/qwen2.5-0.5b-24gb.json."""

import re
from dataclasses import replace

import torch

from model import Qwen2, Qwen2Config, init_weights
from scripts.bench_gpu import common
from scripts.bench_gpu.common import empty_cache, peak_flops, timed


def train_section(out, budget):
    from settings import parse_settings
    from util.memory import estimate_memory

    S = parse_settings(["--config", "configs/qwen2.5-0.5b-24gb.json"])
    cfg = Qwen2Config(**common.RUN.shape)
    res = dict(
        config="configs/qwen2.5-0.5b-24gb.json",
        shape=common.RUN.model,
        micro_batch=S.micro_batch_size,
        row_tokens=common.RUN.row_tokens,
        estimate_GiB=estimate_memory(Qwen2Config(), S) / 2**30,
        rows=[],
    )
    # the static step compiled (fast/train.py, what train.py --compile=true runs) first: the
    # compiled rows are the ones that did not fit the budget before
    kinds = [("MARS static", True), ("AR static", True)]
    if common.RUN.device == "cuda":  # FlexAttention has no backward on the CPU
        kinds.append(("MARS static flex", True))
    kinds += [("MARS static, no checkpointing", True), ("AR", False), ("MARS", False), ("AR", True),
              ("MARS", True)]
    big = ", {} x {}".format(*common.RUN.big_step)  # the 40 % MFU target's shape on a GPU: 8 x 1024
    kinds += [("MARS static" + big, True), ("AR static" + big, True)]
    for kind, compiled in kinds:
        if budget.left() > (150 if compiled else 45):
            res["rows"].append(train_one(cfg, S, kind, compiled))
            empty_cache()
    out["train"] = res


def train_one(cfg, S, kind, compiled):
    """Warm-up step, then the fastest of common.RUN.timed_steps steps, their peak memory (on CUDA), the
    step's model FLOPs and MFU. kind: AR or MARS (mars.ar_loss, fast.window.mars_loss_windowed:
    train.py's default eager losses) or "AR static" / "MARS static" (fast/train.py);
    "MARS static flex": its attention by FlexAttention (fast/flex.py); ", no checkpointing": the
    activations kept (the peak to hold against the 24 GB config's 12 GiB target); ", 8 x 1024":
    that many rows of that many tokens (default: the config's micro-batch of RUN's rows)."""
    from fast.window import use_two_stream
    from util.memory import estimate_memory

    model = use_two_stream(init_weights(Qwen2(cfg), seed=0).to(common.RUN.device))  # as train.py's default
    name, flex = kind, "flex" in kind
    model.gradient_checkpointing = "no checkpointing" not in kind
    if flex:
        from fast.flex import use_flex

        use_flex(model)
    size = re.search(r", (\d+) x (\d+)", kind)  # rows x tokens, else the config's micro-batch x RUN's
    rows, T = (int(size[1]), int(size[2])) if size else (S.micro_batch_size, common.RUN.row_tokens)
    kind = kind.split(",")[0].replace(" flex", "")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids, labels, loss_of, flops = step_of(model, cfg, kind, flex, rows, T)
    loss_fn = torch.compile(loss_of, fullgraph=kind.endswith("static")) if compiled else loss_of

    def one_step():
        with torch.autocast(common.RUN.device, dtype=torch.bfloat16):
            loss = loss_fn(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # warm-up (compiles)
    cuda = common.RUN.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [timed(one_step)[0] for _ in range(common.RUN.timed_steps)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    peak_fl = peak_flops()
    # util/memory.py's estimate for this step (its formula is MARS's): the +-10 % target's other side
    shape = replace(S, micro_batch_size=rows, max_len=T, gradient_checkpointing=model.gradient_checkpointing)
    estimate = estimate_memory(cfg, shape, static=kind == "MARS static") / 2**30 if kind.startswith("MARS") \
        else None
    return dict(loss=name, compiled=compiled, ms=1000 * min(times), peak_GiB=peak, tflops=flops / 1e12,
                mfu=None if peak_fl is None else flops / min(times) / peak_fl, estimate_GiB=estimate)


def step_of(model, cfg, kind, flex, rows, T):
    """The step of train_one: (ids, labels) rows x T random tokens on RUN's device, the first
    quarter a prompt; the loss of `kind` (without its size and flex) as a function of them; its
    model FLOPs (util/flops.py: the reference's work, whichever loss runs)."""
    from fast.train import ar_loss_static, mars_loss_static, static_batch
    from fast.window import mars_loss_windowed, noisy_window
    from mars import IGNORE, ar_loss
    from util.flops import ar_step_flops, mars_step_flops

    device = common.RUN.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, common.RUN.ids_below, (rows, T), generator=g).to(device)
    labels = ids.clone()
    labels[:, : T // 4] = IGNORE  # a prompt of a quarter of the row (128 of 512 tokens), then the answer
    N, targets, W = ids.shape[0], int((labels[:, 1:] != IGNORE).sum()), noisy_window(labels.cpu(), 4)[1]
    flops = ar_step_flops(cfg, N, T, targets) if kind.startswith("AR") else \
        mars_step_flops(cfg, N, T, W, targets)
    # buckets of 128 tokens (512-token rows stay 512); a dry run's 32-token rows are not padded to 128
    x, y, window = static_batch(ids.cpu(), labels.cpu(), 0, 4, min(128, T))
    x, y, window = x.to(device), y.to(device), (window[0].to(device), window[1])

    def loss_of(ids, labels):
        if kind == "AR static":
            return ar_loss_static(model, x, y)
        if kind == "MARS static":
            return mars_loss_static(model, x, y, window, common.RUN.mask_id, 4, flex=flex)[0]
        if kind == "AR":
            return ar_loss(model, ids, labels)
        return mars_loss_windowed(model, ids, labels, common.RUN.mask_id, 4)[0]

    return ids, labels, loss_of, flops
