"""The guided trace docs/tour.md: one tiny batch through mars.py and one decoding step through
generate.py and exact.py, with shapes, each stage linked to its function and MARS_SPEC section.

The page is generated so that it stays true: every tensor on it comes from calling the
repository's own functions on a tiny seeded random model (model.Qwen2, model.init_weights,
float64 so that no printed digit depends on the machine's rounding). The tour computes no rule
itself. Where an intermediate (the per-target CE, a decoding step's KV cache and drafts) is not
returned by a public function, it calls the smaller functions the real code calls, in the same
order, says so on the page, and checks that the result equals the public function's.
Every number printed is checked to be far from a rounding boundary, every argmax far from a
tie and τ far from every probability it is compared with, so another machine prints the same
page (tests/test_tour.py checks the committed page is what this script gives today).

    python -m scripts.tour            # (re)writes docs/tour.md
    python -m scripts.tour --out -    # prints the page instead
"""

import argparse
import math

import torch

import exact
import generate
import mars
from decoding import Rows, candidates, logits_at, pad_rows
from kvcache import KVCache
from model import Qwen2, Qwen2Config, init_weights
from sampling import GREEDY, pick
from util.atomic import write_text

# A vocabulary of words, so that the trace reads as text; ids are the list indices.
VOCAB = ["<pad>", "<eos>", "<mask>", "Q:", "A:", "1", "2", "3", "4", "5", "+", "=", "hi", "hello",
         "there", "!"]
ID = {w: i for i, w in enumerate(VOCAB)}
PAD, EOS, MASK = ID["<pad>"], ID["<eos>"], ID["<mask>"]
B = 4  # block size, training and decoding
TAU = 0.8  # the τ of section 2: no probability on the page lies within 1e-3 of it
K = 2  # exact mode's drafts per step (K <= B)
SEED, STD = 139, 0.5  # init seed and std: chosen so that both steps accept one mask prediction
PROMPT = "Q: 2 + 3 ="
MAX_NEW = 8  # new tokens per decoding request
CONFIG = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
              tie_word_embeddings=True)
SPEC = "../../shared/MARS_SPEC.md"


# ---------------------------------------------------------------- helpers
def tiny_model():
    """A 2-layer Qwen2 over VOCAB, seeded; a large std makes it peaked (argmaxes far from ties)."""
    return init_weights(Qwen2(Qwen2Config(**CONFIG)), std=STD, seed=SEED).to(torch.float64).eval()


def words(ids):
    """Token ids -> their words, space-separated."""
    return " ".join(VOCAB[t] for t in ids)


def prob(p):
    """A probability, 2 decimals (float32 softmax: its last bits differ between machines)."""
    return num(p, 2)


def num(x, nd=3):
    """x with nd decimals; refuses a value within 1e-6 of a rounding boundary, whose last digit
    another machine's rounding (float32 softmax: ~1e-7) could flip."""
    s = float(x) * 10**nd
    if abs(s - math.floor(s) - 0.5) < 1e-6 * 10**nd:
        raise AssertionError(f"{float(x)!r} is too close to a rounding boundary to print")
    return f"{float(x):.{nd}f}"


def far_from_ties(logits):
    """Every argmax the page shows wins by > 1e-6 (in float32, where the decoders take it)."""
    top = logits.float().topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min() > 1e-6, "an argmax is near a tie"


def fn(name):
    """`mars.pad_row` -> a link to the file that defines it (docs/ sits one level down)."""
    return f"[`{name}`](../{name.split('.')[0]}.py)"


def table(head, rows):
    """A markdown table: head (list of str), rows (lists of values)."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]


def grid(allowed, labels, heads, cuts, strong):
    """A bool (T, T) mask as an x/. picture, rows = queries (labels), columns = keys (heads, one
    character each); a gap before the indices in `cuts` (blocks, groups), a wider one before
    those in `strong` (streams, real tokens | masks)."""
    def line(chars):
        gap = lambda i: "   " if i in strong else "  " if i in cuts else " "
        return "".join(gap(i) + c for i, c in enumerate(chars))
    w = max(map(len, labels))
    out = [" " * w + line(heads)]
    for lab, row in zip(labels, allowed.tolist()):
        out.append(lab.ljust(w) + line(["x" if a else "." for a in row]))
    return ["```"] + out + ["```"]


def cells(label, values, width, gaps):
    """One line of a fixed-width picture: label, then values, with '|' before indices in gaps."""
    return label + "".join((" |" if i in gaps else "") + f" {v:>{width}}" for i, v in enumerate(values))


# ---------------------------------------------------------------- 1. training (mars.py)
def batch_section():
    """§2: two templated rows -> mars.pad_row -> mars.collate. -> (lines, ids, labels)."""
    raw = [("Q: 2 + 3 = A: 5 <eos>", 2), ("hi hello <eos>", 2)]  # (row, its last n_loss tokens carry loss)
    rows = []
    out = ["## 1. Training: one batch through mars.py", "",
           f"### 1.1 Rows, EOS-padded to a multiple of B = {B}: {fn('mars.pad_row')} (§2)", "",
           "Only the answer carries loss (its tokens in the `labels` column; `·` = -100, no loss). "
           "The EOS pads that `pad_row` appends carry loss too: they teach masks past the end "
           "of the answer to say `<eos>`.", ""]
    body = []
    for name, (text, n_loss) in zip("AB", raw):
        ids = [ID[w] for w in text.split()]
        loss_mask = [i >= len(ids) - n_loss for i in range(len(ids))]
        rows.append(mars.pad_row(ids, loss_mask, B, EOS))
        body.append([name, f"`{text}`", len(ids), f"`{words(rows[-1][0])}`", len(rows[-1][0]),
                     f"`{labels_text(rows[-1][1])}`"])
    out += table(["row", "templated row", "length", "pad_row ids", "length", "labels"], body)
    ids, labels = mars.collate(rows, PAD)
    N, l = ids.shape
    out += ["", f"### 1.2 The batch, right-padded with `<pad>` (no loss): {fn('mars.collate')} (§2)", "",
            f"`ids` and `labels` are ({N}, {l}) LongTensors; blocks are anchored at index 0 of each row, "
            "so row A's first response block starts inside the prompt.", "", "```"]
    out.append(cells("index   ", range(l), 6, range(B, l, B)))
    for name, r in zip("AB", range(N)):
        out.append(cells(f"ids    {name}", [VOCAB[t] for t in ids[r].tolist()], 6, range(B, l, B)))
        out.append(cells(f"labels {name}", labels_text(labels[r].tolist()).split(), 6, range(B, l, B)))
    return out + ["```", ""], ids, labels


def labels_text(labels):
    """Labels -> words, `·` for -100 (no loss)."""
    return " ".join("·" if t == mars.IGNORE else VOCAB[t] for t in labels)


def streams_section(ids, labels):
    """§3: the two streams, their shared position ids, and the mask drawn."""
    N, l = ids.shape
    inputs, position_ids = mars.two_stream_batch(ids, labels, MASK)  # (N, 2l) each
    out = [f"### 1.3 Two streams, one forward: {fn('mars.noisy_stream')}, {fn('mars.two_stream_batch')} "
           "(§3)", "",
           "The noisy stream replaces every loss-carrying token by `<mask>` (prompt and padding stay "
           f"real). `inputs` = [clean | noisy] is ({N}, {2 * l}); `position_ids` ({N}, {2 * l}) give a noisy "
           "token the position of its clean twin.", "", "```"]
    gaps = {l} | set(range(B, 2 * l, B))
    out.append(cells("position_ids", position_ids[0].tolist(), 6, gaps))
    for name, r in zip("AB", range(N)):
        out.append(cells(f"inputs  {name}   ", [VOCAB[t] for t in inputs[r].tolist()], 6, gaps))
    allowed = mars.mars_attention_mask(l, B)  # (2l, 2l)
    rows = [f"{s} {p} {VOCAB[t]}" for s, half in (("clean", ids[0]), ("noisy", inputs[0, l:]))
            for p, t in enumerate(half.tolist())]
    out += ["```", "", f"### 1.4 The attention mask: {fn('mars.mars_attention_mask')} (§3)", "",
            f"({2 * l}, {2 * l}) bool, rows = queries, columns = keys, `x` = may attend; labelled with "
            "row A's tokens (the mask is the same for every row). Clean queries are plain causal; a "
            "noisy query sees the clean tokens of earlier blocks and, causally, its own block of the "
            "noisy stream; no clean query sees a noisy key."]
    out += [""] + grid(allowed, rows, [str(i % l) for i in range(2 * l)], range(B, 2 * l, B), {l})
    out += ["", f"As run, {fn('mars.two_stream_window')} hands the model a `model.TwoStreamMask` holding "
            f"only the noisy rows ({l}, {2 * l}): the clean rows are ordinary causal attention, "
            "with no mask tensor.", ""]
    return out


def seen_by(allowed, q, row_inputs, l):
    """What query q of the (2l, 2l) mask may read, as the tokens of one row: 'clean [..] + noisy [..]'."""
    keys = allowed[q].nonzero()[:, 0].tolist()
    clean = [VOCAB[row_inputs[k]] for k in keys if k < l]
    noisy = [VOCAB[row_inputs[k]] for k in keys if k >= l]
    return " + ".join(f"{name} `{' '.join(t)}`" for name, t in (("clean", clean), ("noisy", noisy)) if t)


@torch.no_grad()
def loss_section(model, ids, labels):
    """§3-§4: the right shift (which output predicts which target) and each loss term.

    mars_loss returns only the three means, so the per-target CE is computed by the
    functions mars_loss calls, in its order; the means are checked equal to mars_loss's."""
    N, l = ids.shape
    rows, src, tokens = mars._targets(labels)  # (n,) each: target src+1 is read at output src
    inputs, position_ids, mask, start = mars.two_stream_window(ids, labels, MASK, B, trim=False)
    h = model.hidden(inputs, position_ids, mask)  # (N, 2l, C)
    ce_noisy = mars._ce_at(model, h, rows, l + src - start[rows], tokens)  # (n,)
    l_mask = mars._per_sequence_mean(ce_noisy, rows, N)
    ce_clean = mars._clean_at(model, h, rows, src, tokens)  # (n,): the CE, as no teacher is given
    l_ar = mars._per_sequence_mean(ce_clean, rows, N)
    loss, ref_mask, ref_ar = mars.mars_loss(model, ids, labels, MASK, B)
    assert torch.equal(l_mask, ref_mask) and torch.equal(l_ar, ref_ar) and torch.equal(loss, l_mask + l_ar)
    allowed = mars.mars_attention_mask(l, B)
    n, C = len(tokens), h.shape[-1]
    out = [f"### 1.5 Right shift: which output predicts which target: {fn('mars._targets')} (§3)", "",
           "The target at index i is read from output i-1 of the same stream, in both streams. A noisy "
           "output reads what its mask row allows: the row's first answer token is predicted from "
           "real tokens only (the prompt stays real in the noisy stream); every later one lies 2 or "
           "more tokens past the last real token its query sees.", ""]
    body = [["AB"[r], i + 1, f"`{VOCAB[t]}`", f"`{VOCAB[ids[r, i]]}`", f"`{VOCAB[inputs[r, l + i]]}`",
             seen_by(allowed, l + i, inputs[r].tolist(), l), num(cc), num(cn)]
            for r, i, t, cc, cn in zip(rows.tolist(), src.tolist(), tokens.tolist(), ce_clean, ce_noisy)]
    out += table(["row", "target index i", "target", "clean input i-1", "noisy input i-1",
                  "the noisy query i-1 sees", "CE_clean", "CE_noisy"], body)
    per_row = [" + ".join(f"{{{k}}}" for k in range(n) if rows[k] == r) for r in range(N)]
    formula = " + ".join(f"({terms}) / {int((rows == r).sum())}" for r, terms in enumerate(per_row))
    out += ["", f"### 1.6 The loss: {fn('mars.mars_loss')} (§4)", "",
            f"One forward, `model.hidden(inputs ({N}, {2 * l}), position_ids, mask)` -> h "
            f"({N}, {2 * l}, {C}); the LM head runs only on the {n} outputs that carry loss, per stream: "
            f"logits ({n}, {len(VOCAB)}) -> CE ({n},) (`mars._ce_at`, for L_AR through `mars._clean_at`, "
            "which is the CE when no teacher is given). Each term is a mean per row, "
            f"then over the {N} rows (`mars._per_sequence_mean`). These are the calls `mars_loss` makes, "
            "in its order; the three numbers below are checked equal to what `mars_loss` returns.", "", "```",
            f"L_mask = [{formula.format(*map(num, ce_noisy))}] / {N} = {num(l_mask)}",
            f"L_AR   = [{formula.format(*map(num, ce_clean))}] / {N} = {num(l_ar)}",
            f"loss   = L_mask + w * L_AR = {num(l_mask)} + 1 * {num(l_ar)} = {num(loss)}", "```", "",
            "w = 1 is the paper's equal weighting; w = 0, the \"w/o L_AR\" ablation, skips the clean "
            "stream's LM head (its keys are still read by the noisy queries).", ""]
    return out


# ---------------------------------------------------------------- 2. one τ-gated step (generate.py)
def tau_step(model, rows, cache, pending):
    """One step of generate.window_steps, call for call (the cache is internal to it, so the
    tour repeats its calls): forward [pending | B masks] against the cache, commit the pending
    tokens, read the candidates, apply τ. -> (x, positions, c, conf, n, kept)."""
    device = cache.lengths.device
    x = pad_rows([p + [MASK] * B for p in pending], MASK, device)  # (1, T)
    positions = cache.lengths[:, None] + torch.arange(x.shape[1])  # what model.hidden uses with a cache
    h = model.hidden(x, cache=cache)  # (1, T, C)
    n = torch.tensor([len(p) for p in pending], device=device)
    cache.commit(n)  # the cache update: the pending (real) tokens stay, the masks' K/V are dropped
    logits = logits_at(model, h, (n - 1).clamp(min=0), B)  # (1, B, V)
    far_from_ties(logits)
    c, conf = candidates(logits)  # what generate.take computes first, shown here
    assert (conf - TAU).abs().min() > 1e-3, "a probability lies within 1e-3 of τ"
    n_acc = int(generate.accept(conf, TAU)[0])
    kept = generate.take(rows, [0], logits, TAU)
    return x, positions, c[0].tolist(), conf[0].tolist(), n_acc, kept


def candidates_table(x, positions, c, conf, n_acc):
    """The candidates of one step: where each is read, its probability, the τ decision."""
    T = x.shape[1]
    body = []
    for j in range(B):
        at = T - B - 1 + j  # c_0 at the last prefix token, c_j at mask j-1
        test = ("always (the AR token)" if j == 0 else "-" if j > n_acc else
                f"{prob(conf[j])} {'>=' if conf[j] >= TAU else '<'} τ")
        verdict = "accepted" if j < n_acc else "stop: first failure" if j == n_acc else "not looked at"
        body.append([f"c_{j}", f"{at} (`{VOCAB[x[0, at]]}`, position {positions[0, at]})", f"`{VOCAB[c[j]]}`",
                     prob(conf[j]), test, verdict])
    return table(["candidate", "read at output (its input, position)", "argmax", "p", "test", ""], body)


@torch.no_grad()
def tau_section(model):
    """§5-§6: two τ-gated steps with the window cache; checked against generate.mars_decode."""
    prompt = [ID[w] for w in PROMPT.split()]
    rows = Rows(1, MAX_NEW, (EOS,))
    cache = KVCache.for_model(model, 1, len(prompt) + MAX_NEW + 2 * B)
    out = [f"## 2. One τ-gated step: {fn('generate.window_steps')} (§5, §6)", "",
           f"Prompt `{PROMPT}` ({len(prompt)} tokens), B = {B}, τ = {TAU}, greedy, the window cache "
           "(`cache=\"window\"`, the default). `window_steps` keeps its cache to itself, so the tour "
           "makes its calls one by one, in its order; the tokens are checked equal to "
           f"{fn('generate.mars_decode')}'s with `cache=\"window\"` and `cache=\"none\"`.", ""]
    pending, steps = [prompt], []
    for step in (1, 2):
        before = int(cache.lengths[0])
        x, positions, c, conf, n_acc, kept = tau_step(model, rows, cache, pending)
        steps.append(kept[0])
        out += tau_step_text(step, before, int(cache.lengths[0]), x, positions, c, conf, n_acc, kept[0])
        pending = kept
    for mode in ("window", "none"):
        ref = generate.mars_decode(model, [prompt], block_size=B, tau=TAU, max_new_tokens=MAX_NEW,
                                   mask_id=MASK, eos_ids=(EOS,), cache=mode)
        assert [next(ref).tokens[0] for _ in steps] == steps, f"the tour's steps differ from cache={mode}"
    return out


def tau_step_text(step, before, after, x, positions, c, conf, n_acc, kept):
    """The page's text for one τ step (tau_step's results)."""
    T, C, V = x.shape[1], CONFIG["hidden_size"], len(VOCAB)
    what = "the prompt" if step == 1 else "the tokens accepted last step, not yet cached"
    out = [f"### 2.{step} Step {step}: [{what} | {B} masks] (§5.1, §6)", "", "```",
           cells("position", positions[0].tolist(), 6, {T - B}),
           cells("input   ", [VOCAB[t] for t in x[0].tolist()], 6, {T - B}), "```", "",
           f"`model.hidden(x (1, {T}), cache=cache)` -> h (1, {T}, {C}), plain causal, against the "
           f"{before} cached slots; {fn('decoding.logits_at')} reads the last prefix output and the first "
           f"{B - 1} mask outputs -> logits (1, {B}, {V}) (the last mask's output is unused); "
           f"{fn('decoding.candidates')} -> c (1, {B}) = their argmaxes, p (1, {B}) = their float32 "
           "softmax probabilities (§5.2-3).", ""]
    out += candidates_table(x, positions, c, conf, n_acc)
    stop = f"; c_{n_acc} fails (p < τ) and ends the run" if n_acc < B else ""
    unseen = f", so c_{n_acc + 1}.. are not looked at whatever their p" if n_acc + 1 < B else ""
    out += ["", f"{fn('generate.accept')} -> {n_acc}: c_0 is always accepted, then c_1, c_2, ... while "
            f"p >= τ{stop}{unseen} (§5.4). {fn('generate.take')} hands them to "
            f"{fn('decoding.Rows.keep')} (the one EOS / budget cut, §5.6): kept `{words(kept)}`.", "",
            f"The cache update, made right after the forward: {fn('kvcache.KVCache.commit')}"
            f"(n = {after - before}), lengths {before} -> "
            f"{after}. The K/V of the {after - before} real tokens stay (slots {before}-{after - 1}); the "
            f"masks' K/V (slots {after}-{before + T - 1}) lie past `lengths` and are overwritten by the "
            "next forward (§6).", ""]
    return out


# ---------------------------------------------------------------- 3. one exact-mode step (exact.py)
@torch.no_grad()
def exact_run(model, prompt):
    """exact.exact_steps's prefill and first step, call for call (its cache and drafts are
    internal to it). -> a dict of what the page shows."""
    device, s = next(model.parameters()).device, GREEDY
    rows = Rows(1, MAX_NEW, (EOS,))
    cache = KVCache.for_model(model, 1, len(prompt) + MAX_NEW + (1 + K) ** 2)
    lens = torch.tensor([len(prompt)], device=device)
    x0 = pad_rows([prompt + [MASK] * K], MASK, device)  # (1, |P| + K): [prompt | G_0], plain causal
    h = model.hidden(x0, cache=cache)
    cache.commit(lens)  # the prompt only
    logits = logits_at(model, h, lens - 1, 1 + K)  # (1, 1+K, V): last prompt token, G_0
    c0 = pick(logits[:, :1], s)[:, 0].tolist()
    d, q = exact.draft(logits[:, 1:], 0.0, s)
    first = rows.keep([[c] for c in c0])
    r = dict(x0=x0, prefill=candidates(logits), c0=c0[0], drafts=d[0], first=first[0],
             P=int(cache.lengths[0]))
    d = [[] if rows.done[b] else d[b][: rows.left(b) - 1] for b in range(1)]  # the budget cut
    tokens, positions, mask = exact.step_input(c0, d, K, cache.lengths, MASK)  # (1, T), (1, T), (T, T)
    h = model.hidden(tokens, positions, mask, cache)  # (1, T, C)
    step_logits = model.lm_head(h)  # (1, T, V): one LM head call for verify and the groups
    a, bonus = exact.verify(step_logits, d, q, s)
    real = step_logits[:, : 1 + len(d[0])]  # (1, 1+k, V): the AR outputs verify reads, shown
    group = exact.group_logits(step_logits, a, max(map(len, d)), K)  # (1, K, V): G_a
    d_next, q = exact.draft(group, 0.0, s)
    emitted = [d[0][: int(a[0])] + [int(bonus[0])]]
    kept = rows.keep(emitted)
    exact.keep_verified(cache, a, ~torch.tensor(rows.done, device=device))
    for lg in (logits, real, group):
        far_from_ties(lg)
    r.update(tokens=tokens, positions=positions, mask=mask, C=h.shape[-1], real=candidates(real),
             a=int(a[0]), bonus=int(bonus[0]), group=candidates(group), next=d_next[0], kept=kept[0],
             after=int(cache.lengths[0]))
    return r


def span(a, after="", before=""):
    """The accepted drafts' names: '' (none), 'd_1', 'd_1..d_a', with before/after text."""
    return "" if a == 0 else f"{before}d_1{after}" if a == 1 else f"{before}d_1..d_{a}{after}"


def exact_prefill_text(r):
    """3.1: the prefill [prompt | G_0] and the first drafts."""
    T, P, (c, p) = r["x0"].shape[1], r["P"], r["prefill"]
    body = [[f"G_0 mask {m}", P + m, f"`{VOCAB[c[0, 1 + m]]}`", prob(p[0, 1 + m])] for m in range(K)]
    return [f"## 3. One exact-mode step: {fn('exact.exact_steps')} (§3, §5, §6)", "",
            f"Same prompt, K = {K} drafts per step (K <= B = {B}), greedy: the output is the AR output token "
            "for token, several tokens per forward when the model's own mask drafts are right. "
            "`exact_steps` keeps its cache and drafts to itself, so the tour makes its calls one by one, "
            "in its order; the tokens are checked equal to its own.", "",
            "### 3.1 Forward 1, the prefill: [prompt | G_0] (§5.1-2)", "",
            f"`model.hidden` of (1, {T}), plain causal; {fn('kvcache.KVCache.commit')} keeps the prompt "
            f"only (lengths 0 -> {P}). c_0 = the argmax at the last prompt token = `{VOCAB[r['c0']]}`, "
            f"emitted (not cached yet). The {K} masks of G_0 (positions {P}..{P + K - 1}; mask m predicts "
            f"the token at {P + 1}+m, past c_0) give the first drafts, {fn('exact.draft')}:", ""] + \
        table(["mask", "position", "draft (argmax)", "p"], body) + [""]


def exact_input_text(r):
    """3.2: the forward's input [c_0, d_1..d_K | G_0 | .. | G_K], its positions and mask."""
    tokens, positions, mask = r["tokens"], r["positions"], r["mask"]
    k, T = len(r["drafts"]), tokens.shape[1]
    slots = ["c_0"] + [f"d_{i}" for i in range(1, k + 1)] + [f"G_{j}" for j in range(k + 1) for _ in range(K)]
    groups = set(range(1 + k, T, K))
    labels = [f"{sl} {VOCAB[t]}" for sl, t in zip(slots[: 1 + k], tokens[0].tolist())]
    labels += [f"G_{j} mask {m}" for j in range(k + 1) for m in range(K)]
    return [f"### 3.2 Forward 2: the input, {fn('exact.step_input')} (§3)", "",
            f"`tokens` (1, {T}) = [c_0, d_1..d_{k} | G_0 | .. | G_{k}], `positions` (1, {T}), `mask` "
            f"({T}, {T}), from {fn('mars.exact_attention_mask')}. Real token i sits at |P| + i; mask m of "
            f"group G_j at |P| + j + 1 + m (|P| = {r['P']} cached tokens).", "", "```",
            cells("slot    ", slots, 6, groups), cells("position", positions[0].tolist(), 6, groups),
            cells("token   ", [VOCAB[t] for t in tokens[0].tolist()], 6, groups), "```", "",
            "The mask (rows = queries, columns = keys, `x` = may attend; the cached prompt is visible to "
            "every query as well, `model.build_mask`): the real tokens are plain causal, G_j sees "
            "c_0, d_1..d_j and its own earlier masks only: a noisy block of §3 whose clean context ends "
            "at d_j.", ""] + grid(mask, labels, [str(i) for i in range(T)], groups - {1 + k}, {1 + k}) + [""]


def exact_verify_text(r):
    """3.3-3.5: the drafts verified, what is accepted, the next drafts, the cache."""
    k, a, P, (c, p) = len(r["drafts"]), r["a"], r["P"], r["real"]
    reals = [r["c0"]] + r["drafts"]
    body = []
    for i in range(1 + k):
        checks = f"d_{i + 1} = `{VOCAB[r['drafts'][i]]}`" if i < k else "-"
        verdict = ("accepted" if i < a else "rejected" if i == a else "not tested") if i < k else ""
        verdict += "; the bonus is this argmax" * (i == a)
        body.append([f"`{VOCAB[reals[i]]}`", P + i, f"`{VOCAB[c[0, i]]}`", prob(p[0, i]), checks, verdict])
    gc, gp = r["group"]
    nxt = [[f"G_{a} mask {m}", P + a + 1 + m, f"`{VOCAB[gc[0, m]]}`", prob(gp[0, m])] for m in range(K)]
    out = [f"### 3.3 Verify: {fn('exact.verify')} (§5.2)", "",
           "The output at each real token is the exact AR prediction of the token after it. At "
           "temperature 0 a draft is accepted while it equals that argmax (speculative sampling with "
           "one-hot p and q, `sampling.speculative_accept`, run on the argmaxes by "
           "`sampling.greedy_accept`); the bonus token is the argmax after the last accepted one.", ""]
    out += table(["real token", "position", "its output's argmax", "p", "checks", ""], body)
    out += ["", f"a = {a} accepted, bonus = `{VOCAB[r['bonus']]}`: the step emits {span(a, ' + ')}the "
            f"bonus = `{words(r['kept'])}` ({len(r['kept'])} tokens from one forward).", "",
            f"### 3.4 The next drafts: {fn('exact.group_logits')}, {fn('exact.draft')} (§3)", "",
            f"G_{a} is the group that saw exactly the accepted tokens (c_0{span(a, '', ', ')}); its mask 0 "
            f"sits at the position of the bonus, so its {K} masks predict the {K} tokens after the bonus "
            f"(group logits (1, {K}, {len(VOCAB)})):", ""]
    out += table(["mask", "position", "next draft (argmax)", "p"], nxt)
    out += ["", f"### 3.5 The cache: {fn('exact.keep_verified')} (§6)", "",
            f"commit 1 + a = {1 + a}: lengths {P} -> {r['after']} (c_0{span(a, '', ', ')}: computed as "
            "real tokens on a verified prefix). The rejected drafts and every mask lie past `lengths` "
            f"and are overwritten next time; the bonus `{VOCAB[r['bonus']]}` is the next step's c_0.", ""]
    return out


@torch.no_grad()
def exact_section(model):
    """§3, §5, §6: exact mode's prefill and first step; checked against exact_steps and AR."""
    prompt = [ID[w] for w in PROMPT.split()]
    r = exact_run(model, prompt)
    ref = exact.exact_steps(model, [prompt], block_size=B, drafts=K, max_new_tokens=MAX_NEW, mask_id=MASK,
                            eos_ids=(EOS,))
    steps = [next(ref).tokens[0] for _ in range(2)]
    assert steps == [[r["c0"]], r["kept"]], "the tour's steps differ from exact_steps"
    return exact_prefill_text(r) + exact_input_text(r) + exact_verify_text(r)


@torch.no_grad()
def whole_runs(model):
    """The three decoders run to the end on the prompt, through their public entry points."""
    prompt, kw = [ID[w] for w in PROMPT.split()], dict(max_new_tokens=MAX_NEW, eos_ids=(EOS,))
    runs = [("`generate.generate_ar` (plain AR, §5 τ = 1)", generate.generate_ar(model, [prompt], **kw)[0]),
            (f"`generate.generate`, τ = {TAU}, B = {B}", generate.generate(
                model, [prompt], block_size=B, tau=TAU, mask_id=MASK, **kw)[0]),
            (f"`exact.generate_exact`, K = {K}", exact.generate_exact(
                model, [prompt], block_size=B, drafts=K, mask_id=MASK, **kw)[0])]
    assert runs[2][1].ids == runs[0][1].ids, "exact mode is not the AR output"
    out = ["## 4. The whole runs", "",
           f"`{PROMPT}`, at most {MAX_NEW} new tokens (a random model: the words mean nothing, the counts "
           "do; forwards include the prefill). Exact mode gives the AR tokens (checked); the τ rule "
           "may differ from them.", ""]
    return out + table(["decoder", "tokens", "forwards"], [[name, f"`{words(g.ids)}`", g.forwards]
                                                          for name, g in runs]) + [""]


# ---------------------------------------------------------------- the page
def header(model):
    """The page's title, how it is made, the model and the vocabulary."""
    cfg = model.config
    vocab = "  ".join(f"{i} `{w}`" for i, w in enumerate(VOCAB))
    return ["# A guided trace: one batch, one decoding step", "",
            "*Generated by `python -m scripts.tour`, which rewrites this page (`--out -` prints it "
            "instead); do not edit it by hand. [`tests/test_tour.py`](../tests/test_tour.py) checks "
            "that it is what the script gives today.*", "",
            "For students stepping through the code. Every tensor below is what the repository's own "
            "functions return (each stage links the function and cites its section §N of "
            f"[`MARS_SPEC.md`]({SPEC})), run on a tiny random model, so a debugger stopped in any of "
            "them while the script runs shows these values. Where a function keeps an intermediate to "
            "itself, the script makes the same calls it makes, in its order, and checks the result "
            f"against it ([`scripts/tour.py`](../scripts/tour.py)).", "",
            f"The model: {fn('model.Qwen2')} with {cfg.num_hidden_layers} layers, hidden size C = "
            f"{cfg.hidden_size}, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} key-value "
            f"heads, a vocabulary of V = {len(VOCAB)} words, {fn('model.init_weights')}(std = {STD}, "
            f"seed = {SEED}), in float64 (so no printed digit depends on the machine). It is untrained: "
            "its words mean nothing, the mechanics are the point. The seed was picked among a few "
            "hundred so that the first τ step and the exact step each accept one mask prediction and "
            "reject the next, and no generated token is `<pad>` or `<mask>`. Block size B = "
            f"{B} throughout.", "", f"Vocabulary: {vocab}.", ""]


def render():
    """The whole page, as text."""
    model = tiny_model()
    batch, ids, labels = batch_section()
    parts = [header(model), batch, streams_section(ids, labels), loss_section(model, ids, labels),
             tau_section(model), exact_section(model), whole_runs(model)]
    return "\n".join(line for part in parts for line in part).rstrip("\n") + "\n"


def main(argv=None):
    """Write the page (default docs/tour.md, atomically: util.atomic) or print it (--out -)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/tour.md", help="where to write the page; - prints it")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and leaves the other core free
    text = render()
    if args.out == "-":
        print(text, end="")
        return
    try:
        write_text(args.out, text)  # refuses a path that is not a regular file (a device, a folder)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
