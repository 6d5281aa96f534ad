"""Sampling kernels: logits -> the sampling distribution, a draw, the τ confidence, and the
speculative-sampling rule (docs/spec.md §5; issue 13). No model, no loop, no cache: the
decoders (generate.py, exact.py) call these on the logits they read.

  Sampling(temperature, top_k, top_p, seed, accept_metric)   the settings (frozen, checked)
  processed_probs(logits, s)   temperature, then top-k, then top-p, then softmax: exactly
                               Hugging Face's warpers, in HF's order, >= 1 token kept
  argmax(logits)               the float32 argmax, first index on ties
  pick(logits, s, gens)        temperature 0: argmax (the greedy rule of §5.2, unchanged; a
                               decoder hands it its model's: decoding.greedy_pick);
                               else one draw from processed_probs
  confidence / confident       the number compared with τ (§5.3-4) and the comparison
  sample_drafts(logits, s, gens, threshold)        exact mode's drafts d ~ q and q itself
  speculative_accept(p, q, d, n, gens)             accept d_i w.p. min(1, p/q), left to right
  speculative_rule(p, q, d, n, u)                  the same, given its uniforms
  greedy_accept(t, d, n)       the same rule at temperature 0, on argmaxes (no one-hot tensors)

Which probability τ is compared with: the RAW softmax of the logits, in float32 (temperature
1, no top-k/top-p), evaluated at the chosen candidate. Why: (1) it is what the authors'
released sampler does (Xalp/MARS, mars/samplers/mars_sampler.py `left_to_right_step` and
mars_batch_sampler.py: the candidate is drawn with Gumbel noise on the logits at the given
temperature, but `p = softmax(logits)` scores it; entropy and margin use the same raw p);
(2) τ then measures the model's own certainty, the same number at every temperature, so a
τ tuned greedily keeps its meaning; (3) as temperature -> 0 the draw tends to the argmax and
the confidence stays the raw probability of it, so temperature 0 is the greedy rule of §5.3
exactly, whereas the processed distribution tends to one-hot (confidence 1: accept all).

How a token is drawn: torch.multinomial on the processed distribution, the call HF's
generate(do_sample=True) makes (so one Generator reproduces HF's draws token for token), not
the authors' float64 Gumbel-max trick (the same distribution when top-k and top-p are off;
theirs has neither). Note HF's GenerationConfig defaults to top_k = 50; ours is 0 (off).

Random numbers: `gens` is either a list of torch.Generators, one per row (the decoders'
use: each row consumes only its own stream, in an order that depends on the row alone, so a
row decoded in a batch equals the same row decoded alone with the same generator seed), or
one torch.Generator for the whole batch (rows consume it in row-major order, so a row's
draws depend on its place in the batch; fast, used by the Monte Carlo tests). Temperature 0
consumes nothing. Generators live on the logits' device (`row_generators`).
"""

import math
from dataclasses import dataclass

import torch

METRICS = ("probability", "entropy", "margin")


# ---------------------------------------------------------------- settings
@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 is greedy (argmax); the default everywhere
    top_k: int = 0  # keep the k most probable tokens (ties at the k-th kept, as HF); 0 = off
    top_p: float = 1.0  # keep the smallest set of tokens with mass >= top_p; 1.0 = off
    seed: int = 0  # row b's generator is seeded seed + b (row_generators)
    accept_metric: str = "probability"  # what τ is compared with: see `confidence`

    def __post_init__(self):
        check_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_sampling(s):
    """Raise ValueError naming the flag for any setting a user can get wrong."""
    t, k, p = s.temperature, s.top_k, s.top_p
    if not (isinstance(t, int | float) and math.isfinite(t) and t >= 0):  # also rejects NaN
        raise ValueError(f"--temperature must be >= 0, got {t:g}" if isinstance(t, float) else
                         f"--temperature must be >= 0, got {t!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"--top-k must be an integer >= 0 (0 = off), got {k}")
    if not (isinstance(p, int | float) and 0 < p <= 1):  # also rejects NaN
        raise ValueError(f"--top-p must be in (0, 1], got {p}")
    if isinstance(s.seed, bool) or not isinstance(s.seed, int):
        raise ValueError(f"--seed must be an integer, got {s.seed!r}")
    if s.accept_metric not in METRICS:
        raise ValueError(f"--accept-metric must be one of {', '.join(METRICS)}, got {s.accept_metric!r}")


GREEDY = Sampling()  # temperature 0: the default of every decoder (the greedy rule of §5)


def row_generators(seed, n_rows, device):
    """One generator per row, row b seeded seed + b, on the device the logits live on."""
    return [torch.Generator(device=device).manual_seed(seed + b) for b in range(n_rows)]


# ---------------------------------------------------------------- the greedy token
def argmax(logits):
    """The index of the largest float32 logit, the first one on ties (NaN counts as the
    largest): the greedy token of §5.2. pick and sample_drafts take it as a default: a decoder
    passes its model's greedy pick (decoding.greedy_pick), which for the engine's model is
    fast.argmax.block_argmax, the same answer faster on the CPU."""
    return logits.float().argmax(-1)


# ---------------------------------------------------------------- the distribution
def processed_probs(logits, s):
    """logits (..., V) -> float32 probabilities (..., V) after temperature, top-k, top-p.

    Mirrors transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper
    (min_tokens_to_keep=1) op for op on float32 logits, so the result is bit-identical to
    HF's warpers followed by softmax. Temperature 0 gives the one-hot of the argmax (the
    limit; first index on ties, like argmax): the greedy rule as a distribution."""
    x = logits.float()
    if s.greedy:
        return torch.zeros_like(x).scatter_(-1, argmax(x)[..., None], 1.0)
    if s.temperature != 1.0:  # HF adds the warper only when temperature != 1
        x = x / s.temperature
    if s.top_k > 0:  # drop what is below the k-th largest score; ties with it stay
        k = min(s.top_k, x.shape[-1])
        x = x.masked_fill(x < torch.topk(x, k)[0][..., -1, None], -math.inf)
    if s.top_p < 1.0:  # ascending sort; drop the low tail whose mass is <= 1 - top_p
        sorted_x, order = torch.sort(x, descending=False)
        drop = sorted_x.softmax(-1).cumsum(-1) <= (1 - s.top_p)
        drop[..., -1:] = 0  # the most probable token always stays
        x = x.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return x.softmax(-1)


# ---------------------------------------------------------------- draws
def categorical(probs, gens):
    """One draw per distribution: probs (N, ..., V) -> tokens (N, ...). gens: one
    Generator (the batch consumes it in row-major order) or a list, one per row N; None
    only for one-hot distributions (temperature 0): their argmax, no randomness used."""
    V = probs.shape[-1]
    draw = lambda pr, g: torch.multinomial(pr.reshape(-1, V), 1, generator=g).view(pr.shape[:-1])
    if gens is None:
        return probs.argmax(-1)
    if isinstance(gens, torch.Generator):
        return draw(probs, gens)
    if len(gens) != probs.shape[0]:
        raise ValueError(f"{len(gens)} generators for {probs.shape[0]} rows")
    return torch.stack([draw(probs[b], g) for b, g in enumerate(gens)])


def pick(logits, s, gens=None, argmax=argmax):
    """The token at each position: logits (N, ..., V) -> (N, ...). Temperature 0 is the
    argmax of the float32 logits (today's greedy rule, no randomness used; `argmax` computes
    it); otherwise a draw from processed_probs: with per-row generators, one multinomial per
    row over that row's positions, from the row's own stream, whatever the other rows are."""
    if s.greedy:
        return argmax(logits)
    return categorical(processed_probs(logits, s), gens)


# ---------------------------------------------------------------- the τ confidence (§5.3)
def confidence(logits, chosen, metric="probability"):
    """The number compared with τ for candidate `chosen` (N, ...) at logits (N, ..., V).

    All three read the RAW float32 softmax p of the logits (see the module docstring), as
    the authors' sampler does:
      probability  p(chosen)                  accept if >= τ (§5.3; the default)
      entropy      H(p) = -sum p log p, nats  accept if <= τ (low entropy = confident)
      margin       p(top 1) - p(top 2)        accept if >= τ (of the distribution, not of
                                              `chosen`, as in the authors' code)"""
    p = logits.float().softmax(-1)  # (N, ..., V)
    if metric == "probability":
        return p.gather(-1, chosen[..., None])[..., 0]
    if metric == "entropy":
        return torch.special.entr(p).sum(-1)  # entr(0) = 0: no log(0)
    if metric == "margin":
        top = torch.nn.functional.pad(p, (0, 1)).topk(2, -1).values  # pad: V = 1 has margin p
        return top[..., 0] - top[..., 1]
    raise ValueError(f"--accept-metric must be one of {', '.join(METRICS)}, got {metric!r}")


def confident(conf, tau, metric="probability"):
    """Does each candidate pass τ? (bool, conf's shape). The τ >= 1 'AR only' rule of
    §5.5 stays with the decoder's accept(), which knows it is a mode, not a threshold."""
    return conf <= tau if metric == "entropy" else conf >= tau


# ---------------------------------------------------------------- exact mode (speculative)
def sample_drafts(logits, s, gens=None, threshold=0.0, argmax=argmax):
    """Exact mode's drafts from mask logits (N, g, V) -> d (N, g), n (N,), q (N, g, V).

    q = processed_probs(logits): the draft distribution, to be kept for the verification
    in the NEXT step; None at temperature 0, where it is the one-hot of d and the greedy
    verification (greedy_accept) reads d alone, so no (N, g, V) tensor is built. d ~ q
    (the argmax at temperature 0). n: the leading run of positions whose raw float32
    probability of their argmax is >= threshold (threshold 0 keeps all g, no softmax
    computed). The cut reads the position's distribution, never the drawn d, so it cannot
    bias the drafts (a cut on p(d_i) would make the kept d_i follow q restricted, not q);
    at temperature 0 d is that argmax, so it is exact.py's greedy cut unchanged. `argmax`
    computes the argmaxes (pick's)."""
    top = argmax(logits)  # (N, g)
    n = torch.full(top.shape[:1], top.shape[1], dtype=torch.long, device=top.device)  # (N,)
    if threshold > 0:  # raw prob of each argmax
        n = (confidence(logits, top) >= threshold).long().cumprod(1).sum(1)
    if s.greedy:
        return top, n, None
    q = processed_probs(logits, s)  # (N, g, V)
    return categorical(q, gens), n, q


def speculative_accept(p, q, d, n, gens):
    """The speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023).

    p (N, k+1, V): target distributions (processed AR outputs at c_0, d_1..d_k: p[:, i] is
    the distribution of the token after d_i); q (N, k, V): the draft distributions d was
    drawn from; d (N, k): drafts, row b's first n[b] real (the rest padding, never read).
    Accept d_i with probability min(1, p(d_i)/q(d_i)), left to right; at the first
    rejection draw the next token from normalise(max(0, p - q)) there; if all n[b] are
    accepted draw it from p after the last draft. -> a (N,) accepted, next_token (N,).
    The emitted d_1..d_a, next is distributed exactly as AR sampling from p.
    Randomness per row: n[b] uniforms, then one categorical draw. One-hot p and q
    (temperature 0) give the greedy rule: accept while d_i == argmax, then the argmax,
    whatever the random numbers; gens=None (temperature 0 only) draws none."""
    N, k = d.shape
    if k == 0:
        return torch.zeros(N, dtype=torch.long, device=d.device), categorical(p[:, 0], gens)
    a, then = speculative_rule(p, q, d, n, _uniforms(N, k, n, gens, p.device))
    return a, categorical(then, gens)


def speculative_rule(p, q, d, n, u):
    """speculative_accept given its uniforms u (N, k) in [0, 1), k >= 1 (fast/sample.py draws
    them from a counter instead of generators) -> a (N,) the accepted drafts, and (N, V) the
    distribution the next token is drawn from: the residual at the first rejection, else p."""
    N, k = d.shape
    pd = p[:, :k].gather(-1, d[..., None])[..., 0]  # (N, k): target prob of each draft
    qd = q.gather(-1, d[..., None])[..., 0]  # (N, k): its draft prob
    ok = (u * qd < pd) & (torch.arange(k, device=d.device) < n[:, None])  # u < p/q, no 0/0
    a = ok.long().cumprod(1).sum(1)  # (N,): the leading run of accepted drafts
    row = torch.arange(N, device=d.device)
    p_a, q_a = p[row, a], q[row, a.clamp(max=k - 1)]  # (N, V): at the first rejection or after d_n
    residual = (p_a - q_a).clamp(min=0)
    rejected = (a < n) & (residual.sum(-1) > 0)  # p == q to the last bit never rejects; guard anyway
    return a, torch.where(rejected[:, None], residual, p_a)


def greedy_accept(t, d, n):
    """speculative_accept at temperature 0, on the argmaxes instead of one-hot p and q (no
    (N, k+1, V) tensor). t (N, k+1): the argmax of each target distribution (p = one-hot(t));
    d (N, k): the drafts, row b's first n[b] real (q = one-hot(d): a draft is the argmax of
    its mask). Then p(d_i)/q(d_i) is 1 if d_i == t_i, else 0, whatever the uniform: the
    accepted drafts are the leading run of d_i == t_i; at the first rejection the residual
    max(0, p - q) is one-hot(t_a) (t_a != d_a), after the last draft the draw is from p:
    the next token is t_a either way. -> a (N,), next_token (N,). Proved equal to
    speculative_accept on the one-hot p, q in tests/test_sampling.py."""
    k = d.shape[1]
    ok = (d == t[:, :k]) & (torch.arange(k, device=d.device) < n[:, None])  # (N, k)
    a = ok.long().cumprod(1).sum(1)  # (N,)
    return a, t.gather(1, a[:, None])[:, 0]


def _uniforms(N, k, n, gens, device):
    """U[0, 1) numbers for the accept tests: (N, k). Per-row generators draw n[b] each
    (padding is never tested), so a row's stream does not depend on the batch's k.
    gens=None (one-hot p, q: p(d)/q(d) is 0 or 1) -> zeros: the test is then exact."""
    if gens is None:
        return torch.zeros(N, k, device=device)
    if isinstance(gens, torch.Generator):
        return torch.rand(N, k, generator=gens, device=device)
    u = torch.ones(N, k, device=device)
    for b, (g, nb) in enumerate(zip(gens, n.tolist())):
        u[b, :nb] = torch.rand(nb, generator=g, device=device)
    return u
