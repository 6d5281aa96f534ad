"""Train MARS: AR SFT, then MARS fine-tuning, on a CPU, one GPU or many (docs/spec.md §2-§4, §7).

Two stages on the same data and hyper-parameters (§2, §7), each with a fresh AdamW and its own
cosine schedule with warm-up: `ar_steps` of plain AR SFT (mars.ar_loss), then `mars_steps` of MARS
(mars.mars_loss, §3-§4; by default its equal, faster form from the engine: stage_losses). Outputs:
out_dir/ar and out_dir/mars (plain Qwen2s that transformers loads, with mars.json), out_dir/ckpt
(the resume point: a killed run continues bit-exactly on the CPU), log.jsonl and loss.png.

    python train.py                                     # the default: tiny model, synthetic data, CPU
    python train.py --fast_loss=false                   # the same run by the textbook forward
    python train.py --config configs/qwen2.5-0.5b-24gb.json --init_from=DIR --data_dir=DIR
    torchrun --nproc_per_node=8 train.py --config configs/qwen2.5-7b-multigpu.json

Every setting is a field of `Settings` (settings.py); its defaults are the default run
(= configs/default.json). `--config FILE.json` and `--key=value` override them, in order.
Resume, processes, precision and the engine's forms: docs/training.md.
"""

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from checkpoint import gather, load_optimizer, load_train_state, write_checkpoint, write_release
from data.batches import batch_rows, fingerprint, make_batch, make_teacher
from data.prepare import load_npz
from mars import ar_loss, inverse_t_weights, mars_loss
from model import Qwen2, Qwen2Config, init_weights
from settings import RESUME_FREE, Settings, parse_settings
from util.atomic import recover_dir, replace_dir, write_json
from util.files import USER_ERRORS, error_line
from util.memory import memory_parts, needs_checkpointing
from util.precision import autocast, choose_dtype, dtype_name, weight_dtype
from util.runlog import STAGES, RunLog, plot_losses


# ----------------------------------------------------------------------------- model, loss, optimizer
class StageLoss(nn.Module):
    """The stage's loss (stage_losses' ar_fn or mars_fn) as the forward of a module that owns the
    model: DDP and FSDP act only on calls of the module they wrap (the losses call model.hidden)."""

    def __init__(self, model, ar_fn, mars_fn):
        super().__init__()
        self.model, self.ar_fn, self.mars_fn, self.stage = model, ar_fn, mars_fn, "ar"

    def forward(self, batch, row_weight=None):
        """step_batch's batch, row_t_weights' row_weight -> (loss, l_mask, l_ar)."""
        if self.stage == "ar":  # plain AR SFT (§2): no noisy stream, so no L_mask
            loss = self.ar_fn(self.model, batch["ids"], batch["labels"], batch["ar_teacher"])
            return loss, torch.full_like(loss, math.nan).detach(), loss.detach()
        return self.mars_fn(self.model, **batch, noisy_row_weight=row_weight)


def stage_losses(S, model, special, device):
    """(ar_fn, mars_fn, layout): the stages' losses and the layout of a micro-batch they read (None:
    step_batch's). The one place train.py uses the engine (fast/), as nanoGPT compiles in one block;
    each engine loss gives the reference's loss and gradients (tests/test_fast_*.py):
      fast_loss = false  mars.ar_loss, mars.mars_loss: the textbook forward of §3-§4
      fast_loss = true   the MARS forward over the two-stream window (fast/window.py; the model's
                         attention swapped for one that reads its mask), the default
      + compile = true   the static step (fast/train.py; static_step): rows and the window
                         bucketed on the host, the LM head chunked; flex_attention on top"""
    if S.flex_attention and device.type != "cuda":
        raise SystemExit("flex_attention=true needs CUDA: FlexAttention has no backward on the CPU")
    method = dict(mask_id=special["mask"], block_size=S.block_size, w=S.w_ar, bidirectional=S.bidirectional)
    if not S.fast_loss:
        return ar_loss, partial(mars_loss, **method), None
    from fast.window import mars_loss_windowed, use_two_stream  # the engine, only from here

    use_two_stream(model)
    if not static_step(S):
        return ar_loss, partial(mars_loss_windowed, **method), None
    from fast.flex import use_flex
    from fast.train import ar_loss_static, mars_loss_static, static_layout

    if S.flex_attention:
        use_flex(model)
    # one graph per bucketed shape (fast/train.py: ~21 at 512 tokens, x2 for val)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    layout = partial(static_layout, pad_id=special["pad"], block_size=S.block_size, bucket=S.bucket)
    return ar_loss_static, partial(mars_loss_static, **method, flex=S.flex_attention), layout


def row_t_weights(S, stage, step, slot, n, device):
    """The 1/t of each of the n rows of micro-batch `slot` of a MARS step when inv_t_weight
    (mars.inverse_t_weights, §4), else None; seeded by (seed, step, slot), a tuple of ints whose
    hash is fixed: a resumed run, or the same slot on another process, draws the same t."""
    if not (S.inv_t_weight and stage == "mars"):
        return None
    return inverse_t_weights(n, torch.Generator().manual_seed(hash((S.seed, step, slot)))).to(device)


def keep_mask_row(model, mask_id):
    """freeze_vocab (beyond the paper; docs/training.md), after every backward: zero the
    embedding's (and a tied head's) gradient outside the mask token's row, the one row MARS gives
    a new use (§2); an untied head takes no gradient at all (build_model)."""
    g = model.model.embed_tokens.weight.grad
    if g is not None:
        g[:mask_id].zero_()
        g[mask_id + 1:].zero_()


def lr_at(step, total, S):
    """Linear warm-up over warmup_frac of the stage (§7: 3%), then cosine to lr * min_lr_frac."""
    warm = math.ceil(S.warmup_frac * total)
    if step < warm:
        return S.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return S.lr * (S.min_lr_frac + (1 - S.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(net, S, device):
    ps = [p for p in net.parameters() if p.requires_grad]
    # a frozen vocabulary matrix gets no decay either (AdamW decays a parameter whose gradient is 0)
    vocab = net.model.model.embed_tokens.weight if S.freeze_vocab else None
    groups = [{"params": [p for p in ps if p.dim() >= 2 and p is not vocab], "weight_decay": S.weight_decay},
              {"params": [p for p in ps if p.dim() < 2 or p is vocab], "weight_decay": 0.0}]
    # fused: one kernel for the whole update, on the CPU too (torch >= 2.4): 5 % of the main
    # job's time on 2 cores (results/SPEED.md); FSDP's sharded parameters take foreach
    kw = {"fused": True} if not S.fsdp else {"foreach": True}
    return torch.optim.AdamW(groups, lr=S.lr, betas=(S.beta1, S.beta2), **kw)


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
    special = {k: getattr(S, f"{k}_id") if getattr(S, f"{k}_id") >= 0 else getattr(tok, f"{k}_id", None)
               for k in ("mask", "eos", "pad")}
    for k, v in special.items():
        if v is None:
            raise SystemExit(f"no tokenizer (tokenizer={path!r}): set --{k}_id")
    return tok, special


def initial_model(S, tok, special):
    """The model a fresh run starts from: a new Qwen2 of the scratch settings, or init_from."""
    if S.init_from == "scratch":
        cfg = Qwen2Config(vocab_size=S.vocab_size or (tok.vocab_size if tok else max(special.values()) + 1),
                          hidden_size=S.n_embd, intermediate_size=S.intermediate, num_hidden_layers=S.n_layer,
                          num_attention_heads=S.n_head, num_key_value_heads=S.n_kv_head,
                          max_position_embeddings=2 * S.max_len + 64, eos_token_id=special["eos"])
        return init_weights(Qwen2(cfg), S.init_std, S.seed)
    if not os.path.isdir(S.init_from):
        raise SystemExit(f"init_from={S.init_from!r}: neither 'scratch' nor a directory")
    return Qwen2.from_pretrained(S.init_from)


@torch.no_grad()
def val_loss(r):
    """(loss, L_mask, L_AR): the stage's mean loss and its two parts over the first eval_rows val rows
    (the same rows every time); L_mask is NaN in the AR stage. None without val rows."""
    S, world, val = r.S, r.world, r.data["val"]
    n = min(S.eval_rows, len(val["offsets"]) - 1) // world * world
    acc = torch.zeros(4, dtype=torch.float64, device=r.device)
    r.net.train(False)
    for part in torch.arange(r.rank * n // world, (r.rank + 1) * n // world).split(S.micro_batch_size):
        batch, _ = step_batch(r, val, part)  # the same on every rank
        with r.amp:
            n_part = torch.tensor(float(len(part)), dtype=torch.float64, device=r.device)
            acc += torch.stack([*(x.double() * n_part for x in r.runner(batch)), n_part])
    r.net.train(True)
    if world > 1:
        dist.all_reduce(acc)
    return tuple((acc[:3] / acc[3]).tolist()) if n else None


def static_step(S):
    """Whether steps run as fast/train.py's static step, compiled whole: compile=true with the
    engine's loss (fast_loss), without FSDP (its hooks do not trace into one graph)."""
    return S.compile and S.fast_loss and not S.fsdp


def step_batch(r, d, part):
    """Rows `part` of d -> (batch, tokens before padding) on the device: {"ids", "labels" (N, l),
    "ar_teacher"} (make_batch's, make_teacher's: None but for ar_target = "teacher"), or r.layout's."""
    on = "cpu" if r.layout else r.device
    x, y, n_tok = make_batch(d, part, r.S, r.special, on)
    batch = {"ids": x, "labels": y, "ar_teacher": make_teacher(d, part, r.S, r.special, on)}
    return (r.layout(batch, r.device) if r.layout else batch), n_tok


def main(argv=None):
    S = parse_settings(sys.argv[1:] if argv is None else argv)
    rank, world, device = setup_device(S)
    try:
        train(S, rank, world, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Run:
    """What one training process holds while it runs (built once by `train`)."""
    S: Settings
    rank: int
    world: int
    device: torch.device
    data: dict  # "train", "val": prepared arrays (data/prepare.py)
    tok: object  # tokenizer.Tokenizer or None
    special: dict  # special token ids: "mask", "eos", "pad"
    totals: dict  # optimizer steps per stage
    model: Qwen2 = None
    net: StageLoss = None  # the loss module DDP / FSDP wrap
    runner: nn.Module = None  # what is called: net, compiled and/or DDP-wrapped
    layout: object = None  # the engine's host layout of a micro-batch (stage_losses); None: as made
    amp: object = None  # autocast context (util.precision)
    log: RunLog = None
    eos_ids: list = None
    data_id: str = None  # fingerprint of train.npz: a resume point must match it
    started: float = None  # time.time() when the first step began
    step_time: float = None  # seconds per optimizer step, smoothed: for the ETA

    def __post_init__(self):
        self.data_id = fingerprint(self.data["train"])  # hashed once, not at every save

    def say(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    @property
    def ckpt(self):
        return os.path.join(self.S.out_dir, "ckpt")


def train(S, rank, world, device):
    """The outline of a run: data, resume point, model, the two stages, the final evaluation."""
    micro_batches(S, world)  # refuse a batch that does not split into the processes
    try:  # data_dir, the tokenizer, init_from, out_dir/ckpt: a broken file is a message, not a traceback
        r = Run(S, rank, world, device, *load_data(S, rank, world))
        state = resume_point(r)
        build_model(r, state)
    except USER_ERRORS as e:
        raise SystemExit(error_line(e)) from None
    first, first_step = (state["stage"], state["step"]) if state is not None else ("ar", 0)
    os.makedirs(S.out_dir, exist_ok=True)  # only now: a run refused above writes nothing
    r.log = RunLog(os.path.join(S.out_dir, "log.jsonl"), (first, first_step) if state else None, rank == 0)
    r.started = time.time()
    for si, stage in enumerate(STAGES):
        start, total = (first_step if stage == first else 0), r.totals[stage]
        if si < STAGES.index(first) or start >= total:
            continue  # done before the checkpoint, or a stage of 0 steps
        run_stage(r, stage, start, state)
    r.log.close()
    r.say(f"training done in {(time.time() - r.started) / 60:.1f} min")
    if S.eval_at_end and rank == 0 and r.totals["mars"] > 0:
        import evaluate  # the held-out accuracy at tau = 1 and 0.9 of the released model

        result = evaluate.evaluate(os.path.join(S.out_dir, "mars"), S.data_dir, taus=(1.0, 0.9),
                                   block_size=S.block_size, device=str(device))
        write_json(os.path.join(S.out_dir, "eval.json"), result)
        r.say(f"elapsed {(time.time() - r.started) / 60:.1f} min (training and evaluation)")


def micro_batches(S, world):
    """Micro-batches per process and optimizer step (gradient accumulation)."""
    if S.batch_size % (world * S.micro_batch_size):
        raise SystemExit(f"batch_size={S.batch_size} is not a multiple of {world} process(es) x "
                         f"micro_batch_size={S.micro_batch_size}")
    return S.batch_size // (world * S.micro_batch_size)


def load_data(S, rank, world):
    """(data, tokenizer, special ids, steps per stage); the default data set is built on first use."""
    if not all(os.path.isfile(os.path.join(S.data_dir, f"{k}.npz")) for k in ("train", "val")):
        if S.data_dir != Settings.data_dir:
            raise SystemExit(f"{S.data_dir}: no train.npz / val.npz (make them with data/prepare.py)")
        if rank == 0:
            from data.synthetic import build_default

            print(f"building the default data set in {S.data_dir}", flush=True)
            build_default(S.data_dir, S.seed)
        if world > 1:
            dist.barrier()
    data = {k: load_npz(os.path.join(S.data_dir, f"{k}.npz")) for k in ("train", "val")}
    if S.ar_target == "teacher" and not all("t_logp" in d for d in data.values()):
        raise SystemExit(f"ar_target=teacher: {S.data_dir}/train.npz and val.npz need the teacher arrays "
                         "(data/prepare.py add_teacher)")
    off = data["train"]["offsets"]
    n_train = len(off) - 1
    if n_train == 0 or int((off[1:] - off[:-1]).max()) > S.max_len:
        raise SystemExit(f"{S.data_dir}/train.npz: empty, or a row is longer than max_len={S.max_len}")
    tok, special = special_ids(S)
    totals = {"ar": S.ar_steps, "mars": S.mars_steps}
    if S.epochs > 0:
        totals = dict.fromkeys(STAGES, math.ceil(S.epochs * n_train / S.batch_size))
    return data, tok, special, totals


def resume_point(r):
    """The state saved in out_dir/ckpt (recovered first, should a kill have cut a save short),
    or None for a fresh run; a checkpoint of other settings or data is refused."""
    S = r.S
    if r.rank == 0:
        recover_dir(r.ckpt)
    if r.world > 1:
        dist.barrier()
    if not (S.resume and os.path.isdir(r.ckpt)):
        return None
    state = load_train_state(r.ckpt)
    diff = [f"{k}: {state['settings'].get(k)!r} -> {v!r}" for k, v in asdict(S).items()
            if k not in RESUME_FREE and state["settings"].get(k) != v]
    diff += ["the content of train.npz"] if state["data"] != r.data_id else []
    if diff:
        raise SystemExit(f"{r.ckpt} belongs to a run with different settings ({'; '.join(diff)}); "
                         "use another out_dir, or --resume=false to start over in this one")
    r.say(f"resuming from {r.ckpt}: {state['stage']} step {state['step']}")
    return state


def build_model(r, state):
    """The model (from the checkpoint, init_from or scratch) on its device, its stages' losses
    (stage_losses) in a StageLoss, wrapped for the run (wrap)."""
    S, special = r.S, r.special
    dtype, why = choose_dtype(S.dtype, r.device)
    model = Qwen2.from_pretrained(r.ckpt, weight_dtype(dtype)) if state is not None else \
        initial_model(S, r.tok, special)
    cfg, data = model.config, r.data
    top = max(special["mask"], int(data["train"]["ids"].max()), int(data["val"]["ids"].max(initial=0)))
    if cfg.vocab_size <= top:
        raise SystemExit(f"vocab_size={cfg.vocab_size} must exceed every id used: mask_id={special['mask']}, "
                         f"largest={top}")
    eos_ids = [special["eos"], getattr(r.tok, "endoftext_id", None)]
    eos_ids += cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    r.eos_ids = [e for e in dict.fromkeys(eos_ids) if e is not None]
    model.to(r.device, weight_dtype(dtype))
    static = static_step(S)
    model.gradient_checkpointing = S.gradient_checkpointing or needs_checkpointing(cfg, S, r.world, static)
    r.say(f"model: {model.num_params() / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers, vocab "
          f"{cfg.vocab_size}; {len(data['train']['offsets']) - 1} train rows; {r.world} process(es) on "
          f"{r.device}, {dtype_name(dtype)} ({why})")
    if r.device.type == "cuda" or S.gpu_mem_gb > 0:
        ran = replace(S, dtype=dtype_name(dtype), gradient_checkpointing=model.gradient_checkpointing)
        parts = memory_parts(cfg, ran, r.world, static)
        total = sum(parts.values())
        fits = f": {'fits' if total <= S.gpu_mem_gb * 2**30 else 'does NOT fit'} in {S.gpu_mem_gb:g} GiB"
        r.say("estimated peak memory per process, GiB: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in
              parts.items()) + f" = {total / 2**30:.2f}" + (fits if S.gpu_mem_gb > 0 else ""))
        if model.gradient_checkpointing and not S.gradient_checkpointing:
            r.say(f"gradient checkpointing: on, the estimate without it exceeds gpu_mem_gb={S.gpu_mem_gb:g}")
    if S.freeze_vocab and not cfg.tie_word_embeddings:
        model.lm_head.weight.requires_grad_(False)  # keep_mask_row does the embedding
    ar_fn, mars_fn, r.layout = stage_losses(S, model, special, r.device)
    r.model, r.net = model, StageLoss(model, ar_fn, mars_fn)
    wrap(r, dtype, static)


def wrap(r, dtype, static):
    """r.runner, what the steps call: r.net under FSDP2 or DDP with several processes, compiled
    with compile=true (whole, one graph per shape, for the static step); and r.amp, the autocast."""
    S = r.S
    r.amp = autocast(r.device, dtype)
    if r.world > 1 and S.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 casts the gathered weights (instead of autocast) and reduces gradients in the weights' dtype
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=weight_dtype(dtype))
        for layer in r.model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(r.net, mp_policy=mp)
        r.amp = nullcontext()
    r.runner = torch.compile(r.net, fullgraph=static, dynamic=False if static else None) if S.compile \
        else r.net
    if r.world > 1 and not S.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        ids_ = [r.device.index] if r.device.type == "cuda" else None
        r.runner = DistributedDataParallel(r.runner, device_ids=ids_)


def run_stage(r, stage, start, state):
    """Steps start .. total-1 of one stage, with a fresh AdamW (its state restored on resume)."""
    S, total = r.S, r.totals[stage]
    opt = make_optimizer(r.net, S, r.device)
    if start > 0:
        load_optimizer(r.net, opt, S, state["optimizer"], r.rank)
    r.net.stage = stage
    accum = micro_batches(S, r.world)
    r.say(f"{stage} stage: steps {start + 1}..{total}, {S.batch_size} rows per step ({r.world} process(es) x "
          f"{accum} micro-batch(es) of {S.micro_batch_size}), lr {S.lr:g}")
    last = time.time()
    for step in range(start, total):
        lr = lr_at(step, total, S)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, l_mask, l_ar, tokens, gnorm = train_step(r, opt, stage, step)
        done, now = step + 1, time.time()
        dt, last = now - last, now
        r.step_time = dt if r.step_time is None else 0.9 * r.step_time + 0.1 * dt
        if done % S.log_interval == 0 or done in (1, total):  # the same steps after a resume
            log_step(r, stage, done, lr, (loss, l_mask, l_ar), tokens / dt, gnorm, dt)
        if done % S.eval_interval == 0 or done == total:
            v = val_loss(r)
            if v is not None:
                fin = lambda x: x if math.isfinite(x) else None  # noqa: E731 (no L_mask in AR)
                r.log({"kind": "val", "stage": stage, "step": done, "val_loss": v[0], "val_l_mask": fin(v[1]),
                       "val_l_ar": fin(v[2])})
                r.say(f"{stage:4s} step {done:6d} | val loss {v[0]:.4f} (L_mask {fin(v[1])}, "
                      f"L_AR {v[2]:.4f})")
            if r.rank == 0:
                plot_losses(S.out_dir, r.totals)
        if done % S.ckpt_interval == 0 or done == total:
            save(r, opt, stage, done, total)


def train_step(r, opt, stage, step):
    """One optimizer step over the step's global batch: this process's micro-batches with
    gradient accumulation, clip, a NaN/inf guard, AdamW. -> loss, l_mask, l_ar, tokens, gnorm."""
    S, world, net, mb = r.S, r.world, r.net, r.S.micro_batch_size
    accum = micro_batches(S, world)
    rows = batch_rows(r.data["train"], S, stage, step)  # the step's global batch
    acc = torch.zeros(4, dtype=torch.float64, device=r.device)  # loss, l_mask, l_ar, tokens of this process
    n_tokens = 0  # counted on the host: no copy to the device per micro-batch
    for m in range(accum):  # this process's micro-batches: slots rank * accum + m
        k, last = r.rank * accum + m, m == accum - 1
        part = rows[k * mb:(k + 1) * mb]
        batch, n_tok = step_batch(r, r.data["train"], part)
        row_weight = row_t_weights(S, stage, step, k, len(part), r.device)
        if S.fsdp and world > 1:
            net.set_requires_gradient_sync(last)
        with r.runner.no_sync() if world > 1 and not S.fsdp and not last else nullcontext():
            with r.amp:
                loss, l_mask, l_ar = r.runner(batch, row_weight)  # means over its rows
            (loss / accum).backward()  # DDP / FSDP average the gradients over processes
        acc[:3] += torch.stack([v.detach().double() for v in (loss, l_mask, l_ar)]) / accum
        n_tokens += n_tok
    if S.freeze_vocab:
        keep_mask_row(r.model, r.special["mask"])
    gnorm = torch.nn.utils.clip_grad_norm_(net.parameters(), S.grad_clip or math.inf)
    gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    acc[3] = n_tokens  # a fill with a host number: no copy, no sync
    if world > 1:
        dist.all_reduce(acc)
        acc[:3] /= world
    # the step's one read from the device: the logged numbers and the gradient norm together
    loss_v, l_mask_v, l_ar_v, tokens, gnorm = torch.cat([acc, gnorm.reshape(1).double()]).tolist()
    if not (math.isfinite(loss_v) and math.isfinite(gnorm)):
        what = f"loss {loss_v}" if not math.isfinite(loss_v) else f"gradient norm {gnorm}"
        lr = opt.param_groups[0]["lr"]
        raise SystemExit(f"non-finite {what} at {stage} step {step + 1} (lr {lr:.3g}): stopped before "
                         f"applying or saving it; the last good checkpoint is {r.ckpt}")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_v, l_mask_v, l_ar_v, tokens, gnorm


def log_step(r, stage, done, lr, losses, tok_s, gnorm, dt):
    """A train record in log.jsonl and a progress line with the ETA of the whole run."""
    loss, l_mask, l_ar = losses
    fin = lambda v: v if math.isfinite(v) else None  # no L_mask in AR, no L_AR at w = 0
    r.log({"kind": "train", "stage": stage, "step": done, "loss": loss, "l_mask": fin(l_mask),
           "l_ar": fin(l_ar), "lr": lr, "grad_norm": gnorm, "tok_s": tok_s})
    show = lambda v: f"{v:.4f}" if math.isfinite(v) else "-"
    total = r.totals[stage]
    left = total - done + sum(r.totals[s] for s in STAGES[STAGES.index(stage) + 1:])
    r.say(f"{stage:4s} step {done:6d}/{total} | loss {loss:.4f} (L_mask {show(l_mask)}, L_AR "
          f"{show(l_ar)}) | lr {lr:.2e} | {tok_s:8.0f} tok/s | {1000 * dt:5.0f} ms | "
          f"ETA {r.step_time * left / 60:.1f} min")


def save(r, opt, stage, done, total):
    """The resume point (and, at the end of a stage, the released model) — atomically."""
    model_full, osd = gather(r.net, opt, r.S, r.model.config, r.rank)
    if r.rank == 0:
        if done == total:  # the release first: a checkpoint at the end means "stage done"
            out = os.path.join(r.S.out_dir, stage)
            replace_dir(out, write_release, model_full, r.S, r.special, r.tok, stage, r.eos_ids)
            r.say(f"saved {out}")
        replace_dir(r.ckpt, write_checkpoint, model_full, osd, r.S, stage, done, r.data_id)
        r.log({"kind": "ckpt", "stage": stage, "step": done})
    if r.world > 1:
        dist.barrier()


if __name__ == "__main__":
    main()
