"""Sections 2-4 of docs/tour.md: one τ-gated decoding step through generate.py (docs/spec.md
§5-§6), one exact-mode step through exact.py (§3, §5, §6), and the three decoders run to the end.

`window_steps` and `exact_steps` keep their cache and drafts to themselves, so each step here
makes their calls one by one, in their order, and the tokens are checked equal to the public
decoders' own (generate.mars_decode with cache "window" and "none", exact.exact_steps, and
exact mode against plain AR). The training section is batch.py's, the page's assembly page.py's.
"""

import torch

import exact
import generate
from decoding import Rows, logits_at, pad_rows
from sampling import GREEDY, pick
from scripts.tour.markup import cells, far_from_ties, fn, grid, prob, table
from scripts.tour.toy import CONFIG, EOS, ID, MASK, MAX_NEW, PROMPT, TAU, VOCAB, B, K, words


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
    c, conf = generate.candidates(logits)  # what generate.take computes first, shown here
    assert (conf - TAU).abs().min() > 1e-3, "a probability lies within 1e-3 of τ"
    n_acc = int(generate.accept(conf, TAU)[0])
    kept, _ = generate.take(rows, [0], logits, TAU)  # (kept tokens per row, what --show prints)
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
    cache = model.new_cache(1, len(prompt) + MAX_NEW, step=2 * B)  # as window_steps makes it
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
           f"{fn('generate.candidates')} -> c (1, {B}) = their argmaxes, p (1, {B}) = their float32 "
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
    cache = model.new_cache(1, len(prompt) + MAX_NEW, step=(1 + K) ** 2)  # as exact_steps makes it
    lens = torch.tensor([len(prompt)], device=device)
    x0 = pad_rows([prompt + [MASK] * K], MASK, device)  # (1, |P| + K): [prompt | G_0], plain causal
    h = model.hidden(x0, cache=cache)
    cache.commit(lens)  # the prompt only
    logits = logits_at(model, h, lens - 1, 1 + K)  # (1, 1+K, V): last prompt token, G_0
    c0 = pick(logits[:, :1], s)[:, 0].tolist()
    d, q = exact.draft(logits[:, 1:], 0.0, s)
    first = rows.keep([[c] for c in c0])
    r = dict(x0=x0, prefill=generate.candidates(logits), c0=c0[0], drafts=d[0], first=first[0],
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
    r.update(tokens=tokens, positions=positions, mask=mask, C=h.shape[-1], real=generate.candidates(real),
             a=int(a[0]), bonus=int(bonus[0]), group=generate.candidates(group), next=d_next[0], kept=kept[0],
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
