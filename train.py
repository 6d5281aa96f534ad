"""Train MARS: AR SFT, then MARS fine-tuning, on a CPU, one GPU or many (MARS_SPEC §2-§4, §7).

A run has two stages on the same data and hyper-parameters (§2, §7):
  ar    `ar_steps` of plain AR SFT (mars.ar_loss, the clean row alone)
  mars  `mars_steps` of MARS (mars.mars_loss: [clean | noisy] in one pass, §3-§4)
each with a fresh AdamW and its own cosine schedule with warm-up, the second starting
from the model the first left. Outputs, each a plain Qwen2 that transformers loads:
  out_dir/ar, out_dir/mars   config.json, model.safetensors, tokenizer files,
                             generation_config.json, mars.json (B, mask id, settings)
  out_dir/ckpt               latest resume point: the model + train_state.pt
  out_dir/log.jsonl, out_dir/loss.png

    python train.py                                     # the default: tiny model, synthetic data, CPU
    python train.py --config configs/qwen2.5-0.5b-24gb.json --init_from=DIR --data_dir=DIR
    torchrun --nproc_per_node=8 train.py --config configs/qwen2.5-7b-multigpu.json

Every setting is a field of `Settings` below; its defaults are the default run
(= configs/default.json). `--config FILE.json` and `--key=value` override them, in order.

Exact resume: the rows of step s are a pure function of (seed, stage, s) (`step_rows`:
epochs of permutations seeded by (seed, stage, epoch)), the loss has no randomness (100%
masking, §3), and a checkpoint holds the weights, the optimizer state and the position,
so a killed run continues as if never stopped (bit-exact on CPU). Checkpoints are built
in a temp dir and renamed into place (`replace_dir`); a NaN/inf loss or gradient stops
the run before the step is applied or saved.

Multi-process (torchrun, or any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR/PORT):
process r computes micro-batches r*accum .. r*accum+accum-1 of the step's global batch;
DDP (or FSDP2 with fsdp=true) averages the gradients, and the logged loss is all-reduced.
"""

import hashlib
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn as nn

from checkpoint import (
    gather,
    load_optimizer,
    read_log,
    recover_dir,
    replace_dir,
    write_checkpoint,
    write_release,
)
from data.prepare import load_npz
from mars import ar_loss, collate, mars_loss, pad_row
from memory import memory_parts
from model import Qwen2, Qwen2Config, init_weights

STAGES = ("ar", "mars")


@dataclass
class Settings:
    # data, model
    data_dir: str = "data/default"  # train.npz + val.npz (data/prepare.py); data/default is built if absent
    out_dir: str = "out/default"
    init_from: str = "scratch"  # "scratch" (the tiny model below) or an HF-layout Qwen2.5 directory
    tokenizer: str = ""  # dir; "" = data_dir/tokenizer if present, else init_from; "none" = ids below
    mask_id: int = -1  # -1 = the tokenizer's <|mask|> (§2)
    eos_id: int = -1  # -1 = the tokenizer's <|im_end|>
    pad_id: int = -1  # -1 = the tokenizer's <|endoftext|>
    n_layer: int = 4  # scratch model: layers, width, heads, kv heads, MLP width
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int = 2
    intermediate: int = 384
    vocab_size: int = 0  # scratch model: 0 = the tokenizer's (must exceed mask_id)
    init_std: float = 0.02
    # method (§3-§4)
    block_size: int = 4  # B
    w_ar: float = 1.0  # weight of L_AR; 0 = the "w/o L_AR" ablation
    bidirectional: bool = False  # noisy->noisy bidirectional inside a block: "Block Diffusion style"
    # optimisation (§7)
    ar_steps: int = 3000
    mars_steps: int = 4000
    epochs: float = 0.0  # > 0: each stage makes this many passes over train.npz (replaces *_steps)
    batch_size: int = 16  # rows per optimizer step, all processes and accumulation together
    micro_batch_size: int = 16  # rows per forward per process; accumulation = batch / (world * micro)
    max_len: int = 512  # longest row train.npz may hold (data/prepare.py --max-len)
    lr: float = 1e-3
    min_lr_frac: float = 0.0  # the cosine ends at lr * min_lr_frac
    warmup_frac: float = 0.03
    weight_decay: float = 0.1  # matrices only (not biases, norms)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    # logging, evaluation, checkpoints
    log_interval: int = 100
    eval_interval: int = 1000
    eval_rows: int = 256  # the fixed val subset: the first eval_rows rows of val.npz
    ckpt_interval: int = 500
    resume: bool = True  # continue from out_dir/ckpt if it exists; False = start over
    eval_at_end: bool = True  # evaluate.evaluate(out_dir/mars) at tau = 1 and 0.9 when done
    # system
    seed: int = 0
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # compute dtype (autocast); auto = bfloat16 on CUDA, float32 on CPU; weights fp32
    compile: bool = False  # torch.compile
    gradient_checkpointing: bool = False
    fsdp: bool = False  # under torchrun: FSDP2 fully_shard instead of DDP (7B)
    gpu_mem_gb: float = 0.0  # > 0: say whether estimate_memory fits this much


# settings that may differ when resuming (they do not change the trajectory's maths)
RESUME_FREE = {"data_dir", "out_dir", "init_from", "tokenizer", "log_interval", "eval_interval", "eval_rows",
               "ckpt_interval", "resume", "eval_at_end", "device", "compile", "gradient_checkpointing",
               "micro_batch_size", "gpu_mem_gb"}


def parse_settings(argv):
    """Settings from `--config FILE.json` (plain JSON; keys starting with "_" are comments)
    and `--key=value`, applied left to right over the defaults, typed like the defaults."""
    s, types = Settings(), {f.name: type(f.default) for f in fields(Settings)}

    def put(key, value, source, text):
        kind = types.get(key)
        if kind is None:
            raise SystemExit(f"{source}: unknown setting {key!r} (see Settings in train.py)")
        if text and kind is not str:  # from the command line: parse the text
            try:
                value = {"true": True, "1": True, "false": False, "0": False}[value.lower()] \
                    if kind is bool else kind(value)
            except (KeyError, ValueError):
                raise SystemExit(f"{source}: {key}={value!r} is not a {kind.__name__}") from None
        value = float(value) if kind is float and type(value) is int else value
        if type(value) is not kind:
            raise SystemExit(f"{source}: {key} must be a {kind.__name__}, got {value!r}")
        setattr(s, key, value)

    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--config" and args:
            a = "--config=" + args.pop(0)
        if not a.startswith("--") or "=" not in a:
            raise SystemExit(f"bad argument {a!r}: expected --key=value or --config FILE.json")
        key, value = a[2:].split("=", 1)
        if key != "config":
            put(key.replace("-", "_"), value, "command line", text=True)
            continue
        try:
            with open(value) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--config {value}: {e}") from None
        if not isinstance(cfg, dict):
            raise SystemExit(f"--config {value}: not a JSON object")
        for k, v in cfg.items():
            if not k.startswith("_"):
                put(k, v, value, text=False)
    if s.dtype not in ("auto", "float32", "bfloat16"):
        raise SystemExit(f"dtype must be auto, float32 or bfloat16, got {s.dtype!r}")
    for k in ("block_size", "batch_size", "micro_batch_size", "log_interval", "eval_interval",
              "ckpt_interval"):
        if getattr(s, k) < 1:
            raise SystemExit(f"{k} must be >= 1, got {getattr(s, k)}")
    return s


# ----------------------------------------------------------------------------- data
@lru_cache(maxsize=4)
def _epoch_perm(n, seed, stage, epoch):
    key = int.from_bytes(hashlib.sha256(repr((seed, stage, epoch)).encode()).digest()[:8], "little") >> 1
    return torch.randperm(n, generator=torch.Generator().manual_seed(key))


def step_rows(n, batch, seed, stage, step):
    """Row indices of optimizer step `step` of `stage`: samples step*batch .. (step+1)*batch-1
    of a sequence of epochs, epoch e a permutation of the n rows seeded by (seed, stage, e).
    A pure function of its arguments (no RNG state to save), every row once per epoch."""
    k = torch.arange(step * batch, (step + 1) * batch)
    out = torch.empty(batch, dtype=torch.long)
    for e in (k // n).unique().tolist():
        out[k // n == e] = _epoch_perm(n, seed, stage, e)[k[k // n == e] % n]
    return out


def make_batch(d, rows, S, ids, device):
    """Rows of a prepared file -> ids, labels (N, l), EOS-padded to a multiple of B then
    right-padded (mars.pad_row, mars.collate, §2), and the number of tokens before padding."""
    off, padded = d["offsets"], []
    for i in rows.tolist():
        a, b = int(off[i]), int(off[i + 1])
        padded.append(pad_row(d["ids"][a:b].tolist(), d["loss"][a:b].astype(bool).tolist(), S.block_size,
                              ids["eos"]))
    return *collate(padded, ids["pad"], device), sum(len(r[0]) for r in padded)


def fingerprint(d):
    h = hashlib.blake2b(digest_size=8)
    for k in ("ids", "loss", "offsets"):
        h.update(d[k].tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- model, loss, optimizer
class StageLoss(nn.Module):
    """The stage's loss as the forward of a module that owns the model: (loss, l_mask, l_ar).
    mars_loss and ar_loss call model.hidden / model.lm_head, not model.forward, and DDP and
    FSDP act only on calls of the module they wrap; so they wrap this one."""

    def __init__(self, model, S, mask_id):
        super().__init__()
        self.model, self.S, self.mask_id, self.stage = model, S, mask_id, "ar"

    def forward(self, ids, labels):
        if self.stage == "ar":  # plain AR SFT (§2): no noisy stream, so no L_mask
            loss = ar_loss(self.model, ids, labels)
            return loss, torch.full_like(loss, math.nan).detach(), loss.detach()
        S = self.S
        return mars_loss(self.model, ids, labels, self.mask_id, S.block_size, S.w_ar, S.bidirectional)


def lr_at(step, total, S):
    """Linear warm-up over warmup_frac of the stage (§7: 3%), then cosine to lr * min_lr_frac."""
    warm = math.ceil(S.warmup_frac * total)
    if step < warm:
        return S.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return S.lr * (S.min_lr_frac + (1 - S.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(net, S, device):
    ps = list(net.parameters())
    groups = [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": S.weight_decay},
              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" and not S.fsdp else {"foreach": True}
    return torch.optim.AdamW(groups, lr=S.lr, betas=(S.beta1, S.beta2), **kw)


def plot_losses(S, totals):
    """out_dir/loss.png from log.jsonl: loss, L_mask, L_AR and val loss over both stages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(os.path.join(S.out_dir, "log.jsonl"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, key, style in (("train", "loss", "-"), ("train", "l_mask", ":"), ("train", "l_ar", "--"),
                             ("val", "val_loss", "o-")):
        pts = [(r["step"] + (totals["ar"] if r["stage"] == "mars" else 0), r[key]) for stage in STAGES
               for r in recs + [{"kind": kind, "stage": stage, "step": 0, key: math.nan}]  # NaN: a gap
               if r["kind"] == kind and r["stage"] == stage and r.get(key) is not None]
        if any(not math.isnan(y) for _, y in pts):
            ax.plot(*zip(*pts), style, label=key, markersize=3)
    ax.axvline(totals["ar"], color="gray", lw=0.8)
    ax.set(xlabel="optimizer step (AR SFT, then MARS)", ylabel="loss", yscale="log")
    ax.legend()
    fig.savefig(os.path.join(S.out_dir, "loss.png.tmp"), format="png", dpi=100)
    plt.close(fig)
    os.replace(os.path.join(S.out_dir, "loss.png.tmp"), os.path.join(S.out_dir, "loss.png"))


# ----------------------------------------------------------------------------- training
def setup_device(S):
    """(rank, world, device); under torchrun also the process group (nccl on CUDA, gloo on CPU)."""
    name = ("cuda" if torch.cuda.is_available() else "cpu") if S.device == "auto" else S.device
    if "RANK" not in os.environ:
        return 0, 1, torch.device(name)
    cuda = name.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def special_ids(S):
    """(tokenizer or None, {"mask", "eos", "pad"}): the tokenizer's ids unless set in S."""
    path = S.tokenizer or next((p for p in (os.path.join(S.data_dir, "tokenizer"), S.init_from)
                                if p != "scratch" and os.path.isdir(p)), "none")
    tok = None
    if path != "none":
        from tokenizer import Tokenizer

        tok = Tokenizer.from_dir(path)
    ids = {k: getattr(S, f"{k}_id") if getattr(S, f"{k}_id") >= 0 else getattr(tok, f"{k}_id", None)
           for k in ("mask", "eos", "pad")}
    for k, v in ids.items():
        if v is None:
            raise SystemExit(f"no tokenizer (tokenizer={path!r}): set --{k}_id")
    return tok, ids


def initial_model(S, tok, ids):
    """The model a fresh run starts from: a new Qwen2 of the scratch settings, or init_from."""
    if S.init_from == "scratch":
        cfg = Qwen2Config(vocab_size=S.vocab_size or (tok.vocab_size if tok else max(ids.values()) + 1),
                          hidden_size=S.n_embd, intermediate_size=S.intermediate, num_hidden_layers=S.n_layer,
                          num_attention_heads=S.n_head, num_key_value_heads=S.n_kv_head,
                          max_position_embeddings=2 * S.max_len + 64, eos_token_id=ids["eos"])
        return init_weights(Qwen2(cfg), S.init_std, S.seed)
    if not os.path.isdir(S.init_from):
        raise SystemExit(f"init_from={S.init_from!r}: neither 'scratch' nor a directory")
    return Qwen2.from_pretrained(S.init_from)


@torch.no_grad()
def val_loss(runner, net, val, S, ids, rank, world, device, amp):
    """Mean loss of the stage over the first eval_rows val rows (the same rows every time)."""
    n = min(S.eval_rows, len(val["offsets"]) - 1) // world * world
    acc = torch.zeros(2, device=device)
    net.train(False)
    for part in torch.arange(rank * n // world, (rank + 1) * n // world).split(S.micro_batch_size):
        x, y, _ = make_batch(val, part, S, ids, device)  # the same number of forwards on every rank
        with amp:
            acc += torch.stack([runner(x, y)[0].float() * len(part), torch.tensor(float(len(part)),
                                                                                device=device)])
    net.train(True)
    if world > 1:
        dist.all_reduce(acc)
    return (acc[0] / acc[1]).item() if n else None


def main(argv=None):
    S = parse_settings(sys.argv[1:] if argv is None else argv)
    rank, world, device = setup_device(S)
    try:
        train(S, rank, world, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(S, rank, world, device):
    say = print if rank == 0 else (lambda *a: None)
    accum, mb = S.batch_size // (world * S.micro_batch_size), S.micro_batch_size
    if S.batch_size % (world * mb):
        raise SystemExit(f"batch_size={S.batch_size} is not a multiple of {world} process(es) x "
                         f"micro_batch_size={mb}")
    # ---- data and special ids; the default data set is generated on first use
    if not all(os.path.isfile(os.path.join(S.data_dir, f"{k}.npz")) for k in ("train", "val")):
        if S.data_dir != Settings.data_dir:
            raise SystemExit(f"{S.data_dir}: no train.npz / val.npz (make them with data/prepare.py)")
        if rank == 0:
            from data.synthetic import build_default

            say(f"building the default data set in {S.data_dir}")
            build_default(S.data_dir, S.seed)
        if world > 1:
            dist.barrier()
    data = {k: load_npz(os.path.join(S.data_dir, f"{k}.npz")) for k in ("train", "val")}
    off = data["train"]["offsets"]
    n_train = len(off) - 1
    if n_train == 0 or int((off[1:] - off[:-1]).max()) > S.max_len:
        raise SystemExit(f"{S.data_dir}/train.npz: empty, or a row is longer than max_len={S.max_len}")
    tok, ids = special_ids(S)
    totals = {"ar": S.ar_steps, "mars": S.mars_steps}
    if S.epochs > 0:
        totals = dict.fromkeys(STAGES, math.ceil(S.epochs * n_train / S.batch_size))
    # ---- the resume point (recovered first, should a kill have cut a save short)
    ckpt, log_path, data_id = os.path.join(S.out_dir, "ckpt"), os.path.join(S.out_dir, "log.jsonl"), \
        fingerprint(data["train"])
    if rank == 0:
        os.makedirs(S.out_dir, exist_ok=True)
        recover_dir(ckpt)
    if world > 1:
        dist.barrier()
    state = None
    if S.resume and os.path.isdir(ckpt):  # mmap: ranks that never read the optimizer state pay nothing
        state = torch.load(os.path.join(ckpt, "train_state.pt"), map_location="cpu", weights_only=True,
                           mmap=True)
        diff = [f"{k}: {state['settings'].get(k)!r} -> {v!r}" for k, v in asdict(S).items()
                if k not in RESUME_FREE and state["settings"].get(k) != v]
        diff += ["the content of train.npz"] if state["data"] != data_id else []
        if diff:
            raise SystemExit(f"{ckpt} belongs to a run with different settings ({'; '.join(diff)}); "
                             "use another out_dir, or --resume=false to start over in this one")
        say(f"resuming from {ckpt}: {state['stage']} step {state['step']}")
    # ---- the model
    if state is not None:
        model = Qwen2.from_pretrained(ckpt)
    else:
        model = initial_model(S, tok, ids)
    cfg = model.config
    top = max(ids["mask"], int(data["train"]["ids"].max()), int(data["val"]["ids"].max(initial=0)))
    if cfg.vocab_size <= top:
        raise SystemExit(f"vocab_size={cfg.vocab_size} must exceed every id used: mask_id={ids['mask']}, "
                         f"largest={top}")
    eos_ids = [ids["eos"], getattr(tok, "endoftext_id", None)]
    eos_ids += cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    eos_ids = [e for e in dict.fromkeys(eos_ids) if e is not None]
    model.to(device)
    model.gradient_checkpointing = S.gradient_checkpointing
    dtype_name = S.dtype if S.dtype != "auto" else "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    say(f"model: {model.num_params() / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers, vocab "
        f"{cfg.vocab_size}; {n_train} train rows; {world} process(es) on {device}, {dtype_name}")
    if device.type == "cuda" or S.gpu_mem_gb > 0:
        parts = memory_parts(cfg, replace(S, dtype=dtype_name), world)
        total = sum(parts.values())
        verdict = f"{'fits' if total <= S.gpu_mem_gb * 2**30 else 'does NOT fit'} in {S.gpu_mem_gb:g} GiB"
        say("estimated peak memory per process, GiB: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in
            parts.items()) + f" = {total / 2**30:.2f}" + (f": {verdict}" if S.gpu_mem_gb > 0 else ""))
    net = StageLoss(model, S, ids["mask"])
    amp = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    if world > 1 and S.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 casts the gathered weights (instead of autocast) and reduces gradients in fp32
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(net, mp_policy=mp)
        amp = nullcontext()
    runner = torch.compile(net) if S.compile else net
    if world > 1 and not S.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(runner, device_ids=[device.index] if device.type == "cuda" else None)
    # ---- log.jsonl; on resume, records past the checkpoint belong to steps that will be redone
    if rank == 0:
        here = (STAGES.index(state["stage"]), state["step"]) if state is not None else (-1, 0)
        recs = [r for r in read_log(log_path) if (STAGES.index(r["stage"]), r["step"]) <= here]
        with open(log_path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        os.replace(log_path + ".tmp", log_path)
        log_file = open(log_path, "a")

    def log(rec):
        if rank == 0:
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()

    # ---- the two stages, each with a fresh AdamW and its own schedule
    first, first_step = (state["stage"], state["step"]) if state is not None else ("ar", 0)
    t_last, dt_avg = time.time(), None
    for si, stage in enumerate(STAGES):
        start, total = (first_step if stage == first else 0), totals[stage]
        if si < STAGES.index(first) or start >= total:
            continue  # done before the checkpoint, or a stage of 0 steps
        opt = make_optimizer(net, S, device)
        if start > 0:
            load_optimizer(net, opt, S, state["optimizer"], rank)
        net.stage = stage
        say(f"{stage} stage: steps {start + 1}..{total}, {S.batch_size} rows per step ({world} process(es) x "
            f"{accum} micro-batch(es) of {mb}), lr {S.lr:g}")
        for step in range(start, total):
            lr = lr_at(step, total, S)
            for g in opt.param_groups:
                g["lr"] = lr
            rows = step_rows(n_train, S.batch_size, S.seed, stage, step)  # the global batch
            acc = torch.zeros(4, device=device)  # loss, l_mask, l_ar, tokens of this process
            for m in range(accum):  # this process's micro-batches: slots rank * accum + m
                k, last = rank * accum + m, m == accum - 1
                x, y, n_tok = make_batch(data["train"], rows[k * mb:(k + 1) * mb], S, ids, device)
                if S.fsdp and world > 1:
                    net.set_requires_gradient_sync(last)
                with runner.no_sync() if world > 1 and not S.fsdp and not last else nullcontext():
                    with amp:
                        loss, l_mask, l_ar = runner(x, y)  # means over this micro-batch's rows
                    (loss / accum).backward()  # DDP / FSDP average the gradients over processes
                acc += torch.stack([loss.detach().float() / accum, l_mask.float() / accum,
                                    l_ar.float() / accum, torch.tensor(float(n_tok), device=device)])
            gnorm = torch.nn.utils.clip_grad_norm_(net.parameters(), S.grad_clip or math.inf)
            gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
            if world > 1:
                dist.all_reduce(acc)
                acc[:3] /= world
            loss_v, l_mask_v, l_ar_v, tokens = acc.tolist()
            if not (math.isfinite(loss_v) and math.isfinite(gnorm)):
                what = f"loss {loss_v}" if not math.isfinite(loss_v) else f"gradient norm {gnorm}"
                raise SystemExit(f"non-finite {what} at {stage} step {step + 1} (lr {lr:.3g}): stopped "
                                 f"before applying or saving it; the last good checkpoint is {ckpt}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            done, now = step + 1, time.time()
            dt, t_last = now - t_last, now
            dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
            if done % S.log_interval == 0 or done in (1, total):  # the same steps after a resume
                fin = lambda v: v if math.isfinite(v) else None  # no L_mask in AR, no L_AR at w = 0
                log({"kind": "train", "stage": stage, "step": done, "loss": loss_v, "l_mask": fin(l_mask_v),
                     "l_ar": fin(l_ar_v), "lr": lr, "grad_norm": gnorm, "tok_s": tokens / dt})
                show = lambda v: f"{v:.4f}" if math.isfinite(v) else "-"
                left = total - done + sum(totals[s] for s in STAGES[si + 1:])
                say(f"{stage:4s} step {done:6d}/{total} | loss {loss_v:.4f} (L_mask {show(l_mask_v)}, L_AR "
                    f"{show(l_ar_v)}) | lr {lr:.2e} | {tokens / dt:8.0f} tok/s | {1000 * dt:5.0f} ms | "
                    f"ETA {dt_avg * left / 60:.1f} min")
            if done % S.eval_interval == 0 or done == total:
                v = val_loss(runner, net, data["val"], S, ids, rank, world, device, amp)
                if v is not None:
                    log({"kind": "val", "stage": stage, "step": done, "val_loss": v})
                    say(f"{stage:4s} step {done:6d} | val loss {v:.4f}")
                if rank == 0:
                    plot_losses(S, totals)
            if done % S.ckpt_interval == 0 or done == total:
                model_full, osd = gather(net, opt, S, cfg, rank)
                if rank == 0:
                    if done == total:  # the release first: a checkpoint at the end means "stage done"
                        replace_dir(os.path.join(S.out_dir, stage), write_release, model_full, S, ids, tok,
                                    stage, eos_ids)
                        say(f"saved {os.path.join(S.out_dir, stage)}")
                    replace_dir(ckpt, write_checkpoint, model_full, osd, S, stage, done, data_id)
                    log({"kind": "ckpt", "stage": stage, "step": done})
                if world > 1:
                    dist.barrier()
    if rank == 0:
        log_file.close()
    if S.eval_at_end and rank == 0 and totals["mars"] > 0:
        import importlib.util

        if importlib.util.find_spec("evaluate") is None:
            return say("eval_at_end: no evaluate.py, no evaluation")
        import evaluate

        result = evaluate.evaluate(os.path.join(S.out_dir, "mars"), S.data_dir, taus=(1.0, 0.9),
                                   block_size=S.block_size, device=str(device))
        with open(os.path.join(S.out_dir, "eval.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
