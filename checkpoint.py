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

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from model import Qwen2, pack_for_decoding
from tokenizer import Tokenizer
from util.atomic import write_json

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
    """dir/name as a dict, {} when the file is absent; a broken file is a clear error."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            d = json.load(f)
    except ValueError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return d


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
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tok is not None:
        ids.update([tok.eos_id, tok.endoftext_id])
    return tuple(sorted(ids))


def load_checkpoint(path, device="cpu", dtype=torch.float32, model=None):
    """Open an HF-layout directory (ours, a converted one, or the authors' release) ->
    `Checkpoint`. `model` skips loading the weights again (a caller that already has them)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    tok, mars = open_tokenizer(path), read_json(path, "mars.json")
    mask_id = mars.get("mask_id", getattr(tok, "mask_id", None))
    if model is None:
        model = pack_for_decoding(Qwen2.from_pretrained(path, dtype, device).eval())  # fast decoding matmuls
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


def write_checkpoint(tmp, model, osd, S, stage, step, data_id):
    """out_dir/ckpt: the HF model + train_state.pt (tensors and plain containers only)."""
    model.save_pretrained(tmp)
    torch.save({"stage": stage, "step": step, "optimizer": osd, "settings": asdict(S), "data": data_id},
               os.path.join(tmp, "train_state.pt"))
