"""Checkpoint files of train.py: atomic directory writes, resume state, released models.

Every directory is written to `NAME.tmp` and renamed into place (`replace_dir`), so a
crash or Ctrl-C never leaves half a checkpoint; `recover_dir` repairs a kill between
the two renames. A resume point (`out_dir/ckpt`) is an HF-layout model plus
`train_state.pt` holding only tensors and plain containers, read back with
`torch.load(..., weights_only=True)`. A released stage (`out_dir/ar`, `out_dir/mars`) is
a plain Qwen2 directory that transformers loads, with the tokenizer, the generation
config and `mars.json` (B, mask id, training settings).
"""

import json
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist

from model import Qwen2


def replace_dir(final, write, *args):
    """Write a directory atomically: write(tmp, *args) fills final.tmp, then final -> final.old,
    final.tmp -> final, delete final.old. A reader sees the old or the new directory, never
    half of one; recover_dir repairs a kill between the two renames."""
    tmp, old = final + ".tmp", final + ".old"
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp, *args)
    for name in os.listdir(tmp):  # on disk before the rename makes them visible
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(final):
    """Finish or undo what replace_dir left: an only .old comes back; .tmp and .old go."""
    tmp, old = final + ".tmp", final + ".old"
    if not os.path.exists(final) and os.path.exists(old):
        os.replace(old, final)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


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


def write_release(tmp, model, S, ids, tok, stage, eos_ids):
    """out_dir/{ar,mars}: the HF model, the tokenizer, generation_config.json, mars.json."""
    model.save_pretrained(tmp)
    if tok is not None:
        tok.save(tmp)
    gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": eos_ids, "pad_token_id": ids["pad"],
           "do_sample": False}
    meta = {"block_size": S.block_size, "mask_id": ids["mask"], "eos_id": ids["eos"], "pad_id": ids["pad"],
            "stage": stage, "settings": asdict(S)}
    for name, obj in (("generation_config.json", gen), ("mars.json", meta)):
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=2)


def write_checkpoint(tmp, model, osd, S, stage, step, data_id):
    """out_dir/ckpt: the HF model + train_state.pt (tensors and plain containers only)."""
    model.save_pretrained(tmp)
    torch.save({"stage": stage, "step": step, "optimizer": osd, "settings": asdict(S), "data": data_id},
               os.path.join(tmp, "train_state.pt"))


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:  # skip a last line cut short by a kill
        return [json.loads(line) for line in f if line.endswith("\n")]
