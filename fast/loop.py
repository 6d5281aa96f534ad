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

from decoding import logits_at, pad_rows
from fast.cache import FastCache
from model import Qwen2
from sampling import GREEDY, confidence, confident, pick


def keep_on_device(logits, tau, eos, out, n_out, done, max_new):
    """The τ rule (§5) and the EOS/budget cut of one step, in place on device state: logits (N,
    B, V) at [the last real token, masks 0 .. B-2] -> c (N, B) the candidates and k (N,) the
    tokens each row keeps (0 for a finished row), written into out at n_out (out has B spare
    columns past max_new, so the B writes of a row never share a column). tau: a tensor; AR is
    B = 1 (c_0 alone) or tau >= 1."""
    N, B, _ = logits.shape
    live = ~done
    c = pick(logits, GREEDY)  # (N, B): the greedy candidates (generate.candidates')
    passed = confident(confidence(logits[:, 1:], c[:, 1:]), tau)  # (N, B-1): p_j >= τ (generate.accept's)
    a = torch.where(tau >= 1, 1, 1 + passed.long().cumprod(1).sum(1))  # accepted, (N,); τ >= 1: AR
    j = torch.arange(B, device=c.device)
    is_eos = torch.isin(c, eos) & (j < a[:, None])
    first_eos = torch.where(is_eos, j, B).amin(1)  # (N,): B when no accepted EOS
    k = torch.minimum(torch.minimum(a, first_eos + 1), max_new - n_out) * live  # kept, (N,)
    at = n_out[:, None] + j  # (N, B): distinct columns, the spare ones past max_new never read
    out.scatter_(1, at, torch.where(j < k[:, None], c, out.gather(1, at)))
    n_out.add_(k)
    done.logical_or_(live & ((first_eos < k) | (n_out >= max_new)))
    return c, k


def ar_step(model, tok, k, v, lengths, out, n_out, done, eos, max_new):
    """One AR step over the static cache (k, v, lengths), every tensor updated in place. tok
    (N, 1): each row's last kept token, not yet in the cache (committed here for a live row);
    out, n_out, done, eos: as keep_on_device's."""
    live = ~done
    h = Qwen2.hidden(model, tok, None, None, FastCache.over(k, v, lengths))  # writes tok's K/V at lengths
    lengths.add_(live.long())  # the commit: tok is now in the cache of every live row
    c, _ = keep_on_device(model.lm_head(h), torch.ones((), device=tok.device), eos, out, n_out, done, max_new)
    tok.copy_(torch.where(live[:, None], c, tok))


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
    c, kept = keep_on_device(logits_at(model, h, (n_pend - 1).clamp(min=0), B), tau, eos, out, n_out, done,
                             max_new)
    pend.copy_(c)
    n_pend.copy_(kept * ~done)


def prefill(model, rows, lengths, B, max_new_tokens, step, eos_ids, tau):
    """The eager first forward of a device loop: rows (each a prompt, then what the loop's first
    window holds), committed up to the prompts' lengths, over a static cache sized for steps of
    `step` tokens, and the τ rule on its B outputs from the last prompt token -> the state:
    cache, out, n_out, done, eos, and the kept tokens c (N, B), k (N,)."""
    N, device = len(rows), model.lm_head.weight.device
    cache = model.new_cache(N, max(lengths) + max_new_tokens, step, static=True)  # whole key blocks
    lens = torch.tensor(lengths, device=device)
    h = model.hidden(pad_rows(rows, 0, device), cache=cache)
    cache.commit(lens)
    out = torch.zeros(N, max_new_tokens + B, dtype=torch.long, device=device)
    n_out = torch.zeros(N, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_ids) or [-1], device=device)
    c, k = keep_on_device(logits_at(model, h, lens - 1, B), torch.tensor(float(tau), device=device), eos,
                          out, n_out, done, max_new_tokens)
    if device.type == "cuda":  # a CUDA graph updates these very tensors in place
        for t in (out, n_out, done, eos, cache.lengths):
            torch._dynamo.mark_static_address(t)
    return cache, out, n_out, done, eos, c, k


def run_chunks(done, chunk, step):
    """Run step() `chunk` times between reads of the one flag, until every row is done."""
    while not bool(done.all()):  # the one read, every `chunk` steps
        for _ in range(chunk):
            step()


@torch.no_grad()
def generate_ar_device(model, prompts, max_new_tokens, eos_ids=(), chunk=8, step=ar_step):
    """Greedy AR decoding of `prompts` (lists of ids) by `model` (a FastQwen2, bf16 or not) with
    `step` (ar_step, or it compiled: torch.compile(ar_step, fullgraph=True)) -> per row its ids,
    as generate.generate_ar's Generation.ids. The host reads one flag every `chunk` steps."""
    n, lens = max_new_tokens, [len(q) for q in prompts]
    cache, out, n_out, done, eos, c, _ = prefill(model, prompts, lens, 1, n, 1, eos_ids, 1)
    tok = c.clone()  # (N, 1)
    if tok.is_cuda:
        torch._dynamo.mark_static_address(tok)
    k, v, lengths = cache.k, cache.v, cache.lengths
    run_chunks(done, chunk, lambda: step(model, tok, k, v, lengths, out, n_out, done, eos, n))
    return [row[:m].tolist() for row, m in zip(out, n_out.tolist())]


@torch.no_grad()
def generate_window_device(model, prompts, block_size, tau, max_new_tokens, mask_id, eos_ids=(), chunk=8,
                           step=window_step):
    """generate.generate(..., cache="window") greedy, with every step on the device -> per row
    its ids. tau: a float, passed as a tensor (a new τ is no new graph)."""
    B, n = block_size, max_new_tokens
    rows = [q + [mask_id] * B for q in prompts]  # the prefill: [prompt | B masks], as window_steps'
    cache, out, n_out, done, eos, pend, kept = prefill(model, rows, list(map(len, prompts)), B, n, 2 * B,
                                                       eos_ids, tau)
    n_pend = kept * ~done
    tau_t = torch.tensor(float(tau), device=pend.device)
    if pend.is_cuda:
        for t in (pend, n_pend, tau_t):
            torch._dynamo.mark_static_address(t)
    k, v, lengths = cache.k, cache.v, cache.lengths
    run_chunks(done, chunk, lambda: step(model, pend, n_pend, k, v, lengths, out, n_out, done, eos, n, tau_t,
                                         mask_id))
    return [row[:m].tolist() for row, m in zip(out, n_out.tolist())]
