"""Exact mode: the AR output at several tokens per forward (docs/spec.md §8), greedy or
sampled.

The τ rule of §5 trades accuracy for speed. Exact mode keeps the AR output (greedy:
token for token; sampled: in distribution) and lets the model check its own mask
predictions, in the manner of speculative decoding with the MARS model as its own
drafter. The state of a row is a verified prefix P (in the KV cache), the next token
c_0 (an AR token after P, hence already correct, emitted but not cached yet), K drafts
d_1..d_K (mask predictions for the tokens after c_0) and, when sampling, q: the K
distributions the drafts were drawn from. One forward over

    [c_0, d_1..d_K | G_0 | G_1 | .. | G_K]          (mars.exact_attention_mask)

does three things at once:
  verify  c_0, d_1..d_K are plain causal real tokens; the output at each is the exact
          AR distribution p of the following token. Speculative sampling (Leviathan et
          al. 2023, Chen et al. 2023; sampling.speculative_accept) accepts d_i with
          probability min(1, p(d_i)/q(d_i)), q the mask distribution d_i was drawn from;
          at the first rejection the next c_0 (the "bonus" token) is drawn from
          normalise(max(0, p - q)), after the last draft from p. The step emits d_1..d_a
          and the bonus: 1 + a tokens, distributed exactly as AR sampling. At temperature
          0, p and q are one-hot: d_i is accepted while it equals the AR argmax, and the
          bonus is the argmax after the last accepted token (the greedy output).
  draft   group G_j holds g masks that see P, c_0, d_1..d_j and their own earlier
          masks only; its mask m sits at position |P|+j+1+m (mask 0 at the position of
          the next c_0) and, right-shifted as in §3/§5, predicts the token after that
          position. So G_a, the group that saw exactly the accepted tokens, holds the
          drafts for the tokens after the bonus (lookahead 2..g+1, as the noisy stream
          of §3 is trained): d ~ q = the processed distribution of G_a's logits, kept
          for the next step's verification (sampling.sample_drafts). With
          draft_threshold > 0 only a leading run of positions whose fp32 softmax
          probability of their argmax is >= the threshold is kept (the cut never looks
          at the drawn draft, which would bias it), so fewer real tokens and groups are
          forwarded next time.
  cache   c_0, d_1..d_a were computed as real tokens on a verified prefix: their K/V
          are committed (§6). The rejected drafts and every mask lie past `lengths`
          and are overwritten by the next forward.

Group size: g = K. Mask m's output depends (causally) on masks 0..m of its group
only, so masks past the K-th cannot change the K drafts we read; K <= B because
the model was trained on noisy blocks of B masks (§3: mask m of a block learned to look
m + 2 tokens past its last real token, up to B + 1), so B is a bound on K, not a count of
masks to forward.

The first forward is the prefill [prompt | K masks], plain causal: c_0 is the argmax
at the last prompt token, G_0 gives the first drafts, and only the prompt is
committed. It emits c_0, like the AR prefill. With every draft rejected, exact mode
is plain AR: one token per forward.

Batches: rows are right-padded; a row with fewer drafts than another gets pad tokens
in its unused draft slots. Only tokens after a row's real drafts and groups G_j with
j past its draft count see them, and their outputs are never read (the verification
tests only a row's own n drafts), so one (T, T) mask serves the batch. Finished rows
idle (commit nothing; they still draw, harmlessly: they emit nothing).

Random numbers (sampling.py): row b's generator per step draws its n_b accept uniforms,
one bonus token and its g drafts, in an order that depends on row b alone, so a row in a
batch is the row alone with the same generator (up to bitwise-equal logits).

    generate_exact(model, prompts, block_size=4, drafts=4, max_new_tokens=256,
                   mask_id=tok.mask_id, eos_ids=eos)  -> [Generation(ids, forwards), ...]
"""

import functools

import torch

from decoding import Rows, Step, check_request, collect, greedy_pick, logits_at, pad_rows, streams
from mars import exact_attention_mask
from sampling import GREEDY, argmax, greedy_accept, pick, processed_probs, sample_drafts, speculative_accept


# ---------------------------------------------------------------- one step
def step_input(c0, drafts, group_size, lengths, mask_id):
    """The tokens (N, T), position ids (N, T) and mask (T, T) of one step, T = (1+k)(1+g).

    c0: the pending token per row; drafts: per row a list of drafts, k the most any row has;
    lengths (N,): the cached prefix length |P| of each row. Real token i sits at position
    |P|+i, mask m of group j at |P|+j+1+m."""
    k, device = max(map(len, drafts)), lengths.device
    real = pad_rows([[c] + d for c, d in zip(c0, drafts)], mask_id, device, 1 + k)  # (N, 1+k)
    masks = torch.full((len(c0), (1 + k) * group_size), mask_id, dtype=torch.long, device=device)
    offsets, mask = step_layout(k, group_size, device)
    return torch.cat([real, masks], 1), lengths[:, None] + offsets, mask


@functools.cache
def step_layout(k, group_size, device):
    """What a step's shape fixes, made once per (k, g, device) (~50 µs a step on the CPU):
    the position offsets (T,) of the tokens from |P| and the (T, T) mask. Read only."""
    j = torch.arange(1 + k, device=device).repeat_interleave(group_size)  # group of each mask
    m = torch.arange(group_size, device=device).repeat(1 + k)  # index inside the group
    offsets = torch.cat([torch.arange(1 + k, device=device), j + 1 + m])  # (T,)
    return offsets, exact_attention_mask(k, group_size, device)


def verify(logits, drafts, q, sampling=GREEDY, gens=None, argmax=argmax):
    """How many drafts each row accepts, and the bonus token after them: speculative
    sampling against the AR path of the same forward (sampling.speculative_accept).

    logits (N, T, V): the step's logits; the first 1+k are at the real tokens c_0, d_1..d_k
    and give p, the processed AR distribution of the token after each. drafts:
    per row its <= k drafts; q (N, >= k, V): the distributions they were drawn from (None
    at temperature 0). Accept d_i with probability min(1, p(d_i)/q(d_i)); at the first
    rejection draw the bonus from normalise(max(0, p - q)), after the last draft from p.
    At temperature 0 (one-hot p, q) the same rule reads only the argmaxes
    (sampling.greedy_accept): accept while d_i == the AR argmax; the bonus is the argmax
    after the last accepted draft (`argmax`: the model's greedy pick). -> a (N,), bonus (N,)."""
    k, device = max(map(len, drafts)), logits.device
    logits = logits[:, : 1 + k]  # (N, 1+k, V): the AR outputs
    n = torch.tensor([len(d) for d in drafts], device=device)  # (N,): real drafts per row
    d = pad_rows(drafts, 0, device) if k else n[:, None][:, :0]  # (N, k); padding never tested
    if sampling.greedy:
        return greedy_accept(pick(logits, GREEDY, argmax=argmax), d, n)
    return speculative_accept(processed_probs(logits, sampling), q[:, :k], d, n, gens)


def draft(logits, threshold, sampling=GREEDY, gens=None, argmax=argmax):
    """Mask logits (N, g, V) -> (drafts per row, q (N, g, V)): d ~ q = the processed
    distribution (the argmaxes at temperature 0, q None), cut before the first position
    whose fp32 softmax probability of its argmax is below `threshold` (0 keeps all g); q is
    kept for the next step's verification (sampling.sample_drafts; `argmax`: the model's greedy pick)."""
    d, n, q = sample_drafts(logits, sampling, gens, threshold, argmax)  # (N, g), (N,), (N, g, V)
    return [row[:k] for row, k in zip(d.tolist(), n.tolist())], q


def group_logits(logits, a, n_drafts, group_size):
    """Logits (N, g, V) of group G_a of each row: the group that saw exactly the accepted
    prefix. Groups start after the 1+k real tokens. logits (N, T, V): the whole step's."""
    start = 1 + n_drafts + a * group_size  # (N,)
    idx = start[:, None] + torch.arange(group_size, device=logits.device)  # (N, g)
    return logits[torch.arange(len(a), device=logits.device)[:, None], idx]  # (N, g, V)


def keep_verified(cache, a, going):
    """The cache update (§6): keep c_0, d_1..d_a of each row still generating; drop the
    rest (rejected drafts and all masks lie past `lengths`, overwritten next time)."""
    cache.commit(torch.where(going, 1 + a, torch.zeros_like(a)))


# ---------------------------------------------------------------- the loop
def check_exact(drafts, block_size, draft_threshold):
    if not 1 <= drafts <= block_size:
        raise ValueError(f"drafts must be in [1, block_size={block_size}] (the model was trained "
                         f"on blocks of {block_size} masks), got {drafts}")
    if not 0 <= draft_threshold <= 1:  # also rejects NaN
        raise ValueError(f"draft_threshold must be in [0, 1], got {draft_threshold}")


@torch.no_grad()
def exact_steps(model, prompts, *, block_size, drafts, max_new_tokens, mask_id, eos_ids=(),
                draft_threshold=0.0, sampling=GREEDY, generators=None):
    """Decode a batch of prompts in exact mode, yielding a decoding.Step per forward.

    The tokens are distributed exactly as AR sampling with `sampling` (sampling.Sampling;
    at temperature 0, the default, they are the greedy AR tokens; Step.tau is 1.0: the
    τ = 1 output). generators: one torch.Generator per row (default: row b seeded
    sampling.seed + b), or one for all. drafts: K, the drafts per step and the masks per
    group (1 <= K <= block_size, the B the model was trained with). A row stops after an
    EOS id or max_new_tokens; finished rows idle while the others go on."""
    check_request(model, prompts, block_size, 1.0, max_new_tokens, mask_id)
    check_exact(drafts, block_size, draft_threshold)
    K, eos_ids, s = drafts, tuple(eos_ids), sampling
    top = greedy_pick(model)  # the model's greedy pick: sampling.argmax's answer
    prompts = [list(map(int, p)) for p in prompts]
    N, device = len(prompts), next(model.parameters()).device
    cache = model.new_cache(N, max(map(len, prompts)) + max_new_tokens, step=(1 + K) ** 2)
    rows, gens = Rows(N, max_new_tokens, eos_ids), streams(s, generators, N, device)

    # prefill: [prompt | G_0] plain causal; commit the prompt only
    lens = torch.tensor([len(p) for p in prompts], device=device)
    h = model.hidden(pad_rows([p + [mask_id] * K for p in prompts], mask_id, device), cache=cache)
    cache.commit(lens)
    logits = logits_at(model, h, lens - 1, 1 + K)  # (N, 1+K, V): last prompt token, G_0
    c0 = pick(logits[:, :1], s, gens, top)[:, 0].tolist()  # the AR token after the prompt
    d, q = draft(logits[:, 1:], draft_threshold, s, gens, top)  # drafts, and q (N, K, V) for the next step
    forwards = 1
    new = rows.keep([[c] for c in c0])
    yield Step(new, list(rows.done), forwards, 1.0, proposed=[[] for _ in prompts], accepted=[1] * N,
               committed=[len(p) for p in prompts])  # what --show prints (show.py)

    while not all(rows.done):
        # drafts past the budget could never be emitted: do not forward them
        d = [[] if rows.done[b] else d[b][: rows.left(b) - 1] for b in range(N)]
        k = max(map(len, d))  # drafts' slots this step
        tokens, positions, mask = step_input(c0, d, K, cache.lengths, mask_id)
        # one LM head call for the verification and every group: which group is read
        # depends on the verification, and a second call would stream the head's V x C
        # weights again (results/SPEED.md, issue 22)
        logits = model.lm_head(model.hidden(tokens, positions, mask, cache))  # (N, T, V)
        forwards += 1
        a, bonus = verify(logits, d, q, s, gens, top)
        d_next, q = draft(group_logits(logits, a, k, K), draft_threshold, s, gens, top)
        emitted = [d[b][:n] + [c] for b, (n, c) in enumerate(zip(a.tolist(), bonus.tolist()))]
        new = rows.keep(emitted)
        keep_verified(cache, a, ~torch.tensor(rows.done, device=device))
        shown = dict(proposed=d, accepted=[len(e) for e in emitted],  # for --show (show.py)
                     committed=[0 if done else len(e) for e, done in zip(emitted, rows.done)])
        c0, d = bonus.tolist(), d_next
        yield Step(new, list(rows.done), forwards, 1.0, **shown)


def generate_exact(model, prompts, *, block_size, drafts, max_new_tokens, mask_id, eos_ids=(),
                   draft_threshold=0.0, sampling=GREEDY, generators=None):
    """Exact-mode decode a batch of prompts -> list of `Generation` (ids, forwards), one per
    prompt; at temperature 0 the ids equal greedy AR decoding (generate.generate_ar) token
    for token, otherwise they are distributed as AR sampling (generate_ar with `sampling`)."""
    steps = exact_steps(model, prompts, block_size=block_size, drafts=drafts,
                        max_new_tokens=max_new_tokens, mask_id=mask_id, eos_ids=eos_ids,
                        draft_threshold=draft_threshold, sampling=sampling, generators=generators)
    return collect(steps, len(prompts))
