"""MARS inference: τ-gated multi-token decoding (docs/spec.md §5) with exact KV caches (§6),
the plain AR decoder it is measured against, and the command line.

Each step appends B `<|mask|>` tokens to the prefix and runs ONE plain causal
forward. The output at the last prefix token is the ordinary AR prediction c_0;
the output at mask j-1 proposes c_j. c_0 is always accepted, then c_1, c_2, ...
while their softmax probability is >= τ (`accept`). τ = 1 is plain greedy AR;
lower τ trades accuracy for tokens per forward. τ is read before every step from
a `decoding.Knob`, so it can change between steps while the model stays loaded.

Sampling (sampling.py): with `Sampling(temperature, top_k, top_p, seed, accept_metric)` each
c_j is drawn from its position's processed distribution and τ is compared with the raw fp32
softmax at c_j (or its entropy or margin: sampling.confidence), as in the authors' sampler;
τ = 1 is then the AR sampler, token for token. Temperature 0, the default, is the rule above.

Three loops produce the same tokens (the tests prove it):
  nocache_steps  the paper's loop: recompute [prefix | B masks] from scratch every step.
  window_steps   (§6 sliding window) forward [tokens accepted last step | B masks]
                 against the cache; commit the real tokens, drop the masks.
  block_steps    (§6 block-level cache, the paper's batch strategy) the prefix cache is
                 frozen while a block of B_cache slots is filled by inner steps that
                 forward only the block; one forward of the filled block extends it.

Batches are right-padded: a row's tokens start at slot 0 and its position ids are
slot indices, so with plain causal attention no real token ever sees a pad, and
every row accepts its own number of tokens. `ar_decode` is the plain AR decoder on
the same KVCache: the honest baseline. Exact mode (the AR output at several tokens per
forward: greedy token for token, or sampled in distribution) is exact.py; the
interactive chat is chat.py; what `--show` prints of every step is show.py.

    python generate.py --ckpt out/default/mars --prompt "Compute 3 + 4 + 8." --tau 0.9
"""

import argparse
import functools
import os
import sys
import time

import torch

from chat import chat
from checkpoint import DEFAULT_BLOCK_SIZE, load_checkpoint
from decoding import (
    Knob,
    Rows,
    Step,
    ar_only,
    check_request,
    check_tau,
    collect,
    greedy_pick,
    logits_at,
    pad_rows,
    rows_of,
    streams,
)
from exact import check_exact, exact_steps
from sampling import GREEDY, METRICS, Sampling, argmax, confidence, confident, pick, row_generators
from show import report, trace
from util.files import USER_ERRORS, error_line
from util.precision import choose_dtype, dtype_name

CACHE_MODES = ("window", "block", "none")
DEFAULT_BLOCK_CACHE = 32  # the paper's best B_cache at batch 4 and 8 (§7)


# ---------------------------------------------------------------- the τ rule (§5.2-5.5)
def candidates(logits, sampling=GREEDY, gens=None, ar=False, argmax=argmax):
    """Candidates and their confidences (§5.2-3): logits (N, n, V) at [last prefix token,
    mask 0 .. n-2] -> c (N, n), conf (N, n); conf is None in AR mode (`ar`), where nothing
    but c_0 is accepted and no softmax over V is computed.

    Greedy (temperature 0, the default): c_j = the argmax of the fp32 logits, conf_j = its
    fp32 softmax probability p_j. Sampled: each c_j is drawn from its own position's processed
    distribution, independently (mask j-1 never sees the drawn c_{j-1}: MARS, not exact.py),
    and conf_j is still the RAW softmax probability of c_j (sampling.confidence). c_0 is drawn
    in a call of its own and in AR mode c_1.. are not drawn: an AR-mode step uses each row's
    generator as the AR sampler does. argmax: the model's greedy pick (decoding.greedy_pick)."""
    c0 = pick(logits[:, :1], sampling, gens, argmax)  # (N, 1): the AR token
    rest = logits[:, 1:]  # (N, n-1, V)
    greedy = ar or sampling.greedy or rest.shape[1] == 0
    c = torch.cat([c0, pick(rest, GREEDY if greedy else sampling, gens, argmax)], 1)  # (N, n)
    if ar:
        return c, None
    return c, confidence(logits, c, sampling.accept_metric)


def accept(conf, tau, metric="probability"):
    """The acceptance rule (§5.4-5): how many leading candidates each row keeps, (N,).

    c_0, the AR token, is always kept; then c_1, c_2, ... while p_j >= τ (conf: the
    candidates' confidences; the entropy metric keeps while H_j <= τ), stopping at the first
    that fails. AR mode (decoding.ar_only: τ >= 1; entropy τ = 0) keeps c_0 alone."""
    if ar_only(tau, metric):
        return torch.ones(conf.shape[0], dtype=torch.long, device=conf.device)
    passed = confident(conf[:, 1:], tau, metric)  # (N, n-1): p_j >= τ
    return 1 + passed.long().cumprod(1).sum(1)  # c_0 and the leading run of passes, (N,)


def take(rows, active, logits, tau, sampling=GREEDY, gens=None, argmax=argmax):
    """Apply one step's decision to the `active` rows: candidates (drawn with the active
    rows' generators), the τ rule, then the budget / EOS cut (rows.keep). logits (len(active),
    B, V) -> (kept tokens per row (all N), what the rows proposed: decoding.Step's proposed,
    conf and accepted, for --show)."""
    metric = sampling.accept_metric
    check_tau(tau, metric)
    ar = ar_only(tau, metric)
    cands, conf = candidates(logits, sampling, rows_of(gens, active), ar, argmax)
    n = [1] * len(active) if ar else accept(conf, tau, metric).tolist()
    at = {b: i for i, b in enumerate(active)}  # row -> its place among the active rows
    spread = lambda values, empty: [values[at[b]] if b in at else empty for b in range(len(rows.out))]
    seen = dict(proposed=spread(cands.tolist(), []), conf=None if ar else spread(conf.tolist(), []),
                accepted=spread(n, 0))  # one host copy for all rows
    return rows.keep([c[:k] for c, k in zip(seen["proposed"], seen["accepted"])]), seen


# ---------------------------------------------------------------- forwards
def nocache_logits(model, seqs, B, mask_id):
    """One plain causal forward of [prefix | B masks] per row, from scratch (§5.1-2).
    -> logits (N, B, V) at the last prefix token and masks 0 .. B-2."""
    device = model.lm_head.weight.device
    h = model.hidden(pad_rows([s + [mask_id] * B for s in seqs], mask_id, device))  # (N, T, C)
    last = torch.tensor([len(s) - 1 for s in seqs], device=device)
    return logits_at(model, h, last, B)


def extend_cache(model, cache, tokens, n):
    """Forward tokens (N, T) against the cache, commit the first n[i] of each row, and return
    the final hidden state of each row's last committed token (N, C): the prefill, an AR step,
    the block cache's extension (§6 step 3). The stored "last logit" is this hidden state (the
    LM head runs when a candidate is read). The caller passes no more than the longest n."""
    h = model.hidden(tokens, cache=cache)
    cache.commit(n)
    return h[torch.arange(h.shape[0], device=h.device), (n - 1).clamp(min=0)]


# ---------------------------------------------------------------- the three MARS loops
def nocache_steps(model, prompts, B, knob, max_new, mask_id, eos_ids, sampling, gens):
    """The paper's loop (§5), the reference: every step one plain causal forward of
    [prefix | B masks] per row, from scratch."""
    rows, forwards = Rows(len(prompts), max_new, eos_ids), 0
    while not all(rows.done):
        tau, active = knob.tau, rows.active()
        logits = nocache_logits(model, [prompts[b] + rows.out[b] for b in active], B, mask_id)
        forwards += 1
        new, seen = take(rows, active, logits, tau, sampling, gens, greedy_pick(model))
        yield Step(new, list(rows.done), forwards, tau, **seen)  # no cache: committed None


def window_steps(model, prompts, B, knob, max_new, mask_id, eos_ids, sampling, gens):
    """cache="window" (§6 sliding window). Each step forwards [pending | B masks] per row
    against the cache, pending = the tokens accepted last step (the whole prompt at
    first, = the prefill), then commits only the pending (real) tokens: the cache update.
    The masks' K/V lie past the committed length and are overwritten next time. Ragged
    rows are right-padded inside the window, so a row's masks directly follow its
    pending tokens and plain causal attention never shows a real token a pad."""
    rows, device, forwards = Rows(len(prompts), max_new, eos_ids), model.lm_head.weight.device, 0
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + max_new, step=2 * B)
    pending = [list(p) for p in prompts]
    while not all(rows.done):
        tau, active = knob.tau, rows.active()
        window = [p + [mask_id] * B for p in pending]
        h = model.hidden(pad_rows(window, mask_id, device), cache=cache)  # the prompts first, then <= 2B
        committed = [len(p) for p in pending]
        n = torch.tensor(committed, device=device)
        cache.commit(n)
        forwards += 1
        logits = logits_at(model, h, (n - 1).clamp(min=0), B)[active]  # (n_active, B, V)
        new, seen = take(rows, active, logits, tau, sampling, gens, greedy_pick(model))
        pending = [[] if d else t for t, d in zip(new, rows.done)]
        yield Step(new, list(rows.done), forwards, tau, committed=committed, **seen)


def block_steps(model, prompts, B, knob, max_new, mask_id, eos_ids, sampling, gens, block_cache):
    """cache="block" (§6 block-level cache): blocks of B_cache slots over a frozen prefix.

    (1) The prefix cache (and the last hidden state of the prefix, the "stored last
    logit") is computed once per block; inner steps do not commit to it.
    (2) An inner step forwards the block's slots [filled | masks] against that cache.
    seq = [stored last | block outputs], so slot k's candidate is read from seq[k]:
    slot 0 from the stored last logit, slot k from block output k-1, exactly the
    c_0, c_1, ... of the no-cache step at that prefix. The τ rule fills each row's
    slots left to right; a row that has filled the block idles.
    (3) Once every row has filled the block, one forward of the filled block commits it
    and refreshes the stored last hidden state; finished rows are padded (commit 0).

    A step never stops at the block edge (§6): the buffer has B-1 spare slots past B_cache,
    so an inner step accepts exactly what the no-cache step accepts and the extension commits
    every filled slot: block mode = the no-cache loop, token for token.
    Forwards: 1 prefill + inner steps + 1 per completed block (at τ = 1, batch 1, no
    EOS: n + ceil(n / B_cache) for n tokens, B >= 2; with B = 1 an inner step at slot 0
    needs no forward, giving n)."""
    N, device = len(prompts), model.lm_head.weight.device
    rows = Rows(N, max_new, eos_ids)
    cache = model.new_cache(N, max(map(len, prompts)) + max_new, step=block_cache + B - 1)  # the whole block
    lens = torch.tensor([len(p) for p in prompts], device=device)
    last = extend_cache(model, cache, pad_rows(prompts, mask_id, device), lens)  # prefill, (N, C)
    forwards, committed = 1, [len(p) for p in prompts]  # committed: written since the last Step
    block = torch.full((N, block_cache + B - 1), mask_id, dtype=torch.long, device=device)
    filled = [0] * N  # slots of the block filled so far, per row
    while not all(rows.done):
        growing = [b for b in rows.active() if filled[b] < block_cache]
        if not growing:  # (3) every row filled the block: commit it, start the next one
            n = [0 if d else f for d, f in zip(rows.done, filled)]
            last = extend_cache(model, cache, block[:, :max(n)], torch.tensor(n, device=device))
            forwards, committed = forwards + 1, n
            block.fill_(mask_id)
            filled = [0] * N
            continue
        tau = knob.tau
        W = max(filled[b] for b in growing) + B - 1  # the last candidate needed is output W-1
        h = last.new_zeros(N, 0, last.shape[-1])
        if W > 0:  # (2) inner step: forward the block only; no commit
            h = model.hidden(block[:, :W], cache=cache)  # (N, W, C)
            forwards += 1
        seq = torch.cat([last[:, None], h], 1)  # (N, W+1, C): seq[:, k] predicts slot k
        start = torch.tensor([filled[b] for b in growing], device=device)
        new, seen = take(rows, growing, logits_at(model, seq[growing], start, B), tau, sampling, gens,
                         greedy_pick(model))
        for b in growing:
            block[b, filled[b]: filled[b] + len(new[b])] = torch.tensor(new[b], device=device)
            filled[b] += len(new[b])
        yield Step(new, list(rows.done), forwards, tau, committed=committed, **seen)
        committed = [0] * N


# ---------------------------------------------------------------- entry points
@torch.no_grad()
def mars_decode(model, prompts, *, block_size, tau, max_new_tokens, mask_id, eos_ids=(),
                cache="window", block_cache_size=None, sampling=GREEDY, generators=None):
    """Decode a batch of prompts (lists of ids) with MARS (§5), yielding a `Step` per step.

    tau: a float, or a `Knob` whose `.tau` is read before every step (change it between steps
    to change acceptance from the next step on). cache: "window", "block" or "none" (§6);
    block_cache_size: B_cache of the block mode (default 32). sampling: a sampling.Sampling
    (default: greedy); generators: one torch.Generator per row (default: row b seeded
    sampling.seed + b), or one for all. A row stops after an accepted EOS id (what followed it
    in that step is dropped) or after max_new_tokens; finished rows idle while the others go on."""
    check_request(model, prompts, block_size, tau, max_new_tokens, mask_id, sampling.accept_metric)
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
    knob = tau if isinstance(tau, Knob) else Knob(float(tau))
    prompts = [list(map(int, p)) for p in prompts]
    gens = streams(sampling, generators, len(prompts), model.lm_head.weight.device)
    args = (model, prompts, block_size, knob, max_new_tokens, mask_id, tuple(eos_ids), sampling, gens)
    if cache == "none":
        yield from nocache_steps(*args)
    elif cache == "window":
        yield from window_steps(*args)
    else:
        bc = DEFAULT_BLOCK_CACHE if block_cache_size is None else block_cache_size
        if bc < 1:
            raise ValueError(f"block cache size must be >= 1, got {bc}")
        yield from block_steps(*args, bc)


def generate(model, prompts, *, block_size, tau, max_new_tokens, mask_id, eos_ids=(),
             cache="window", block_cache_size=None, sampling=GREEDY, generators=None):
    """MARS-decode a batch of prompts -> list of `Generation` (ids, forwards), one per prompt."""
    steps = mars_decode(model, prompts, block_size=block_size, tau=tau, max_new_tokens=max_new_tokens,
                        mask_id=mask_id, eos_ids=eos_ids, cache=cache, block_cache_size=block_cache_size,
                        sampling=sampling, generators=generators)
    return collect(steps, len(prompts))


@torch.no_grad()
def ar_decode(model, prompts, max_new_tokens, eos_ids=(), sampling=GREEDY, generators=None):
    """Plain AR decoding on the KVCache (prefill, then one token per forward, no masks),
    yielding a `Step` per token: the baseline MARS must beat. Greedy by default; with
    `sampling`, each token is one draw (sampling.pick) from row b's generator."""
    check_request(model, prompts, 1, 1.0, max_new_tokens)
    prompts = [list(map(int, p)) for p in prompts]
    N, device = len(prompts), model.lm_head.weight.device
    gens = streams(sampling, generators, N, device)
    rows = Rows(N, max_new_tokens, tuple(eos_ids))
    cache = model.new_cache(N, max(map(len, prompts)) + max_new_tokens)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    last = extend_cache(model, cache, pad_rows(prompts, 0, device), lens)  # prefill, (N, C)
    forwards = 1
    while True:
        active = rows.active()
        new, seen = take(rows, active, model.lm_head(last[active, None]), 1.0, sampling, gens,
                         greedy_pick(model))
        yield Step(new, list(rows.done), forwards, 1.0, **seen)
        if all(rows.done):
            return
        tok = torch.tensor([t[0] if t else 0 for t in new], device=device)[:, None]  # (N, 1)
        last = extend_cache(model, cache, tok, torch.ones_like(lens))
        forwards += 1


def generate_ar(model, prompts, max_new_tokens, eos_ids=(), sampling=GREEDY, generators=None):
    """AR baseline (greedy by default) -> list of `Generation` (ids, forwards), one per prompt."""
    return collect(ar_decode(model, prompts, max_new_tokens, eos_ids, sampling, generators), len(prompts))


# ---------------------------------------------------------------- command line
def parse_ids(text):
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise ValueError("empty prompt (--prompt-ids has no ids)")
    return ids


def read_prompts(args, tok):
    """The prompt ids the command line asks for (user messages go through the chat template)."""
    if args.prompt_ids is not None:
        return [parse_ids(args.prompt_ids)]
    if tok is None:
        raise ValueError(f"{args.ckpt} has no tokenizer files: give raw ids with --prompt-ids "
                         "(and --mask-id)")
    if args.prompt is not None:
        lines = [args.prompt]
    else:
        with open(args.prompts_file) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise ValueError(f"{args.prompts_file} holds no prompt")
    if not all(line.strip() for line in lines):
        raise ValueError("empty prompt")
    return [tok.encode_chat([{"role": "user", "content": line}], add_generation_prompt=True)
            for line in lines]


def session_generators(knob, n_rows, device):
    """The knob's row generators, built from knob.sampling.seed on first use and then kept:
    the chat's replies continue one stream (a session is reproducible); `/seed` resets it."""
    if knob.sampling.greedy:
        return None
    if knob.generators is None or len(knob.generators) != n_rows:
        knob.generators = row_generators(knob.sampling.seed, n_rows, device)
    return knob.generators


def decoder(args, model, block_size, mask_id, eos_ids):
    """prompts, knob -> the step generator the command line asks for: τ-gated, or --exact;
    sampled with knob.sampling and the knob's generators."""
    device = model.lm_head.weight.device
    if args.device_loop:  # the engine's loops, with the whole step on the device (fast/loop.py)
        from fast.loop import device_decoder

        return device_decoder(model, block_size=block_size, max_new_tokens=args.max_new_tokens,
                              mask_id=mask_id, eos_ids=eos_ids, exact=args.exact, drafts=args.drafts,
                              draft_threshold=args.draft_threshold)

    def decode(prompts, knob):
        common = dict(max_new_tokens=args.max_new_tokens, mask_id=mask_id, eos_ids=eos_ids,
                      sampling=knob.sampling, generators=session_generators(knob, len(prompts), device))
        if args.exact:
            return exact_steps(model, prompts, block_size=block_size, drafts=args.drafts or block_size,
                               draft_threshold=args.draft_threshold, **common)
        return mars_decode(model, prompts, block_size=block_size, tau=knob, cache=args.cache,
                           block_cache_size=args.block_cache_size, **common)
    return decode


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="MARS τ-gated multi-token generation (docs/spec.md §5-6)")
    p.add_argument("--ckpt", required=True, help="HF-layout checkpoint directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a user message, sent through the chat template")
    src.add_argument("--prompt-ids", help="raw prompt token ids, comma-separated (no template)")
    src.add_argument("--prompts-file", help="a text file, one user message per line (one batch)")
    src.add_argument("--chat", action="store_true", help="interactive chat; /tau X changes tau")
    p.add_argument("--tau", type=float, help="acceptance threshold; >= 1 is plain AR (--accept-metric "
                   "entropy: an entropy bound in nats, 0 is plain AR). Default: 0.95 for a MARS-trained "
                   "checkpoint, plain AR for one whose mars.json records no block size")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most probable tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this "
                   "mass; 1 = off")
    p.add_argument("--seed", type=int, default=0, help="row b's sampling generator is seeded seed + b")
    p.add_argument("--accept-metric", default="probability", help="what --tau is compared with: "
                   f"{', '.join(METRICS)} (sampling.confidence)")
    p.add_argument("--block-size", type=int, help="B: masks appended per step (default: the "
                   f"checkpoint's mars.json, else {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--mask-id", type=int, help="<|mask|> id (default: mars.json, else the tokenizer)")
    p.add_argument("--cache", choices=CACHE_MODES, default="window")
    p.add_argument("--block-cache-size", type=int, help=f"--cache block's B_cache ({DEFAULT_BLOCK_CACHE})")
    p.add_argument("--exact", action="store_true", help="exact mode (exact.py): the AR output (greedy, "
                   "or sampled: in distribution), mask drafts verified in the same forward; no --tau")
    p.add_argument("--drafts", type=int, help="K of --exact: drafts per step (default: B)")
    p.add_argument("--draft-threshold", type=float, default=0.0,
                   help="--exact: keep only the leading drafts with probability >= this")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--show", action="store_true", help="print what each forward proposed and what the "
                   "rule kept, on stderr (show.py); /show in --chat switches it")
    p.add_argument("--device", default="auto", help="auto (the default): cuda when present, else cpu")
    p.add_argument("--fast", action="store_true", help="decode through the engine (fast/, docs/performance"
                   ".md): bf16 where the device has bf16 units, batch-invariant; default: the reference")
    p.add_argument("--compile", action="store_true", help="--fast, with the decoding step compiled once "
                   "per shape (CUDA graphs on a GPU, inductor on the CPU; the first reply pays the compile)")
    p.add_argument("--device-loop", action="store_true", help="--fast, the whole step compiled on the "
                   "device (head, acceptance, cache update; a host read per 8 steps; fast/loop.py)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="default: float32, or with --fast auto: bfloat16 where the device has bf16 units, "
                   "else float32 (util/precision.py); bfloat16 and float16 decode through the engine, "
                   "which is what keeps exact mode exact in them")
    args = p.parse_args(argv)
    if not (args.chat or args.prompt is not None or args.prompt_ids is not None or args.prompts_file):
        p.error("give one of --prompt, --prompt-ids, --prompts-file or --chat")
    return args


def block_size_of(args, ck):
    """B: --block-size, else what the checkpoint was trained with, else the default; said on stderr."""
    if args.block_size is not None:
        B, where = args.block_size, "--block-size"
    elif ck.block_size is not None:
        B, where = ck.block_size, f"{ck.path}/mars.json"
    else:
        B, where = DEFAULT_BLOCK_SIZE, "the default: the checkpoint does not record one"
    if B < 1:
        raise ValueError(f"--block-size must be >= 1, got {B}")
    print(f"[B={B} from {where}]", file=sys.stderr)
    return B


def tau_of(args, ck, metric):
    """τ: --tau, else 0.95 (the paper's, §5) for a MARS-trained checkpoint, else plain AR: the
    mask predictions of a model that MARS never trained are guesses (said on stderr)."""
    if args.tau is not None:
        return args.tau
    if ck.block_size is not None or "mars.json" not in os.listdir(ck.path):
        return 0.95
    tau = 0.0 if metric == "entropy" else 1.0
    if not args.exact:  # exact mode reads no τ
        print(f"[tau={tau} (plain AR): {ck.path}/mars.json records no block size, the model is not "
              "MARS-trained; give --tau to override]", file=sys.stderr)
    return tau


def open_model(args):
    """The checkpoint, its model the reference (float32, plain) or, with --fast, --compile or a
    low-precision --dtype, the engine (fast.make_fast) -> (Checkpoint, what runs, in words)."""
    args.fast = args.fast or args.compile or args.device_loop or args.dtype in ("auto", "bfloat16", "float16")
    dtype, why = choose_dtype(args.dtype or ("auto" if args.fast else "float32"), args.device)
    ck = load_checkpoint(args.ckpt, args.device, dtype)
    if not args.fast:
        return ck, f"{dtype_name(dtype)}: the reference (--fast for the engine)"
    import fast  # the engine, only when asked for: the reference never loads it

    fast.make_fast(ck.model, compile=args.compile and not args.device_loop)
    how = ", the step on the device" if args.device_loop else ", compiled" if args.compile else ""
    return ck, f"{dtype_name(dtype)}: {why}; the engine{how}"


def run(args):
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed, args.accept_metric)
    if args.tau is not None:
        check_tau(args.tau, sampling.accept_metric)
    if args.device_loop and args.cache != "window":
        raise ValueError(f"--device-loop decodes with --cache window, got --cache {args.cache}")
    if args.device_loop and sampling.accept_metric != "probability":
        raise ValueError(f"--device-loop compares τ with the probability, got --accept-metric "
                         f"{sampling.accept_metric}")
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    ck, why = open_model(args)
    print(f"[{why}]", file=sys.stderr)  # said once it loaded
    args.tau = tau_of(args, ck, sampling.accept_metric)
    if args.chat and ck.tok is None:
        raise ValueError(f"--chat needs a tokenizer, and {args.ckpt} has no tokenizer files")
    mask_id = args.mask_id if args.mask_id is not None else ck.mask_id
    if mask_id is None:
        raise ValueError(f"{args.ckpt} has no tokenizer files: --mask-id is required")
    B = block_size_of(args, ck)
    if args.exact:
        check_exact(args.drafts or B, B, args.draft_threshold)
    decode, knob = decoder(args, ck.model, B, mask_id, ck.eos_ids), Knob(args.tau, sampling)
    shown = functools.partial(trace, tok=ck.tok, eos_ids=ck.eos_ids, exact=args.exact)  # --show
    if args.chat:
        mode = "exact" if args.exact else f"tau={args.tau}, cache={args.cache}"
        return chat(ck.tok, decode, knob, ck.eos_ids, f"B={B}, {mode}, temperature={args.temperature}",
                    shown, args.show)
    prompts = read_prompts(args, ck.tok)
    t0, steps = time.perf_counter(), decode(prompts, knob)
    results = collect(shown(steps, prompts, sampling) if args.show else steps, len(prompts))
    report(results, ck.tok, ck.eos_ids, args.json, time.perf_counter() - t0)


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except USER_ERRORS as e:  # user mistakes and broken files: a message, not a traceback
        print(error_line(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
