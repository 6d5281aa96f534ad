"""The settings of a training run (train.py): every hyper-parameter, and how they are read.

`Settings` is one dataclass whose defaults are the default run (= configs/default.json,
tests/test_train_settings.py checks): the data and model, the method (B, w of L_AR, the
Block-Diffusion ablation: docs/spec.md §3-§4), the optimisation (§7), logging, checkpoints and
the system. `parse_settings` applies `--config FILE.json` and `--key=value` over the
defaults, left to right, typed like them. `RESUME_FREE` names the settings a resumed run
may change (they do not change the trajectory's maths); `GONE` the settings that were replaced,
so that a config naming one is told what replaced it.

What it leaves to others: what each setting does (train.py), the dtypes' rules
(util/precision.py).
"""

import json
from dataclasses import dataclass, fields

from util.precision import DTYPES


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
    ar_target: str = "tokens"  # L_AR: "tokens" = CE (§4); "teacher" = KL to the top-k teacher in the data
    inv_t_weight: bool = False  # "w/o L_AR" as released: each row's noisy loss x 1/t, t ~ U[1e-3, 1) (§4)
    freeze_vocab: bool = False  # beyond the paper: the embedding and LM head stay fixed, but the mask row
    # how the MARS loss runs: the same loss and gradients either way (tests/test_fast_paths.py)
    fast_loss: bool = True  # the engine's forward (fast/window.py: the clean stream plain causal, only the
    #                         noisy blocks the loss reads); false: mars.mars_loss, the textbook one of §3
    # optimisation (§7)
    ar_steps: int = 4000
    mars_steps: int = 1000
    epochs: float = 0.0  # > 0: each stage makes this many passes over train.npz (replaces *_steps)
    batch_size: int = 16  # rows per optimizer step, all processes and accumulation together
    micro_batch_size: int = 16  # rows per forward per process; accumulation = batch / (world * micro)
    bucket_window: int = 8  # > 1: batches of similar lengths, drawn from windows of this many steps (1 = off)
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
    # compute dtype (autocast; weights fp32). auto = bf16 on CUDA and on CPUs with bf16 units
    # (util/precision.py); the tiny default stays fp32: at width 128 bf16 does not pay on the CPU
    dtype: str = "float32"
    #                     float64 = weights, optimizer and reduce in fp64 too (for proofs; slow)
    compile: bool = False  # torch.compile: the static step of fast/train.py, compiled whole
    bucket: int = 16  # compile=true: rows and the noisy window padded to this many tokens x a power of 2
    flex_attention: bool = False  # compile=true on CUDA: the MARS step's attention by FlexAttention
    #                               (fast/flex.py; no backward on the CPU; not yet measured on a GPU)
    gradient_checkpointing: bool = False
    fsdp: bool = False  # under torchrun: FSDP2 fully_shard instead of DDP (7B)
    gpu_mem_gb: float = 0.0  # > 0: say whether estimate_memory fits this much


# settings that may differ when resuming (they do not change the trajectory's maths)
RESUME_FREE = {"data_dir", "out_dir", "init_from", "tokenizer", "log_interval", "eval_interval", "eval_rows",
               "ckpt_interval", "resume", "eval_at_end", "device", "compile", "gradient_checkpointing",
               "micro_batch_size", "gpu_mem_gb", "fast_loss", "bucket", "flex_attention"}
# settings that are gone, and what took their place: a config or command line naming one is refused
GONE = dict.fromkeys(("two_stream", "trim_noisy"), "fast_loss (true, the default: the engine's windowed "
                     "forward, as two_stream = trim_noisy = true was; false: the textbook forward, "
                     "mars.mars_loss, as two_stream = false was)")


def parse_settings(argv):
    """Settings from `--config FILE.json` (plain JSON; keys starting with "_" are comments)
    and `--key=value`, applied left to right over the defaults, typed like the defaults."""
    s, types = Settings(), {f.name: type(f.default) for f in fields(Settings)}

    def put(key, value, source, text):
        kind = types.get(key)
        if key in GONE:
            raise SystemExit(f"{source}: setting {key!r} is gone: use {GONE[key]}")
        if kind is None:
            raise SystemExit(f"{source}: unknown setting {key!r} (see Settings in settings.py)")
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
    if s.ar_target not in ("tokens", "teacher"):
        raise SystemExit(f"ar_target must be 'tokens' or 'teacher', got {s.ar_target!r}")
    if s.freeze_vocab and s.fsdp:
        raise SystemExit("freeze_vocab=true is not implemented with fsdp=true (sharded gradients)")
    if s.flex_attention and not (s.compile and s.fast_loss and not s.fsdp):
        raise SystemExit("flex_attention=true needs compile=true, fast_loss=true and fsdp=false (it is the "
                         "static step's attention)")
    if s.dtype not in DTYPES:
        raise SystemExit(f"dtype must be one of {DTYPES}, got {s.dtype!r}")
    for k in ("block_size", "batch_size", "micro_batch_size", "bucket_window", "bucket", "log_interval",
              "eval_interval", "ckpt_interval"):
        if getattr(s, k) < 1:
            raise SystemExit(f"{k} must be >= 1, got {getattr(s, k)}")
    return s
