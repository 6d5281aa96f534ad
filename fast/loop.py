"""Decoding with the whole step on the device: AR, the τ window and exact mode (issue 49).

The reference decoders (generate.py, exact.py) run the LM head, the pick, the acceptance, the
EOS/budget cut and the cache update between forwards, in Python, reading the kept tokens back
to the host every step: on a GPU each read drains the device before the next step can launch.
Here a batch's state lives on the device (`State`: the static cache, the next forward's real
tokens, an output buffer, the finished flags, τ, the EOS ids, the budget, the random numbers'
seeds and step counter), allocated once per shape and reused by the requests of that shape,
and one function does a whole step on it, in place:

  ar_step      forward the pending token; the head on that row; the pick; EOS/budget cut;
               write to the output buffer; commit; the next input
  window_step  forward [pending | B masks] (2B wide); the τ rule on the device (`keep`, τ a
               tensor: a new τ is no new graph); commit the pending tokens; the kept ones
               are the next pending tokens (generate.window_steps)
  exact_step   forward [c_0, d_1..d_K | G_0 .. G_K] ((1+K)^2 wide); the verification (greedy:
               sampling.greedy_accept; sampled: fast.sample.speculative); emit; commit c_0,
               d_1..d_a; the group G_a gives the next drafts (exact.exact_steps)

The greedy pick is the model's own (FastQwen2.argmax: block maxima, fast/argmax.py), as the
reference decoders read it (decoding.greedy_pick).

Compiled whole (`torch.compile(step, fullgraph=True)`), a step is one graph; the host replays
it `chunk` steps at a time and then reads the device once (`steps`: the new output columns,
each step's emitted counts, the finished flags), yielding the reference's decoding.Steps. A
finished row keeps stepping, masked: it emits and commits nothing. A State serves a shape: a
new request within it (other prompts, budget, up to EOS_SLOTS EOS ids, τ, seed) is no new
graph; a request past its cache's 512-slot blocks is a new State and a new graph. Sampling
draws with counter-based random numbers (fast/sample.py: a hash of the row's seed, the step and
the position), so a graph replays with no generator state; exact mode samples by
fast.sample.speculative.

What they must equal: generate.generate_ar, generate.generate and exact.generate_exact, token
for token (greedy; ragged prompts, EOS in the middle of a chunk, several τ and K), and a
brute-force decode with the sampling rule written out (tests/test_fast_loop.py,
tests/test_device_sampling.py, float64); what they must not do: read anything back inside a
step (the same tests run steps on the meta device, where every read-back raises).
"""

import weakref
from collections import OrderedDict

import torch

from decoding import Step, check_request, collect, logits_at, pad_rows
from exact import check_exact, step_layout
from fast.attention import round_up
from fast.cache import KEY_BLOCK, FastCache
from fast.sample import candidates, counter_uniforms, draw, probs_of, speculative
from fast.step import compiled
from model import Qwen2
from sampling import GREEDY, confidence, confident, greedy_accept, sample_drafts

EOS_SLOTS = 8  # EOS ids a State holds (-1 padded); more make a wider buffer (a new graph)
MAX_STATES = 4  # States kept per model (each holds a static KV cache); the least recently used goes
HISTORY = 64  # steps a State remembers the emitted counts of: a chunk is at most HISTORY - 1 steps
_STATES = weakref.WeakKeyDictionary()  # model -> OrderedDict {(kind, shape): State}, most recent last


class State:
    """A batch's decoding state on the device, allocated once per (decoder, batch size, cache
    slots, step width, B, dtype) and reused by the requests of that shape (`start`), so a compiled
    step sees the same tensors every request (and a CUDA graph the same addresses):

      cache          a static FastCache: k, v (layers, N, kv heads, slots, head dim), lengths (N,)
      tok, n_tok     the real tokens of the next forward (N, B) and how many are real (N,):
                     AR's next token, the window's pending tokens, exact mode's [c_0, drafts]
      out, n_out     the emitted tokens (N, slots + B) and their count per row (N,)
      done           (N,) bool: an EOS id kept or the budget reached
      eos, max_new   the EOS ids (-1 padded), the budget (a 0-d tensor: no new graph per budget)
      tau            () float64: the τ of the window (1.0 elsewhere); `confident` compares the
                     float32 probabilities with it in float32, as the reference does
      seeds, step    (N,) seed + b and () the forwards so far: the sampler's counter
      history        (HISTORY, N): the tokens each row emitted at step s, in row s % HISTORY,
                     so the host splits a chunk's output into its steps (`steps`)
    Python settings (a new value is a new graph): sampling, mask_id, threshold; exact mode's
    position offsets and (T, T) mask (exact.step_layout) as tensors."""

    def __init__(self, model, N, slots, width, B):
        self.cache = model.new_cache(N, slots - width, width, static=True)  # exactly `slots` slots
        device = self.cache.lengths.device
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)
        self.tok, self.n_tok = z(N, B), z(N)
        self.out, self.n_out, self.done = z(N, slots + B), z(N), z(N, dtype=torch.bool)
        self.eos, self.max_new, self.tau = z(EOS_SLOTS), z(()), z((), dtype=torch.float64)
        self.seeds, self.step, self.history = z(N), z(()), z(HISTORY, N)
        self.sampling, self.mask_id, self.threshold = GREEDY, 0, 0.0
        self.first, self.tau_value = 0, 1.0  # the request's first step (its prefill's), τ as given
        self.offsets = self.mask = self.q = None  # exact mode's layout; its drafts' q when sampling
        if device.type == "cuda":  # a CUDA graph updates these very tensors in place
            for t in (self.tok, self.n_tok, self.out, self.n_out, self.done, self.eos, self.max_new,
                      self.tau, self.seeds, self.step, self.history, self.cache.lengths):
                torch._dynamo.mark_static_address(t)


def start(model, kind, rows, lengths, B, width, max_new_tokens, eos_ids=(), tau=1.0, sampling=GREEDY,
          mask_id=0, first_step=0):
    """A request's State (its shape's, reset) and its eager first forward, the prefill: rows
    (each a prompt, then what the decoder's first forward holds after it) forwarded and the
    prompts (`lengths`) committed -> the state and the logits (N, B, V) at the last prompt
    token and the B-1 positions after it. kind: the decoder ("ar", "window", "exact"; a State
    serves one); width: the widest step (sizes the cache); first_step: the sampler's counter at
    the prefill (a chat's replies go on counting)."""
    N, p = len(rows), model.lm_head.weight
    slots = round_up(max(lengths) + max_new_tokens + width, KEY_BLOCK)  # whole key blocks
    states = _STATES.setdefault(model, OrderedDict())
    key = (kind, N, slots, width, B, p.dtype, p.device)
    st = states.pop(key, None) or State(model, N, slots, width, B)
    states[key] = st  # the most recent last; the least recently used goes past MAX_STATES
    while len(states) > MAX_STATES:
        states.popitem(last=False)
    eos = sorted(eos_ids)
    if len(eos) > st.eos.numel():
        st.eos = torch.zeros(len(eos), dtype=torch.long, device=p.device)
    st.eos.fill_(-1)[: len(eos)] = torch.tensor(eos, dtype=torch.long)
    st.n_out.zero_(), st.done.zero_(), st.step.fill_(first_step), st.cache.lengths.zero_()
    st.max_new.fill_(max_new_tokens), st.tau.fill_(tau)
    st.first, st.tau_value = first_step, tau
    st.seeds.copy_(sampling.seed + torch.arange(N))
    st.sampling, st.mask_id, st.cache.commits, st.cache.T = sampling, mask_id, 0, None
    lens = torch.tensor(lengths, device=p.device)
    h = model.hidden(pad_rows(rows, 0, p.device), cache=st.cache)  # eager: FastQwen2's prefill
    st.cache.commit(lens)
    return st, logits_at(model, h, lens - 1, B)


# ---------------------------------------------------------------- the rules, on the device
def emit(st, c, a):
    """Emit the first a[b] candidates c (N, n) of each live row, cut after its first EOS id
    and at the budget (decoding.Rows.keep's cut), into out at n_out, in place -> the count
    emitted (N,), 0 for a finished row. out has B spare columns past the budget, so the n
    writes of a row never share a column."""
    n, live = c.shape[1], ~st.done
    j = torch.arange(n, device=c.device)
    is_eos = torch.isin(c, st.eos) & (j < a[:, None])
    first_eos = torch.where(is_eos, j, n).amin(1)  # (N,): n when no emitted EOS
    k = torch.minimum(torch.minimum(a, first_eos + 1), st.max_new - st.n_out) * live
    at = st.n_out[:, None] + j  # (N, n): distinct columns; those past k keep what they held
    st.out.scatter_(1, at, torch.where(j < k[:, None], c, st.out.gather(1, at)))
    st.n_out.add_(k)
    st.history.index_copy_(0, (st.step % HISTORY).view(1), k.view(1, -1))
    st.done.logical_or_(live & ((first_eos < k) | (st.n_out >= st.max_new)))
    return k


def keep(model, st, logits):
    """The τ rule (§5) of one step, then `emit`: logits (N, B, V) at [the last real token,
    masks 0 .. B-2] -> the candidates c (N, B) (fast.sample.candidates; greedy: model.argmax)
    and the count kept (N,): c_0 and the leading run of p_j >= τ (generate.accept); τ >= 1 (or
    B = 1) keeps c_0."""
    c = candidates(logits, st.sampling, st.seeds, st.step, model.argmax)
    passed = confident(confidence(logits[:, 1:], c[:, 1:]), st.tau)  # (N, B-1): p_j >= τ
    a = torch.where(st.tau >= 1, 1, 1 + passed.long().cumprod(1).sum(1))
    return c, emit(st, c, a)


def forward(model, st, tokens, position_ids=None, mask=None):
    """The step's forward over the state's cache (writes the tokens' K/V at each row's length,
    commits nothing), counted for the rows still generating -> hidden states (N, T, C)."""
    st.step.add_(1)
    cache = FastCache.over(st.cache.k, st.cache.v, st.cache.lengths)
    return Qwen2.hidden(model, tokens, position_ids, mask, cache)


# ---------------------------------------------------------------- the steps
def ar_step(model, st):
    """One AR step: tok (N, 1), each row's last kept token, not yet in the cache, is forwarded
    and committed (for a live row); the pick after it is emitted and becomes tok."""
    live = ~st.done
    h = forward(model, st, st.tok)
    st.cache.lengths.add_(live.long())  # the commit: tok is now in the cache of every live row
    c, _ = keep(model, st, model.lm_head(h))
    st.tok.copy_(torch.where(live[:, None], c, st.tok))


def window_step(model, st):
    """One step of generate.window_steps: forward [the n_tok[b] pending tokens | B masks] (2B
    wide, padded with masks), commit the pending tokens, keep by the τ rule; the kept tokens
    become the next pending ones."""
    N, B = st.tok.shape
    j = torch.arange(2 * B, device=st.tok.device)
    padded = torch.cat([st.tok, torch.full_like(st.tok, st.mask_id)], 1)  # (N, 2B)
    tokens = torch.where(j < st.n_tok[:, None], padded, st.mask_id)
    h = forward(model, st, tokens)  # (N, 2B, C)
    st.cache.lengths.add_(st.n_tok)  # the commit: the pending tokens (none for a finished row)
    c, kept = keep(model, st, logits_at(model, h, (st.n_tok - 1).clamp(min=0), B))
    st.tok.copy_(c)
    st.n_tok.copy_(kept * ~st.done)


def exact_step(model, st):
    """One exact-mode step (exact.exact_steps): forward [c_0, d_1..d_K | G_0 .. G_K]; verify the
    row's n_tok real drafts against the AR outputs at c_0, d_1..d_K (greedy: the leading run of
    d_i == the argmax t_{i-1}, the bonus t_a; sampled: fast.sample.speculative against the q the
    drafts were drawn from); emit d_1..d_a and the bonus (`emit` cuts at EOS and the budget);
    commit c_0, d_1..d_a for a row still going; the group G_a (the one that saw exactly those)
    gives the next drafts (`next_drafts`). The reference forwards fewer drafts where a row has fewer
    or its budget could not emit them; here every step forwards K: a draft past n_tok is seen
    only by tokens and groups past it, whose outputs are not read."""
    N, K1 = st.tok.shape
    K = K1 - 1
    j = torch.arange(K, device=st.tok.device)
    tokens = torch.cat([st.tok, torch.full_like(st.tok, st.mask_id).repeat(1, K)], 1)  # (N, (1+K)^2)
    h = forward(model, st, tokens, st.cache.lengths[:, None] + st.offsets, st.mask)
    logits = model.lm_head(h)  # (N, (1+K)^2, V): one head call for the verification and every group
    d = st.tok[:, 1:]
    u = counter_uniforms(st.seeds, st.step, 2 * K + 1)  # accept tests, the bonus, the next drafts
    if st.sampling.greedy:
        t = model.argmax(logits[:, :K1])  # (N, 1+K): the accepted drafts are t_0..t_{a-1}, the bonus t_a
        a, bonus = greedy_accept(t, d, st.n_tok)
        emitted = t
    else:
        p = probs_of(logits[:, :K1], st.sampling)
        a, bonus = speculative(p, st.q, d, st.n_tok, u[:, :K1])
        emitted = torch.cat([d, bonus[:, None]], 1).scatter(1, a[:, None], bonus[:, None])  # d_1..d_a, bonus
    emit(st, emitted, a + 1)
    st.cache.lengths.add_((1 + a) * ~st.done)  # exact.keep_verified: rows still going
    idx = K1 + a[:, None] * K + j  # (N, K): the group G_a
    group = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # (N, K, V)
    d_next, n_next = next_drafts(model, st, group, u[:, K1:])
    st.tok.copy_(torch.cat([bonus[:, None], d_next], 1))
    st.n_tok.copy_(n_next)


def next_drafts(model, st, logits, u):
    """Exact mode's drafts from a group's logits (N, K, V) -> d (N, K), n (N,): the argmaxes
    (greedy: model.argmax) or draws from q = the processed distribution, kept in st.q for the
    next step's verification (sampled, with the uniforms u (N, K)); n cut by the threshold on
    the raw probability of each position's argmax (sampling.sample_drafts: the cut never reads
    the draw)."""
    top, n, _ = sample_drafts(logits, GREEDY, None, st.threshold, model.argmax)
    if st.sampling.greedy:
        return top, n
    q = probs_of(logits, st.sampling)
    st.q.copy_(q)
    return draw(q, u), n


# ---------------------------------------------------------------- the host loop
def steps(model, st, step, chunk, knob=None):
    """The host loop, as a generator of decoding.Step (what the reference decoders yield, so
    decoding.collect and the chat's streaming read it unchanged): replay step(model, st) `chunk`
    times, then one read of the device (the output columns the chunk can have written, the
    emitted counts of its steps, the step counter and the finished flags, together), and yield
    the chunk's steps one by one, each with the tokens its rows emitted and the forwards so far;
    the prefill's is the first, and the last is the one in which the last row finished (the
    masked steps after it in its chunk are not told). knob: a decoding.Knob whose τ is read
    before every chunk (the chat's /tau). -> (its return value) the sampler's next step."""
    if not 1 <= chunk < HISTORY:
        raise ValueError(f"chunk must be in [1, {HISTORY - 1}], got {chunk}")
    N, B, width = st.n_out.shape[0], st.tok.shape[1], st.out.shape[1]
    told, seen, tau = st.first, [0] * N, st.tau_value
    while True:
        # a step emits <= B tokens a row, and a read follows the prefill or a chunk: the (chunk
        # + 1) * B columns from the fewest seen on hold all the new ones
        lo = min(seen)
        hi = min(width, max(seen) + (chunk + 1) * B)
        host = torch.cat([st.out[:, lo:hi].flatten(), st.history.flatten(), st.step.view(1),
                          st.done.long()]).tolist()
        w = hi - lo
        out = [host[b * w:(b + 1) * w] for b in range(N)]
        history, last, done = host[N * w:-N - 1], host[-N - 1], host[-N:]
        counts = {s: history[(s % HISTORY) * N:(s % HISTORY + 1) * N] for s in range(told, last + 1)}
        # a live row emits at every step, a finished one never again: a row done now finished at
        # the last of these steps in which it emitted (or before them)
        final = [max((s for s in counts if counts[s][b] > 0), default=-1) for b in range(N)]
        end = max(final) if all(done) else last  # nothing happens after the last row finished
        for s in range(told, end + 1):  # the steps not yet told (st.first: the prefill)
            k = counts[s]
            tokens = [out[b][seen[b] - lo:seen[b] - lo + k[b]] for b in range(N)]
            seen = [a + n for a, n in zip(seen, k)]
            finished = [bool(done[b]) and s >= final[b] for b in range(N)]
            yield Step(tokens, finished, s - st.first + 1, tau)
        told = last + 1
        if all(done):
            return told
        if knob is not None:
            tau = knob.tau
            st.tau.fill_(tau)
        for _ in range(chunk):
            step(model, st)


def run(model, st, step, chunk):
    """steps() to the end -> per row a decoding.Generation: its ids and the forwards it ran."""
    return collect(steps(model, st, step, chunk), st.n_out.shape[0])


def check_device_sampling(sampling):
    if sampling.accept_metric != "probability":
        raise ValueError(f"the device loops compare τ with the probability, got --accept-metric "
                         f"{sampling.accept_metric}")


# ---------------------------------------------------------------- requests
def begin_ar(model, prompts, max_new_tokens, eos_ids=(), sampling=GREEDY, first_step=0):
    """An AR request's State after its prefill (its first token emitted)."""
    check_request(model, prompts, 1, 1.0, max_new_tokens)
    check_device_sampling(sampling)
    lengths = [len(q) for q in prompts]
    st, logits = start(model, "ar", prompts, lengths, 1, 1, max_new_tokens, eos_ids, 1.0, sampling,
                       first_step=first_step)
    c, _ = keep(model, st, logits)
    st.tok.copy_(c)
    return st


def begin_window(model, prompts, block_size, tau, max_new_tokens, mask_id, eos_ids=(), sampling=GREEDY,
                 first_step=0):
    """A τ-window request's State after its prefill [prompt | B masks] (generate.window_steps')."""
    check_request(model, prompts, block_size, tau, max_new_tokens, mask_id)
    check_device_sampling(sampling)
    B = block_size
    rows = [q + [mask_id] * B for q in prompts]
    st, logits = start(model, "window", rows, list(map(len, prompts)), B, 2 * B, max_new_tokens, eos_ids, tau,
                       sampling, mask_id, first_step)
    c, kept = keep(model, st, logits)
    st.tok.copy_(c)
    st.n_tok.copy_(kept * ~st.done)
    return st


def begin_exact(model, prompts, drafts, max_new_tokens, mask_id, eos_ids=(), draft_threshold=0.0,
                block_size=None, sampling=GREEDY, first_step=0):
    """An exact-mode request's State after its prefill [prompt | G_0] (exact.exact_steps'): c_0
    emitted, the first K drafts (and their q when sampling) in place."""
    K = drafts
    check_request(model, prompts, block_size or K, 1.0, max_new_tokens, mask_id)
    check_exact(K, block_size or K, draft_threshold)
    check_device_sampling(sampling)
    rows = [q + [mask_id] * K for q in prompts]
    st, logits = start(model, "exact", rows, list(map(len, prompts)), 1 + K, (1 + K) ** 2, max_new_tokens,
                       eos_ids, 1.0, sampling, mask_id, first_step)
    st.threshold = draft_threshold
    st.offsets, st.mask = step_layout(K, K, st.tok.device)
    N, V = len(prompts), logits.shape[-1]
    if not sampling.greedy and (st.q is None or st.q.shape != (N, K, V)):
        st.q = torch.zeros(N, K, V, device=logits.device)  # the drafts' distributions
        if st.q.is_cuda:
            torch._dynamo.mark_static_address(st.q)
    u = counter_uniforms(st.seeds, st.step, 2 * K + 1)  # the prefill's step: exact_step's positions
    if sampling.greedy:
        c0 = model.argmax(logits[:, :1])[:, 0]
    else:
        c0 = draw(probs_of(logits[:, 0], sampling), u[:, K])
    emit(st, c0[:, None], torch.ones_like(c0))  # c_0, the AR token after the prompt
    d, n = next_drafts(model, st, logits[:, 1:], u[:, K + 1:])
    st.tok.copy_(torch.cat([c0[:, None], d], 1))
    st.n_tok.copy_(n)
    return st


@torch.no_grad()
def generate_ar_device(model, prompts, max_new_tokens, eos_ids=(), chunk=8, step=ar_step, sampling=GREEDY):
    """AR decoding of `prompts` (lists of ids) by `model` (a FastQwen2, bf16 or not) with
    `step` (ar_step, or it compiled: torch.compile(ar_step, fullgraph=True)) -> per row its
    Generation: greedy, generate.generate_ar's; sampled, drawn with fast.sample's numbers."""
    return run(model, begin_ar(model, prompts, max_new_tokens, eos_ids, sampling), step, chunk)


@torch.no_grad()
def generate_window_device(model, prompts, block_size, tau, max_new_tokens, mask_id, eos_ids=(), chunk=8,
                           step=window_step, sampling=GREEDY):
    """generate.generate(..., cache="window") with every step on the device -> per row its Generation
    (greedy: generate.generate's). tau: a float, held as a tensor (a new τ is no new graph)."""
    st = begin_window(model, prompts, block_size, tau, max_new_tokens, mask_id, eos_ids, sampling)
    return run(model, st, step, chunk)


@torch.no_grad()
def generate_exact_device(model, prompts, drafts, max_new_tokens, mask_id, eos_ids=(), chunk=8,
                          step=exact_step, draft_threshold=0.0, block_size=None, sampling=GREEDY):
    """Exact mode (exact.generate_exact) with every step on the device -> per row its Generation:
    greedy, exact.generate_exact's (the greedy AR tokens); sampled, distributed as AR sampling
    (fast.sample.speculative with the counter's numbers). drafts: K (<= block_size when given)."""
    st = begin_exact(model, prompts, drafts, max_new_tokens, mask_id, eos_ids, draft_threshold, block_size,
                     sampling)
    return run(model, st, step, chunk)


def compiled_steps(device):
    """{ar_step, window_step, exact_step: it compiled whole for `device`} (fast.step.compiled:
    CUDA graphs on a GPU, inductor on the CPU; torch.compile compiles at a function's first call)."""
    return {f: compiled(f, device, fullgraph=True) for f in (ar_step, window_step, exact_step)}


def device_decoder(model, *, block_size, max_new_tokens, mask_id, eos_ids=(), exact=False, drafts=None,
                   draft_threshold=0.0, chunk=8):
    """generate.decoder's counterpart for the command line's --device-loop: -> decode(prompts,
    knob), a generator of decoding.Step (the τ window, AR at τ >= 1, or exact mode), every step
    compiled whole once per shape (fast.step.compiled: CUDA graphs on a GPU, inductor on the
    CPU), one read of the device every `chunk` steps, τ read from the knob before every chunk."""
    step, stream = compiled_steps(model.lm_head.weight.device), {"step": 0}

    @torch.no_grad()
    def decode(prompts, knob):
        # the session's random numbers go on across replies (the reference's generators do); a
        # knob without generators (a new session, or the chat's /seed) starts them from step 0
        if knob.generators is None:
            stream["step"], knob.generators = 0, []  # [] marks the session's stream begun
        s, first = knob.sampling, stream["step"]
        if exact:
            st = begin_exact(model, prompts, drafts or block_size, max_new_tokens, mask_id, eos_ids,
                             draft_threshold, block_size, s, first)
            stream["step"] = yield from steps(model, st, step[exact_step], chunk)
        else:
            st = begin_window(model, prompts, block_size, knob.tau, max_new_tokens, mask_id, eos_ids, s,
                              first)
            stream["step"] = yield from steps(model, st, step[window_step], chunk, knob)
    return decode
