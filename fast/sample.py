"""Sampling on the device: random numbers from a counter, not from a generator's state.

The reference (sampling.py) draws with torch.multinomial from one torch.Generator per row, as
Hugging Face does; a generator is host-side state that a captured graph cannot carry from one
step to the next. Here a step's uniforms are a hash of (seed, step, position): row b of a batch
has the seed `seed + b` (sampling.row_generators' convention), `step` counts the forwards of the
request (0 for the prefill) and `position` is the candidate's place in the step. Nothing is
stored between steps, so a replayed graph draws new numbers from the step counter alone, a
request is reproducible from its seed, and a row's draws do not depend on the other rows
(a row in a batch draws what it draws alone with the same seed).

  counter_uniforms(seeds, step, n)   (N,) seeds, () step -> (N, n) uniforms in (0, 1)
  draw(probs, u)                     inverse CDF: the token whose cumulative interval holds u
  probs_of(logits, s)                processed_probs, NaN rows (overflowing temperatures) one-hot
  candidates(logits, s, seeds, step, argmax)  argmax(logits) at temperature 0, else draw(probs_of, u)
  speculative(p, q, d, n, u)         exact mode's speculative acceptance (sampling.speculative_accept)

The hash is `mix32`, Chris Wellons's "lowbias32" finaliser, on 32-bit words held in int64 with
every product split so that nothing overflows (the same numbers on every device and backend).
A uniform has 32 bits: a token's probability is resolved to 2^-32 (torch.multinomial's fp32
CDF resolves it to about 2^-24). The tokens follow processed_probs exactly up to that
(tests/test_device_sampling.py: chi-square, and a brute-force decode with the rule written out).
"""

import torch

from fast.argmax import block_argmax
from sampling import processed_probs, speculative_rule

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / the golden ratio: keeps the key (0, 0, 0) off the hash's fixed point 0


def mul32(x, m):
    """(x * m) mod 2^32 for int64 tensors x in [0, 2^32) and a constant m < 2^32, with no
    product above 2^49 (int64 overflow is undefined in the C++ inductor writes)."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def mix32(x):
    """A 32-bit hash (lowbias32): every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(seeds, step, n):
    """Uniforms in (0, 1), float64, (N, n): position j of row b at this step gets
    (mix32(mix32(mix32(seed_b ^ GOLDEN) ^ step) ^ j) + 1/2) / 2^32, all words cut to 32 bits.
    seeds (N,), step () int64 tensors. (mix32 maps 0 to 0: without GOLDEN the default seed 0
    would draw u = 2^-33, the first possible token, at its first position of step 0.)"""
    row = mix32(mix32((seeds & M32) ^ GOLDEN) ^ (step & M32))  # (N,): this row at this step
    h = mix32(row[:, None] ^ torch.arange(n, device=seeds.device))  # (N, n)
    return (h.double() + 0.5) / 2.0**32


def draw(probs, u):
    """One token per distribution by the inverse CDF: probs (..., V), u (...) in (0, 1) -> the
    first token whose float64 cumulative sum exceeds u times the total (a token of probability
    0 is never drawn: its interval is empty). probs that are no distribution (NaN: `probs_of`
    prevents it) still give a token inside the vocabulary, its largest finite entry's."""
    cdf = probs.double().cumsum(-1)
    x = (u * cdf[..., -1]).unsqueeze(-1)  # < the total, so some token's interval holds it
    token = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    broken = ~torch.isfinite(cdf[..., -1]) | (cdf[..., -1] <= 0)
    return torch.where(broken, probs.nan_to_num(nan=-1.0).argmax(-1), token)


def probs_of(logits, s):
    """sampling.processed_probs, except that a row which is no distribution (a temperature so
    small that logits / temperature overflow float32: NaN) is the one-hot of its argmax, the
    limit temperature 0. The reference's torch.multinomial raises there; a graph cannot."""
    probs = processed_probs(logits, s)
    broken = ~torch.isfinite(probs.sum(-1, keepdim=True))
    one_hot = torch.zeros_like(probs).scatter_(-1, block_argmax(logits)[..., None], 1.0)
    return torch.where(broken, one_hot, probs)


def candidates(logits, s, seeds, step, argmax):
    """The candidate at each position: logits (N, n, V) -> (N, n). Temperature 0: `argmax` (the
    model's greedy pick, no random number used); else a draw from the processed distribution
    (temperature, top-k, top-p: sampling.processed_probs) with this step's uniforms."""
    if s.greedy:
        return argmax(logits)
    return draw(probs_of(logits, s), counter_uniforms(seeds, step, logits.shape[1]))


def speculative(p, q, d, n, u):
    """sampling.speculative_accept with the counter's numbers: p (N, K+1, V) the processed AR
    distributions at c_0, d_1..d_K; q (N, K, V) the distributions the drafts d (N, K) were drawn
    from, row b's first n[b] real; u (N, K+1): u[:, :K] the accept tests, u[:, K] the bonus draw.
    The rule is the reference's own (sampling.speculative_rule) -> a (N,) accepted, bonus (N,).
    Its tokens are distributed as AR sampling from p."""
    a, then = speculative_rule(p, q, d, n, u[:, :d.shape[1]])
    return a, draw(then, u[:, d.shape[1]])
