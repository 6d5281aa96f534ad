"""Train MARS: AR SFT, then MARS fine-tuning, on a CPU, one GPU or many (docs/spec.md §2-§4, §7).

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

Every setting is a field of `Settings` (settings.py); its defaults are the default run
(= configs/default.json). `--config FILE.json` and `--key=value` override them, in order.

Exact resume: the rows of step s are a pure function of (seed, stage, s) (data/batches.py
`step_rows`: epochs of permutations seeded by (seed, stage, epoch)), the loss has no randomness (100%
masking, §3; inv_t_weight's t is seeded by (seed, step, micro-batch): row_t_weights), and a
checkpoint holds the weights, the optimizer state and the position, so a killed run
continues as if never stopped (bit-exact on CPU). Checkpoints are built in a temp dir and
renamed into place (`replace_dir`); a NaN/inf loss or gradient stops
the run before the step is applied or saved.

Multi-process (torchrun, or any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR/PORT):
process r computes micro-batches r*accum .. r*accum+accum-1 of the step's global batch;
DDP (or FSDP2 with fsdp=true) averages the gradients, and the logged loss is all-reduced.
"""

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

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
    """The stage's loss as the forward of a module that owns the model: (loss, l_mask, l_ar).
    mars_loss and ar_loss call model.hidden / model.lm_head, not model.forward, and DDP and
    FSDP act only on calls of the module they wrap; so they wrap this one."""

    def __init__(self, model, S, mask_id):
        super().__init__()
        self.model, self.S, self.mask_id, self.stage = model, S, mask_id, "ar"

    def forward(self, ids, labels, teacher=None, row_weight=None, window=None):
        """teacher (make_teacher) makes L_AR the KL to it (ar_target = "teacher"), else CE;
        row_weight (row_t_weights) multiplies each row's L_mask (inv_t_weight). window: a
        static_batch's noisy window, for the static step of compile=true (fast/train.py: the
        same loss with fixed shapes and no host sync, compiled whole)."""
        S = self.S
        if window is not None:
            return self.static_loss(ids, labels, window, teacher)
        if self.stage == "ar":  # plain AR SFT (§2): no noisy stream, so no L_mask
            loss = ar_loss(self.model, ids, labels, teacher)
            return loss, torch.full_like(loss, math.nan).detach(), loss.detach()
        return mars_loss(self.model, ids, labels, self.mask_id, S.block_size, S.w_ar, S.bidirectional,
                         two_stream=S.two_stream, trim_noisy=S.trim_noisy, ar_teacher=teacher,
                         noisy_row_weight=row_weight)


    def static_loss(self, ids, labels, window, teacher=None):
        """The stage's loss by fast/train.py's static step (compile=true): the same loss."""
        from fast.train import ar_loss_static, mars_loss_static  # the engine, only when asked for

        if self.stage == "ar":
            loss = ar_loss_static(self.model, ids, labels, teacher=teacher)
            return loss, torch.full_like(loss, math.nan).detach(), loss.detach()
        S = self.S
        return mars_loss_static(self.model, ids, labels, window, self.mask_id, S.block_size, S.w_ar,
                                S.bidirectional, flex=S.flex_attention, teacher=teacher)


def row_t_weights(S, stage, step, slot, n, device):
    """The 1/t of each of the n rows of micro-batch `slot` of a MARS step when inv_t_weight
    (mars.inverse_t_weights, the released "w/o L_AR" objective, §4), else None. The generator
    is seeded by (seed, step, slot) (the hash of a tuple of ints is fixed across runs): no RNG
    state, so a resumed run, or the same slot on another process, draws the same t."""
    if not (S.inv_t_weight and stage == "mars"):
        return None
    return inverse_t_weights(n, torch.Generator().manual_seed(hash((S.seed, step, slot)))).to(device)


def keep_mask_row(model, mask_id):
    """freeze_vocab (beyond the paper), after every backward: zero the embedding's (and a tied
    head's) gradient outside the mask token's row, the one row MARS gives a new use (§2); an
    untied head takes no gradient at all (build_model). The idea: from the first step AdamW
    moves every row of the head by about lr per entry, whatever the gradient's size, and every
    AR logit with it. Measured on SmolLM2 (issue 21, results/real_model/PLAN.md), it did not
    hold the AR path: L_AR moved as without it, through the layers."""
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
def val_loss(runner, net, val, S, special, rank, world, device, amp):
    """Mean loss of the stage over the first eval_rows val rows (the same rows every time)."""
    n = min(S.eval_rows, len(val["offsets"]) - 1) // world * world
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    net.train(False)
    for part in torch.arange(rank * n // world, (rank + 1) * n // world).split(S.micro_batch_size):
        x, y, _, window, teacher = step_batch(val, part, S, special, device)  # the same on every rank
        with amp:
            n_part = torch.tensor(float(len(part)), dtype=torch.float64, device=device)
            acc += torch.stack([runner(x, y, teacher, None, window)[0].double() * n_part, n_part])
    net.train(True)
    if world > 1:
        dist.all_reduce(acc)
    return (acc[0] / acc[1]).item() if n else None


def static_step(S):
    """Whether steps run as fast/train.py's static step, compiled whole: compile=true with the
    loss it covers (L_AR CE on the tokens or the KL to a teacher, no 1/t row weights, the
    two-stream window as trained by default) and without FSDP (its hooks do not trace into one
    graph); else the reference loss."""
    return S.compile and not S.inv_t_weight and S.two_stream and S.trim_noisy and not S.fsdp


def step_batch(d, part, S, special, device):
    """A micro-batch on `device` -> ids, labels, tokens, window, teacher: make_batch's and
    make_teacher's (None without ar_target = "teacher"), or for the static step bucketed, its
    noisy window sized and its teacher laid out on the outputs on the host before the copy
    (static_batch, static_teacher), so the step reads nothing back from the device; window None
    otherwise."""
    if not static_step(S):
        return *make_batch(d, part, S, special, device), None, make_teacher(d, part, S, special, device)
    from fast.train import static_batch, static_teacher  # the engine, only when asked for

    x, y, n_tok = make_batch(d, part, S, special, "cpu")
    x, y, (start, W) = static_batch(x, y, special["pad"], S.block_size, S.bucket)
    teacher = make_teacher(d, part, S, special, "cpu")
    pin = device.type == "cuda"  # a copy from pinned memory does not wait for the device
    to = lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=True)
    if teacher is not None:
        teacher = {k: to(v) for k, v in static_teacher(teacher, y).items()}
    return to(x), to(y), n_tok, (to(start), W), teacher


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
    amp: object = None  # autocast context (util.precision)
    log: RunLog = None
    eos_ids: list = None
    data_id: str = None  # fingerprint of train.npz: a resume point must match it

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
    here = (state["stage"], state["step"]) if state is not None else None
    os.makedirs(S.out_dir, exist_ok=True)  # only now: a run refused above writes nothing
    r.log = RunLog(os.path.join(S.out_dir, "log.jsonl"), here, enabled=rank == 0)
    t = Timer()
    first, first_step = (state["stage"], state["step"]) if state is not None else ("ar", 0)
    for si, stage in enumerate(STAGES):
        start, total = (first_step if stage == first else 0), r.totals[stage]
        if si < STAGES.index(first) or start >= total:
            continue  # done before the checkpoint, or a stage of 0 steps
        run_stage(r, stage, start, state, t)
    r.log.close()
    r.say(f"training done in {t.elapsed() / 60:.1f} min")
    if S.eval_at_end and rank == 0 and r.totals["mars"] > 0:
        import evaluate  # the held-out accuracy at tau = 1 and 0.9 of the released model

        result = evaluate.evaluate(os.path.join(S.out_dir, "mars"), S.data_dir, taus=(1.0, 0.9),
                                   block_size=S.block_size, device=str(device))
        write_json(os.path.join(S.out_dir, "eval.json"), result)
        r.say(f"elapsed {t.elapsed() / 60:.1f} min (training and evaluation)")


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
    """The model (from the checkpoint, init_from or scratch), on its device, wrapped for the run."""
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
        r.say(memory_report(cfg, ran, r.world, static))
        if model.gradient_checkpointing and not S.gradient_checkpointing:
            r.say(f"gradient checkpointing: on, the estimate without it exceeds gpu_mem_gb={S.gpu_mem_gb:g}")
    if S.freeze_vocab and not cfg.tie_word_embeddings:
        model.lm_head.weight.requires_grad_(False)  # keep_mask_row does the embedding
    r.model, r.net, r.amp = model, StageLoss(model, S, special["mask"]), autocast(r.device, dtype)
    if r.world > 1 and S.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 casts the gathered weights (instead of autocast) and reduces gradients in the weights' dtype
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=weight_dtype(dtype))
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(r.net, mp_policy=mp)
        r.amp = nullcontext()
    if S.flex_attention:
        if r.device.type != "cuda" or not static:
            raise SystemExit("flex_attention=true needs CUDA and the static step (compile=true, two_stream, "
                             "trim_noisy, no fsdp): FlexAttention has no backward on the CPU")
        from fast.flex import use_flex  # the engine, only when asked for

        use_flex(model)
    if static:  # one graph per bucketed shape (fast/train.py: ~21 at 512 tokens, x2 for val)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    r.runner = torch.compile(r.net, fullgraph=static, dynamic=False if static else None) if S.compile \
        else r.net
    if r.world > 1 and not S.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        ids_ = [r.device.index] if r.device.type == "cuda" else None
        r.runner = DistributedDataParallel(r.runner, device_ids=ids_)


def memory_report(cfg, S, world, static=False):
    parts = memory_parts(cfg, S, world, static)
    total = sum(parts.values())
    verdict = f"{'fits' if total <= S.gpu_mem_gb * 2**30 else 'does NOT fit'} in {S.gpu_mem_gb:g} GiB"
    return ("estimated peak memory per process, GiB: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in
            parts.items()) + f" = {total / 2**30:.2f}" + (f": {verdict}" if S.gpu_mem_gb > 0 else ""))


class Timer:
    """Wall clock of the run, and a smoothed step time for the ETA."""

    def __init__(self):
        self.t0 = self.t_last = time.time()
        self.avg = None

    def step(self):
        now = time.time()
        dt, self.t_last = now - self.t_last, now
        self.avg = dt if self.avg is None else 0.9 * self.avg + 0.1 * dt
        return dt

    def elapsed(self):
        return time.time() - self.t0


def run_stage(r, stage, start, state, t):
    """Steps start .. total-1 of one stage, with a fresh AdamW (its state restored on resume)."""
    S, total = r.S, r.totals[stage]
    opt = make_optimizer(r.net, S, r.device)
    if start > 0:
        load_optimizer(r.net, opt, S, state["optimizer"], r.rank)
    r.net.stage = stage
    accum = micro_batches(S, r.world)
    r.say(f"{stage} stage: steps {start + 1}..{total}, {S.batch_size} rows per step ({r.world} process(es) x "
          f"{accum} micro-batch(es) of {S.micro_batch_size}), lr {S.lr:g}")
    for step in range(start, total):
        lr = lr_at(step, total, S)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, l_mask, l_ar, tokens, gnorm = train_step(r, opt, stage, step)
        done, dt = step + 1, t.step()
        if done % S.log_interval == 0 or done in (1, total):  # the same steps after a resume
            log_step(r, stage, done, lr, (loss, l_mask, l_ar), tokens / dt, gnorm, dt, t)
        if done % S.eval_interval == 0 or done == total:
            v = val_loss(r.runner, r.net, r.data["val"], S, r.special, r.rank, r.world, r.device, r.amp)
            if v is not None:
                r.log({"kind": "val", "stage": stage, "step": done, "val_loss": v})
                r.say(f"{stage:4s} step {done:6d} | val loss {v:.4f}")
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
        x, y, n_tok, window, teacher = step_batch(r.data["train"], part, S, r.special, r.device)
        row_weight = row_t_weights(S, stage, step, k, len(part), r.device)
        if S.fsdp and world > 1:
            net.set_requires_gradient_sync(last)
        with r.runner.no_sync() if world > 1 and not S.fsdp and not last else nullcontext():
            with r.amp:
                loss, l_mask, l_ar = r.runner(x, y, teacher, row_weight, window)  # means over its rows
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


def log_step(r, stage, done, lr, losses, tok_s, gnorm, dt, t):
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
          f"ETA {t.avg * left / 60:.1f} min")


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
