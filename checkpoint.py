"""Checkpoint directories: the one opener of a released model, and train.py's files (§7).

`load_checkpoint(dir)` is how generate.py, evaluate.py and the scripts open a model: the
weights (model.py), the tokenizer when the directory has one, the MARS settings it was
trained with (`mars.json`: B, the `<|mask|>` id) and its EOS ids. It knows nothing of
decoding.

train.py writes two kinds of directory, each atomically (util.atomic.replace_dir), so a
crash or Ctrl-C never leaves half a checkpoint:
  out_dir/ckpt            a resume point: an HF-layout model plus `train_state.pt`, which
                          holds only tensors and plain containers and is read back with
                          `torch.load(..., weights_only=True)`;
  out_dir/ar, out_dir/mars  a released stage: a plain Qwen2 directory that transformers
                          loads, with the tokenizer, generation_config.json and mars.json.
"""

import os
import pickle
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from model import Qwen2
from tokenizer import Tokenizer
from util.atomic import write_json
from util.files import BadFileError, checked, read_json_object
from util.runlog import STAGES

DEFAULT_BLOCK_SIZE = 4  # the paper's main B (§7), used when a checkpoint does not say


# ----------------------------------------------------------------------------- opening a release
@dataclass
class Checkpoint:
    path: str
    model: Qwen2
    tok: Tokenizer | None  # None: the directory has no tokenizer files (raw ids only)
    block_size: int | None  # B the model was trained with (mars.json); None = not recorded
    mask_id: int | None  # <|mask|>: mars.json, else the tokenizer's; None = unknown
    eos_ids: tuple[int, ...]  # ids that end a reply (§5.6); () = generate to the limit
    mars: dict  # mars.json as saved ({} when absent)


def read_json(path, name):
    """dir/name as a dict, {} when the file is absent; a broken file is a BadFileError."""
    file = os.path.join(path, name)
    return read_json_object(file) if os.path.isfile(file) else {}


def read_mars(path):
    """mars.json ({} when absent), its B an int >= 1 and its <|mask|> id an int >= 0 (null or
    absent: not recorded)."""
    mars = read_json(path, "mars.json")
    for key, low in (("block_size", 1), ("mask_id", 0)):
        if mars.get(key) is not None:
            checked(os.path.join(path, "mars.json"), key, mars[key], int, low)
    return mars


def open_tokenizer(path):
    """The directory's tokenizer, or None when it has no tokenizer files."""
    try:
        return Tokenizer.from_dir(path)
    except FileNotFoundError:
        return None


def eos_ids_of(path, tok):
    """EOS ids: generation_config.json / config.json eos_token_id, plus the tokenizer's
    <|im_end|> and <|endoftext|> (§5.6)."""
    ids = set()
    for name in ("generation_config.json", "config.json"):
        eos = read_json(path, name).get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        ids.update(checked(os.path.join(path, name), "eos_token_id", e, int, 0) for e in eos)
    if tok is not None:
        ids.update([tok.eos_id, tok.endoftext_id])
    return tuple(sorted(ids))


def load_checkpoint(path, device="cpu", dtype=torch.float32, model=None):
    """Open an HF-layout directory (ours, a converted one, or the authors' release) ->
    `Checkpoint` with the plain model (model.Qwen2, eval mode). `model` skips loading the
    weights again (a caller that already has them)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    mars, tok = read_mars(path), open_tokenizer(path)
    mask_id = mars.get("mask_id", getattr(tok, "mask_id", None))
    if model is None:
        model = Qwen2.from_pretrained(path, dtype, device).eval()  # the reference; fast.make_fast speeds it
    if mars.get("mask_id") is not None and mars["mask_id"] >= model.config.vocab_size:
        raise BadFileError(os.path.join(path, "mars.json"), f"mask_id {mars['mask_id']} is not below the "
                           f"model's vocab_size {model.config.vocab_size} (config.json)")
    return Checkpoint(path, model, tok, mars.get("block_size"), mask_id, eos_ids_of(path, tok), mars)


# ----------------------------------------------------------------------------- train.py's files
def gather(net, opt, S, cfg, rank):
    """(whole model, optimizer state dict) on rank 0, (None, None) elsewhere; under FSDP
    gathered to CPU from the shards (a collective: every rank calls it)."""
    if not (S.fsdp and dist.is_initialized()):
        return (net.model, opt.state_dict()) if rank == 0 else (None, None)
    from torch.distributed.checkpoint import state_dict as dsd

    o = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd, osd = dsd.get_model_state_dict(net, options=o), dsd.get_optimizer_state_dict(net, opt, options=o)
    if rank != 0:
        return None, None
    with torch.device("meta"):
        model = Qwen2(cfg)
    model.load_state_dict({k.removeprefix("model."): v for k, v in sd.items()}, assign=True)
    return model, osd


def load_optimizer(net, opt, S, osd, rank):
    if not (S.fsdp and dist.is_initialized()):
        return opt.load_state_dict(osd)
    from torch.distributed.checkpoint import state_dict as dsd

    o = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)  # rank 0's copy, sharded
    dsd.set_optimizer_state_dict(net, opt, osd if rank == 0 else {}, options=o)


def write_release(tmp, model, S, special, tok, stage, eos_ids):
    """out_dir/{ar,mars}: the HF model, the tokenizer, generation_config.json, mars.json."""
    model.save_pretrained(tmp)
    if tok is not None:
        tok.save(tmp)
    gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": eos_ids, "pad_token_id": special["pad"],
           "do_sample": False}
    meta = {"block_size": S.block_size, "mask_id": special["mask"], "eos_id": special["eos"],
            "pad_id": special["pad"],
            "stage": stage, "settings": asdict(S)}
    write_json(os.path.join(tmp, "generation_config.json"), gen)
    write_json(os.path.join(tmp, "mars.json"), meta)


def load_train_state(ckpt):
    """ckpt/train_state.pt, as write_checkpoint saved it; a file cut short, not torch.save's,
    or without what a resume reads is a BadFileError."""
    file = os.path.join(ckpt, "train_state.pt")
    try:  # mmap: ranks that never read the optimizer state pay nothing
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise BadFileError(file, f"not a readable torch.save file ({str(e).split('. ')[0]})") from None
    if not isinstance(state, dict):
        raise BadFileError(file, f"expected a dict, got a {type(state).__name__}")
    for key, kind in (("stage", str), ("step", int), ("optimizer", dict), ("settings", dict), ("data", str)):
        if key not in state:
            raise BadFileError(file, f"missing key {key!r}")
        checked(file, key, state[key], kind, 0 if kind is int else None)
    if state["stage"] not in STAGES:
        raise BadFileError(file, f"key 'stage' must be one of {STAGES}, got {state['stage']!r}")
    if not {"state", "param_groups"} <= set(state["optimizer"]):
        raise BadFileError(file, "key 'optimizer' is not an optimizer state (no 'state' / 'param_groups')")
    return state


def write_checkpoint(tmp, model, osd, S, stage, step, data_id):
    """out_dir/ckpt: the HF model + train_state.pt (tensors and plain containers only)."""
    model.save_pretrained(tmp)
    torch.save({"stage": stage, "step": step, "optimizer": osd, "settings": asdict(S), "data": data_id},
               os.path.join(tmp, "train_state.pt"))
