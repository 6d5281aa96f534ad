"""Greedy AR and the τ window with the whole step on the device (issue 49, its first pieces).

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

`window_step` does the same for the τ window (generate.window_steps): [pending | B masks] 2B
wide, the τ rule and the EOS/budget cut on the device (`keep_on_device`), τ a tensor (a new τ
is no new graph). What they must equal: generate.generate_ar and generate.generate, token for
token (tests/test_fast_loop.py, float64, ragged prompts, EOS in the middle of a chunk, several
τ); what they must not do: read anything back inside a step (the same test runs a step on the
meta device, where every read-back raises). Exact mode and sampling on the device are the rest
of issue 49.
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


# ---------------------------------------------------------------- the τ window on the device
def keep_on_device(logits, tau, eos, out, n_out, done, max_new):
    """The τ rule (§5) and the EOS/budget cut of one step, in place on device state: logits (N,
    B, V) at [the last real token, masks 0 .. B-2] -> c (N, B) the candidates and k (N,) the
    tokens each row keeps (0 for a finished row), written into out at n_out (out has B spare
    columns past max_new, so the B writes of a row never share a column)."""
    N, B, _ = logits.shape
    live = ~done
    c = logits.float().argmax(-1)  # (N, B): the greedy candidates (first of ties)
    p = logits.float().softmax(-1).gather(-1, c[..., None])[..., 0]  # (N, B): their probabilities
    ar = tau >= 1  # AR mode: c_0 alone, nothing compared (§5.5)
    a = torch.where(ar, 1, 1 + (p[:, 1:] >= tau).long().cumprod(1).sum(1))  # accepted, (N,)
    j = torch.arange(B, device=c.device)
    is_eos = torch.isin(c, eos) & (j < a[:, None])
    first_eos = torch.where(is_eos, j, B).amin(1)  # (N,): B when no accepted EOS
    k = torch.minimum(torch.minimum(a, first_eos + 1), max_new - n_out) * live  # kept, (N,)
    at = n_out[:, None] + j  # (N, B): distinct columns, the spare ones past max_new never read
    out.scatter_(1, at, torch.where(j < k[:, None], c, out.gather(1, at)))
    n_out.add_(k)
    done.logical_or_(live & ((first_eos < k) | (n_out >= max_new)))
    return c, k


def window_step(model, pend, n_pend, k, v, lengths, out, n_out, done, eos, max_new, tau, mask_id):
    """One step of generate.window_steps on the device: forward [the n_pend[b] pending tokens |
    B masks] (2B wide, padded with masks) over the static cache, commit the pending tokens, keep
    by the τ rule, and the kept tokens become the next pending ones; all in place."""
    N, B = pend.shape
    j = torch.arange(2 * B, device=pend.device)
    padded = torch.cat([pend, torch.full_like(pend, mask_id)], 1)  # (N, 2B)
    tokens = torch.where(j < n_pend[:, None], padded, mask_id)
    h = Qwen2.hidden(model, tokens, None, None, FastCache.over(k, v, lengths))  # (N, 2B, C)
    lengths.add_(n_pend)  # the commit: the pending tokens (none for a finished row)
    at = (n_pend - 1).clamp(min=0)[:, None] + torch.arange(B, device=pend.device)  # (N, B)
    logits = model.lm_head(h.gather(1, at[..., None].expand(-1, -1, h.shape[-1])))  # (N, B, V)
    c, kept = keep_on_device(logits, tau, eos, out, n_out, done, max_new)
    pend.copy_(c)
    n_pend.copy_(kept * ~done)


@torch.no_grad()
def generate_window_device(model, prompts, block_size, tau, max_new_tokens, mask_id, eos_ids=(), chunk=8,
                           step=window_step):
    """generate.generate(..., cache="window") greedy, with every step on the device -> per row
    its ids. tau: a float, passed as a tensor (a new τ is no new graph)."""
    N, B, device = len(prompts), block_size, model.lm_head.weight.device
    cfg, p = model.config, model.lm_head.weight
    cache = FastCache(cfg.num_hidden_layers, N, cfg.num_key_value_heads, cfg.head_dim,
                      max(map(len, prompts)) + max_new_tokens, 2 * B, p.dtype, device, static=True)
    lens = torch.tensor([len(q) for q in prompts], device=device)
    width = int(lens.max()) + B
    tokens = torch.tensor([q + [mask_id] * (width - len(q)) for q in prompts], device=device)
    h = model.hidden(tokens, cache=cache)  # the prefill: [prompt | B masks], eager
    cache.commit(lens)
    at = (lens - 1)[:, None] + torch.arange(B, device=device)
    logits = model.lm_head(h.gather(1, at[..., None].expand(-1, -1, h.shape[-1])))
    out = torch.zeros(N, max_new_tokens + B, dtype=torch.long, device=device)
    n_out = torch.zeros(N, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_ids) or [-1], device=device)
    tau_t = torch.tensor(float(tau), device=device)
    pend, kept = keep_on_device(logits, tau_t, eos, out, n_out, done, max_new_tokens)
    n_pend = kept * ~done
    while not bool(done.all()):  # the one read, every `chunk` steps
        for _ in range(chunk):
            step(model, pend, n_pend, cache.k, cache.v, cache.lengths, out, n_out, done, eos, max_new_tokens,
                 tau_t, mask_id)
    return [row[:n].tolist() for row, n in zip(out, n_out.tolist())]
