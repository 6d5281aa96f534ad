"""Decoding plumbing shared by every decoder: what a step yields, the live τ, request
checks, the model's greedy pick, the one EOS/budget cut, and collecting results (docs/spec.md §5).

generate.py (the τ-gated loop, §5-§6), exact.py (exact mode) and chat.py all build on
this file, and it imports none of them (only the sampling kernels, sampling.py). It knows
no text and no checkpoint: prompts are lists of ids, EOS is a set of ids, and a decoder is
a generator of `Step`s that a caller runs to the end (`collect`) or streams (the chat).
"""

from dataclasses import dataclass, field

import torch

from sampling import Sampling, argmax, row_generators


@dataclass
class Knob:
    """The live settings of a session. A decoder reads `knob.tau` before every step, so a
    caller (or the chat's `/tau`) can change it between steps: `knob.tau = 1.0` -> AR from
    the next step (§5). `sampling` and `generators` are read once per request (the chat's
    `/temperature`, `/top-p`, `/top-k`, `/seed` change them between replies)."""
    tau: float
    sampling: Sampling = field(default_factory=Sampling)
    generators: list | None = None  # the session's row generators; None: fresh from sampling.seed


@dataclass
class Step:
    """What one decoding step produced, for all N rows of the batch."""
    tokens: list[list[int]]  # tokens kept this step per row; [] for a finished or idle row
    done: list[bool]  # row finished (EOS kept or max_new_tokens reached), after this step
    forwards: int  # model forwards so far, all rows together (prefill and block extensions too)
    tau: float  # the τ this step used (1.0 for AR and exact mode)
    # what the step's forward proposed, per row, for `generate.py --show` (show.py); None where a
    # decoder does not record it (the device loop), [] for a row the step did not decode
    proposed: list[list[int]] | None = None  # τ mode: the candidates c_0..; exact: the drafts verified
    conf: list[list[float]] | None = None  # τ mode: the candidates' confidences (None in AR mode)
    accepted: list[int] | None = None  # tokens the rule kept, before the EOS / budget cut
    committed: list[int] | None = None  # tokens written to the KV cache since the last step

    @property
    def counts(self) -> list[int]:
        return [len(t) for t in self.tokens]


@dataclass
class Generation:
    ids: list[int]  # generated tokens, prompt excluded, EOS included if one was kept
    forwards: int  # model forwards run while this prompt was still generating


# ---------------------------------------------------------------- τ: the threshold and AR mode
def ar_only(tau, metric="probability"):
    """AR mode (§5.5): accept c_0 only, without comparing anything with τ. It is the strict
    end of the metric's range: τ >= 1 for probability and margin (fp32 probabilities can
    round to exactly 1.0, so "p >= 1" is no safe way to say it), and τ = 0 for entropy,
    whose τ is an upper bound in nats (accept when H <= τ; τ = 1 nat is an ordinary, loose
    threshold there, and H can round to exactly 0)."""
    return tau == 0 if metric == "entropy" else tau >= 1


def check_tau(tau, metric="probability"):
    if metric == "entropy":
        if not tau >= 0:  # also rejects NaN
            raise ValueError(f"tau must be >= 0 for the entropy metric (0 = AR), got {tau}")
    elif not tau > 0:  # also rejects NaN
        raise ValueError(f"tau must be > 0, got {tau}")


# ---------------------------------------------------------------- request checks
def check_request(model, prompts, block_size, tau, max_new_tokens, mask_id=None, metric="probability"):
    """Raise ValueError with a clear message for anything a user can get wrong."""
    cfg = model.config
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    check_tau(tau.tau if isinstance(tau, Knob) else tau, metric)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if mask_id is not None and not 0 <= mask_id < cfg.vocab_size:
        raise ValueError(f"mask id {mask_id} is outside the vocabulary [0, {cfg.vocab_size})")
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) > cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(p)} tokens, longer than the model's context "
                             f"(max_position_embeddings={cfg.max_position_embeddings})")
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has a token id outside the vocabulary [0, {cfg.vocab_size})")


# ---------------------------------------------------------------- tensors in, tensors out
def pad_rows(rows, pad_id, device, width=None):
    """Right-pad lists of ids into a (N, T) tensor, T = the longest row, or `width`."""
    T = max(len(r) for r in rows) if width is None else width
    return torch.tensor([r + [pad_id] * (T - len(r)) for r in rows], dtype=torch.long, device=device)


def logits_at(model, h, start, n):
    """Logits of outputs start[i] .. start[i]+n-1 of each row: h (N, T, C) -> (N, n, V).
    The LM head runs only on the positions we read (V is 150k for Qwen2.5)."""
    idx = start[:, None] + torch.arange(n, device=h.device)  # (N, n)
    h = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))  # (N, n, C)
    return model.lm_head(h)


def greedy_pick(model):
    """The greedy pick (sampling.argmax's answer) a decoder uses with `model`: the model's own
    `argmax` where it brings one (the engine's FastQwen2: block maxima, faster on the CPU,
    fast/argmax.py), else sampling.argmax. The decoders hand it to sampling.pick and
    sample_drafts; nothing is replaced for the process."""
    return getattr(model, "argmax", argmax)


def streams(sampling, generators, n_rows, device):
    """The random streams of a request: None at temperature 0 (nothing is drawn), else the
    caller's `generators` (a list, one per row, or one torch.Generator), else one per row,
    row b seeded sampling.seed + b (sampling.row_generators)."""
    if sampling.greedy:
        return None
    if generators is None:
        return row_generators(sampling.seed, n_rows, device)
    if isinstance(generators, list) and len(generators) != n_rows:
        raise ValueError(f"{len(generators)} generators for {n_rows} prompts")
    return generators


def rows_of(gens, idx):
    """The streams of rows `idx` (a list of row indices); one shared Generator stays itself."""
    return gens if gens is None or isinstance(gens, torch.Generator) else [gens[b] for b in idx]


# ---------------------------------------------------------------- per-row results
class Rows:
    """Per-row output of a decoding run: generated tokens and finished flags.

    `keep` is the one place where the EOS rule (§5.6) and the token budget cut a row's
    new tokens; every decoder hands it what it accepted this step."""

    def __init__(self, n_rows, max_new, eos_ids):
        self.out = [[] for _ in range(n_rows)]
        self.done = [False] * n_rows
        self.max_new, self.eos_ids = max_new, frozenset(eos_ids)

    def active(self):
        return [i for i, d in enumerate(self.done) if not d]

    def left(self, i):
        """Tokens row i may still generate."""
        return self.max_new - len(self.out[i])

    def keep(self, tokens):
        """tokens: per row the tokens accepted this step (ignored for finished rows).
        Each row keeps them up to its budget and just after its first EOS (what followed
        the EOS is dropped, §5.6) -> the tokens kept per row."""
        kept = []
        for i, toks in enumerate(tokens):
            new = [] if self.done[i] else list(toks[: self.left(i)])
            eos = next((k for k, t in enumerate(new) if t in self.eos_ids), None)
            new = new if eos is None else new[: eos + 1]
            self.out[i] += new
            self.done[i] = self.done[i] or eos is not None or self.left(i) <= 0
            kept.append(new)
        return kept


def collect(steps, n_rows):
    """Run a step generator to the end -> one `Generation` per row."""
    out = [Generation([], 0) for _ in range(n_rows)]
    done = [False] * n_rows
    for step in steps:
        for i in range(n_rows):
            if not done[i]:
                out[i].ids += step.tokens[i]
                out[i].forwards = step.forwards
        done = step.done
    return out
