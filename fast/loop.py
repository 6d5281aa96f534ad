"""Greedy AR decoding with the whole step on the device (issue 49, its first piece).

The reference decoders (generate.py, exact.py) run the LM head, the argmax, the EOS/budget cut
and the cache update between forwards, in Python, reading the accepted tokens back to the host
every step: on a GPU each read drains the device before the next step can launch. Here the
state lives on the device, allocated once (the static cache, the rows' lengths, the next
token, an output buffer, the finished flags, the EOS ids), and one function does a whole AR
step on it: the forward of the next token, the head on that one row each, the argmax, the
budget and EOS cut, the write into the output buffer, the commit and the next input, in
place. Compiled whole (`fullgraph=True`), that is one graph; the host replays it `chunk`
steps at a time and reads one flag (are all rows done?) after each chunk. A finished row keeps
stepping, masked: it emits and commits nothing.

What it must equal: generate.generate_ar, token for token (tests/test_fast_loop.py, float64,
ragged prompts, EOS in the middle of a chunk); what it must not do: read anything back inside a
step (the same test runs a step on the meta device, where every read-back raises).
The τ window and exact mode on the device are the rest of issue 49.
"""

import torch

from fast.cache import FastCache
from model import Qwen2


def ar_step(model, tok, k, v, lengths, out, n_out, done, eos, max_new):
    """One AR step over the static cache (k, v, lengths), every tensor updated in place. tok
    (N, 1): each row's last emitted token, not yet in the cache; out (N, max_new), n_out (N,):
    the tokens emitted so far; done (N,) bool; eos (E,): the ids that end a row."""
    live = ~done
    h = Qwen2.hidden(model, tok, None, None, FastCache.over(k, v, lengths))  # writes tok's K/V at lengths
    lengths.add_(live.long())  # the commit: tok is now in the cache of every live row
    nxt = model.lm_head(h[:, -1]).float().argmax(-1)  # (N,): the greedy token (first of ties)
    at = n_out.clamp(max=max_new - 1)[:, None]  # where a live row's token goes
    out.scatter_(1, at, torch.where(live, nxt, out.gather(1, at)[:, 0])[:, None])
    n_out.add_(live.long())
    done.logical_or_(live & (torch.isin(nxt, eos) | (n_out >= max_new)))
    tok.copy_(torch.where(live, nxt, tok[:, 0])[:, None])


@torch.no_grad()
def generate_ar_device(model, prompts, max_new_tokens, eos_ids=(), chunk=8, step=ar_step):
    """Greedy AR decoding of `prompts` (lists of ids) by `model` (a FastQwen2, bf16 or not) with
    `step` (ar_step, or it compiled: torch.compile(ar_step, fullgraph=True)) -> per row its ids,
    as generate.generate_ar's Generation.ids. The host reads one flag every `chunk` steps."""
    N, device = len(prompts), model.lm_head.weight.device
    cfg, p = model.config, model.lm_head.weight  # static: whole key blocks, one shape for many requests
    cache = FastCache(cfg.num_hidden_layers, N, cfg.num_key_value_heads, cfg.head_dim,
                      max(map(len, prompts)) + max_new_tokens, 1, p.dtype, device, static=True)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.tensor([p + [0] * (lens.max().item() - len(p)) for p in prompts], device=device)
    h = model.hidden(tokens, cache=cache)  # the prefill, eager; commit each row's prompt
    cache.commit(lens)
    first = model.lm_head(h[torch.arange(N, device=device), lens - 1]).float().argmax(-1)  # (N,)
    out = torch.zeros(N, max_new_tokens, dtype=torch.long, device=device)
    out[:, 0] = first
    n_out = torch.ones(N, dtype=torch.long, device=device)
    eos = torch.tensor(sorted(eos_ids) or [-1], device=device)
    done = torch.isin(first, eos) | (n_out >= max_new_tokens)
    tok = first[:, None].clone()
    if device.type == "cuda":  # a CUDA graph updates these very tensors in place
        for t in (tok, out, n_out, done, eos, cache.lengths):
            torch._dynamo.mark_static_address(t)
    while not bool(done.all()):  # the one read, every `chunk` steps
        for _ in range(chunk):
            step(model, tok, cache.k, cache.v, cache.lengths, out, n_out, done, eos, max_new_tokens)
    return [row[:n].tolist() for row, n in zip(out, n_out.tolist())]
