"""MARS inference: τ-gated multi-token decoding (MARS_SPEC §5) with exact KV caches (§6).

Each step appends B `<|mask|>` tokens to the prefix and runs ONE plain causal
forward. The output at the last prefix token is the ordinary AR prediction c_0;
the output at mask j-1 proposes c_j. c_0 is always accepted, then c_1, c_2, ...
while their softmax probability is >= τ (`accept`). τ = 1 is plain greedy AR;
lower τ trades accuracy for tokens per forward. τ is read before every step from
a mutable `Knob`, so it can change between steps while the model stays loaded.

Three ways to run the same loop, all producing the tokens of the no-cache loop:

  cache="none"    recompute [prefix | B masks] from scratch every step.
  cache="window"  (§6 sliding window) forward [tokens accepted last step | B masks]
                  against the cache; commit the real tokens, drop the masks.
  cache="block"   (§6 block-level cache, the paper's batch strategy) the prefix cache
                  is frozen while a block of B_cache slots is filled by inner steps
                  that forward only the block; one forward of the filled block then
                  extends the cache. See `block_steps`.

Batches are right-padded: a row's tokens start at slot 0 and its position ids are
slot indices, so with plain causal attention no real token ever sees a pad, and
every row accepts its own number of tokens. `generate_ar` is the plain AR decoder
on the same KVCache: the honest baseline.

CLI: python generate.py --ckpt DIR --prompt "Hi" --tau 0.9 --block-size 4 (see --help).
"""

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from kvcache import KVCache
from model import Qwen2

CACHE_MODES = ("window", "block", "none")
DEFAULT_BLOCK_CACHE = 32  # the paper's best B_cache at batch 4 and 8 (§7)


@dataclass
class Knob:
    """The live τ: the decoder reads `knob.tau` before every step, so a caller (or the
    chat's `/tau`) can change it between steps: `knob.tau = 1.0` -> AR from the next step."""
    tau: float


@dataclass
class Step:
    """What one decoding step produced (yielded by `mars_steps`)."""
    tokens: list[list[int]]  # tokens accepted this step per row; [] for a finished or idle row
    done: list[bool]  # row finished (EOS accepted or max_new_tokens reached), after this step
    forwards: int  # model forwards so far, all rows together (prefill and block extensions too)
    tau: float  # the τ this step used

    @property
    def counts(self) -> list[int]:
        return [len(t) for t in self.tokens]


@dataclass
class Generation:
    ids: list[int]  # generated tokens, prompt excluded, EOS included if one was accepted
    forwards: int  # model forwards run while this prompt was still generating


# ---------------------------------------------------------------- the acceptance rule (§5)
def candidates(logits):
    """logits (N, B, V) read at [last prefix token, mask 0, ..., mask B-2] ->
    candidates c (N, B) (argmax) and their confidences p (N, B), softmax in float32 (§5.2-3)."""
    logits = logits.float()
    c = logits.argmax(-1)  # (N, B)
    p = logits.softmax(-1).gather(-1, c[..., None])[..., 0]  # (N, B)
    return c, p


def accept(probs, tau):
    """The acceptance rule (§5.4-5): how many leading candidates each row keeps, (N,).

    c_0 is always accepted; then c_1, c_2, ... while p_j >= τ, stopping at the first
    failure. τ >= 1 accepts only c_0 (fp32 probabilities can round to exactly 1.0)."""
    N = probs.shape[0]
    if tau >= 1:
        return torch.ones(N, dtype=torch.long, device=probs.device)
    ok = probs[:, 1:] >= tau  # (N, B-1): may c_1 .. c_{B-1} be kept?
    return 1 + ok.long().cumprod(1).sum(1)  # 1 + length of the leading run of True


def stop_at_eos(cands, n, eos_ids):
    """Cut each row's accepted run just after its first EOS (§5.6): -> (n, hit_eos), (N,) each."""
    B = cands.shape[1]
    eos = torch.tensor(list(eos_ids), dtype=cands.dtype, device=cands.device)
    kept = torch.arange(B, device=cands.device) < n[:, None]  # (N, B)
    is_eos = torch.isin(cands, eos) & kept
    hit = is_eos.any(1)
    first = is_eos.int().argmax(1)  # index of the first EOS (argmax returns the first max)
    return torch.where(hit, first + 1, n), hit


def decide(logits, tau, budget, eos_ids):
    """One step's decision for N rows: candidates, τ rule, token budget, EOS.
    -> cands (N, B), n accepted (N,), hit_eos (N,)."""
    cands, probs = candidates(logits)
    n = torch.minimum(accept(probs, tau), budget)
    n, hit = stop_at_eos(cands, n, eos_ids)
    return cands, n, hit


# ---------------------------------------------------------------- forwards
def pad_rows(rows, pad_id, device):
    """Right-pad lists of ids into a (N, T) tensor."""
    T = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (T - len(r)) for r in rows], dtype=torch.long, device=device)


def logits_at(model, h, start, n):
    """Logits of outputs start[b] .. start[b]+n-1 of each row: h (N, T, C) -> (N, n, V).
    The LM head runs only on the positions we read (V is 150k for Qwen2.5)."""
    idx = start[:, None] + torch.arange(n, device=h.device)  # (N, n)
    h = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))  # (N, n, C)
    return model.lm_head(h)


def nocache_logits(model, seqs, B, mask_id):
    """cache="none": one plain causal forward of [prefix | B masks] per row, from scratch.
    -> logits (N, B, V) at the last prefix token and masks 0 .. B-2."""
    device = model.lm_head.weight.device
    h = model.hidden(pad_rows([s + [mask_id] * B for s in seqs], mask_id, device))  # (N, T, C)
    lens = torch.tensor([len(s) for s in seqs], device=device)
    return logits_at(model, h, lens - 1, B)


def window_logits(model, cache, pending, B, mask_id):
    """cache="window" (§6 sliding window), the cache update: forward [pending | B masks]
    per row against the cache, then commit only the pending (real) tokens. The masks'
    K/V lie past the committed length and are overwritten by the next write.

    Ragged rows are right-padded inside the window, so a row's masks directly follow
    its pending tokens and plain causal attention never shows a real token a pad.
    pending: per row the tokens accepted but not cached yet ([] for a finished row).
    -> logits (N, B, V) at the last pending token and masks 0 .. B-2."""
    device = model.lm_head.weight.device
    h = model.hidden(pad_rows([p + [mask_id] * B for p in pending], mask_id, device), cache=cache)
    n = torch.tensor([len(p) for p in pending], device=device)
    cache.commit(n)
    return logits_at(model, h, (n - 1).clamp(min=0), B)


def extend_cache(model, cache, tokens, n):
    """Forward tokens (N, T) against the cache, commit the first n[b] of each row, and
    return the final hidden state of each row's last committed token (N, C): the block
    cache's prefill and its per-block extension (§6 step 3). The stored "last logit" is
    kept as this hidden state; the LM head is applied when a candidate is read."""
    h = model.hidden(tokens[:, : int(n.max())], cache=cache)  # (N, T, C)
    cache.commit(n)
    return h[torch.arange(h.shape[0], device=h.device), (n - 1).clamp(min=0)]


# ---------------------------------------------------------------- the decoding loops
def check_request(model, prompts, block_size, tau, max_new_tokens, mask_id=None):
    """Raise ValueError with a clear message for anything a user can get wrong."""
    cfg = model.config
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    check_tau(tau.tau if isinstance(tau, Knob) else tau)
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


def check_tau(tau):
    if not tau > 0:  # also rejects NaN
        raise ValueError(f"tau must be > 0, got {tau}")


@torch.no_grad()
def mars_steps(model, prompts, *, block_size, tau, max_new_tokens, mask_id, eos_ids=(),
               cache="window", block_cache_size=None):
    """Decode a batch of prompts (lists of ids) with MARS (§5), yielding a `Step` per step.

    tau: a float, or a `Knob` whose `.tau` is read before every step (change it
    between steps to change acceptance from the next step on). cache: "window",
    "block" or "none" (§6); block_cache_size: B_cache of the block mode (default 32).
    A row stops after an accepted EOS id (what followed it in that step is dropped)
    or after max_new_tokens; finished rows idle while the others go on."""
    check_request(model, prompts, block_size, tau, max_new_tokens, mask_id)
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
    knob = tau if isinstance(tau, Knob) else Knob(float(tau))
    prompts = [list(map(int, p)) for p in prompts]
    args = (model, prompts, block_size, knob, max_new_tokens, mask_id, tuple(eos_ids))
    if cache == "block":
        bc = DEFAULT_BLOCK_CACHE if block_cache_size is None else block_cache_size
        if bc < 1:
            raise ValueError(f"block cache size must be >= 1, got {bc}")
        yield from block_steps(*args, bc)
    else:
        yield from window_steps(*args, use_cache=cache == "window")


class _Rows:
    """Per-row bookkeeping shared by the loops: generated tokens and finished flags."""

    def __init__(self, n_rows, max_new, eos_ids):
        self.out = [[] for _ in range(n_rows)]
        self.done = [False] * n_rows
        self.max_new, self.eos_ids = max_new, eos_ids

    def active(self):
        return [b for b, d in enumerate(self.done) if not d]

    def take(self, rows, logits, tau):
        """Apply one step's decision to `rows` (logits (len(rows), B, V)); -> per-row new tokens."""
        check_tau(tau)
        budget = torch.tensor([self.max_new - len(self.out[b]) for b in rows], device=logits.device)
        cands, n, hit = decide(logits, tau, budget, self.eos_ids)
        new = [[] for _ in self.out]
        for i, b in enumerate(rows):
            new[b] = cands[i, : int(n[i])].tolist()
            self.out[b] += new[b]
            self.done[b] = bool(hit[i]) or len(self.out[b]) >= self.max_new
        return new


def window_steps(model, prompts, B, knob, max_new, mask_id, eos_ids, use_cache):
    """The step loop with the sliding-window cache, or without a cache (the reference:
    the window is then the whole sequence, recomputed). One forward per step."""
    rows = _Rows(len(prompts), max_new, eos_ids)
    if use_cache:
        max_len = max(map(len, prompts)) + max_new + 2 * B
        cache = KVCache.for_model(model, len(prompts), max_len)
        pending = [list(p) for p in prompts]  # the first window is the whole prompt (= prefill)
    forwards = 0
    while not all(rows.done):
        tau, active = knob.tau, rows.active()
        if use_cache:
            logits = window_logits(model, cache, pending, B, mask_id)[active]  # (n_active, B, V)
        else:
            logits = nocache_logits(model, [prompts[b] + rows.out[b] for b in active], B, mask_id)
        forwards += 1
        new = rows.take(active, logits, tau)
        if use_cache:
            pending = [[] if d else t for t, d in zip(new, rows.done)]
        yield Step(new, list(rows.done), forwards, tau)


def block_steps(model, prompts, B, knob, max_new, mask_id, eos_ids, block_cache):
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

    A step never stops at the block edge: the block buffer has B-1 spare slots past
    B_cache, so an inner step accepts exactly what the no-cache step accepts and the
    extension commits all filled slots (B_cache .. B_cache+B-1 per row). Cutting steps
    at the edge would replace an accepted mask prediction by an AR prediction, and the
    output would depend on B_cache. Hence block mode = no-cache loop, token for token.
    Forwards: 1 prefill + inner steps + 1 per completed block (at τ = 1, batch 1, no
    EOS: n + ceil(n / B_cache) for n tokens, B >= 2; with B = 1 an inner step at slot 0
    needs no forward, giving n)."""
    N, device = len(prompts), model.lm_head.weight.device
    rows = _Rows(N, max_new, eos_ids)
    cache = KVCache.for_model(model, N, max(map(len, prompts)) + max_new + block_cache + B)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    last = extend_cache(model, cache, pad_rows(prompts, mask_id, device), lens)  # prefill, (N, C)
    forwards = 1
    block = torch.full((N, block_cache + B - 1), mask_id, dtype=torch.long, device=device)
    filled = [0] * N  # slots of the block filled so far, per row
    while not all(rows.done):
        growing = [b for b in rows.active() if filled[b] < block_cache]
        if not growing:  # (3) every row filled the block: commit it, start the next one
            n = torch.tensor([0 if d else f for d, f in zip(rows.done, filled)], device=device)
            last = extend_cache(model, cache, block, n)
            forwards += 1
            block.fill_(mask_id)
            filled = [0] * N
            continue
        tau = knob.tau
        W = max(filled[b] for b in growing) + B - 1  # the last candidate needed is output W-1
        h = last.new_zeros(N, 0, last.shape[-1])
        if W > 0:  # (2) inner step: forward the block only; nothing is committed
            h = model.hidden(block[:, :W], cache=cache)  # (N, W, C)
            forwards += 1
        seq = torch.cat([last[:, None], h], 1)  # (N, W+1, C): seq[:, k] predicts slot k
        start = torch.tensor([filled[b] for b in growing], device=device)
        logits = logits_at(model, seq[growing], start, B)  # (n_growing, B, V)
        new = rows.take(growing, logits, tau)
        for b in growing:
            block[b, filled[b]: filled[b] + len(new[b])] = torch.tensor(new[b], device=device)
            filled[b] += len(new[b])
        yield Step(new, list(rows.done), forwards, tau)


def collect(steps, n_rows):
    """Run a step generator to the end -> one `Generation` per row."""
    out = [Generation([], 0) for _ in range(n_rows)]
    done = [False] * n_rows
    for step in steps:
        for b in range(n_rows):
            if not done[b]:
                out[b].ids += step.tokens[b]
                out[b].forwards = step.forwards
        done = step.done
    return out


def generate(model, prompts, *, block_size, tau, max_new_tokens, mask_id, eos_ids=(),
             cache="window", block_cache_size=None):
    """MARS-decode a batch of prompts -> list of `Generation` (ids, forwards), one per prompt."""
    steps = mars_steps(model, prompts, block_size=block_size, tau=tau, max_new_tokens=max_new_tokens,
                       mask_id=mask_id, eos_ids=eos_ids, cache=cache, block_cache_size=block_cache_size)
    return collect(steps, len(prompts))


@torch.no_grad()
def ar_steps(model, prompts, max_new_tokens, eos_ids=()):
    """Plain greedy AR decoding on the KVCache (prefill, then one token per forward, no
    masks), yielding a `Step` per token: the baseline MARS must beat."""
    check_request(model, prompts, 1, 1.0, max_new_tokens)
    prompts = [list(map(int, p)) for p in prompts]
    N, device = len(prompts), model.lm_head.weight.device
    rows = _Rows(N, max_new_tokens, tuple(eos_ids))
    cache = KVCache.for_model(model, N, max(map(len, prompts)) + max_new_tokens + 1)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    last = extend_cache(model, cache, pad_rows(prompts, 0, device), lens)  # prefill, (N, C)
    forwards = 1
    while True:
        active = rows.active()
        new = rows.take(active, model.lm_head(last[active, None]), 1.0)
        yield Step(new, list(rows.done), forwards, 1.0)
        if all(rows.done):
            return
        tok = torch.tensor([t[0] if t else 0 for t in new], device=device)[:, None]  # (N, 1)
        last = extend_cache(model, cache, tok, torch.ones_like(lens))
        forwards += 1


def generate_ar(model, prompts, max_new_tokens, eos_ids=()):
    """Greedy AR baseline -> list of `Generation` (ids, forwards), one per prompt."""
    return collect(ar_steps(model, prompts, max_new_tokens, eos_ids), len(prompts))


# ---------------------------------------------------------------- command line
def load_tokenizer(ckpt):
    """The checkpoint's tokenizer, or None when it has no tokenizer files."""
    try:
        from tokenizer import Tokenizer
    except ModuleNotFoundError as e:
        if e.name != "tokenizer":  # only the repo's own tokenizer.py being absent is tolerated
            raise
        return None
    try:
        return Tokenizer.from_dir(ckpt)
    except FileNotFoundError:
        return None


def checkpoint_eos_ids(ckpt, tok):
    """EOS ids: generation_config.json / config.json eos_token_id, plus the tokenizer's
    <|im_end|> and <|endoftext|>. Empty when none is known (then generate to the limit)."""
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(ckpt, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
    if tok is not None:
        ids.update([tok.eos_id, tok.endoftext_id])
    return tuple(sorted(ids))


def parse_ids(text):
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise ValueError("empty prompt (--prompt-ids has no ids)")
    return ids


def chat_ids(tok, text):
    if not text.strip():
        raise ValueError("empty prompt")
    return tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)


def read_prompts(args, tok):
    """The prompt ids the command line asks for."""
    if args.prompt_ids is not None:
        return [parse_ids(args.prompt_ids)]
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("empty prompt")
    if tok is None:
        raise ValueError(f"{args.ckpt} has no tokenizer files: give raw ids with --prompt-ids "
                         "(and --mask-id)")
    if args.prompt is not None:
        return [chat_ids(tok, args.prompt)]
    if not os.path.isfile(args.prompts_file):
        raise ValueError(f"prompts file not found: {args.prompts_file}")
    with open(args.prompts_file) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{args.prompts_file} holds no prompt")
    return [chat_ids(tok, line) for line in lines]


def decode_steps(model, prompts, args, tau, mask_id, eos_ids):
    """The step generator the command line asks for: MARS τ-gated, or --exact."""
    if args.exact:
        from exact import exact_steps  # exact.py builds on this file

        return exact_steps(model, prompts, block_size=args.block_size,
                           drafts=args.drafts or args.block_size, max_new_tokens=args.max_new_tokens,
                           mask_id=mask_id, eos_ids=eos_ids, draft_threshold=args.draft_threshold)
    return mars_steps(model, prompts, block_size=args.block_size, tau=tau,
                      max_new_tokens=args.max_new_tokens, mask_id=mask_id, eos_ids=eos_ids,
                      cache=args.cache, block_cache_size=args.block_cache_size)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="MARS τ-gated multi-token generation (MARS_SPEC §5-6)")
    p.add_argument("--ckpt", required=True, help="HF-layout checkpoint directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a user message, sent through the chat template")
    src.add_argument("--prompt-ids", help="raw prompt token ids, comma-separated (no template)")
    src.add_argument("--prompts-file", help="a text file, one user message per line (one batch)")
    src.add_argument("--chat", action="store_true", help="interactive chat; /tau X changes tau")
    p.add_argument("--tau", type=float, default=0.95, help="acceptance threshold; >= 1 is plain AR")
    p.add_argument("--block-size", type=int, default=4, help="B: masks appended per step")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--mask-id", type=int, help="<|mask|> id (default: from the tokenizer)")
    p.add_argument("--cache", choices=CACHE_MODES, default="window")
    p.add_argument("--block-cache-size", type=int, help=f"B_cache of --cache block "
                   f"(default {DEFAULT_BLOCK_CACHE})")
    p.add_argument("--exact", action="store_true", help="exact mode (exact.py): the greedy AR "
                   "output, with mask drafts verified in the same forward; --tau is not used")
    p.add_argument("--drafts", type=int, help="K of --exact: drafts per step (default: --block-size)")
    p.add_argument("--draft-threshold", type=float, default=0.0,
                   help="--exact: keep only the leading drafts with probability >= this")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = p.parse_args(argv)
    if not (args.chat or args.prompt is not None or args.prompt_ids is not None or args.prompts_file):
        p.error("give one of --prompt, --prompt-ids, --prompts-file or --chat")
    return args


def run(args):
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    check_tau(args.tau)
    if not os.path.isdir(args.ckpt):
        raise ValueError(f"checkpoint directory not found: {args.ckpt}")
    tok = load_tokenizer(args.ckpt)
    if args.chat and tok is None:
        raise ValueError(f"--chat needs a tokenizer, and {args.ckpt} has no tokenizer files")
    mask_id = args.mask_id if args.mask_id is not None else getattr(tok, "mask_id", None)
    if mask_id is None:
        raise ValueError(f"{args.ckpt} has no tokenizer files: --mask-id is required")
    prompts = None if args.chat else read_prompts(args, tok)
    model = Qwen2.from_pretrained(args.ckpt, getattr(torch, args.dtype), args.device).eval()
    eos_ids = checkpoint_eos_ids(args.ckpt, tok)
    if args.chat:
        from chat import chat  # the interactive loop lives in chat.py

        return chat(model, tok, args, mask_id, eos_ids)
    t0 = time.perf_counter()
    results = collect(decode_steps(model, prompts, args, args.tau, mask_id, eos_ids), len(prompts))
    dt = time.perf_counter() - t0
    for r in results:
        record = {"ids": r.ids, "forwards": r.forwards,
                  "tokens_per_forward": round(len(r.ids) / r.forwards, 4)}
        if tok is not None:
            record["text"] = tok.decode([t for t in r.ids if t not in eos_ids])
        if args.json:
            print(json.dumps(record))
        else:
            print(record.get("text", " ".join(map(str, r.ids))))
            print(f"[{len(r.ids)} tokens, {r.forwards} forwards, {record['tokens_per_forward']:.2f} "
                  "tokens/forward]", file=sys.stderr)
    n = sum(len(r.ids) for r in results)
    print(f"[{n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s]", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError, KeyError) as e:  # user mistakes: a message, not a traceback
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
