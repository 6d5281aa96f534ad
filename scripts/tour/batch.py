"""Section 1 of docs/tour.md: one tiny batch through mars.py (docs/spec.md §2-§4): the rows
padded and collated, the two streams and their mask, the right shift and the loss.

Every tensor comes from mars.py's own functions; mars_loss returns only its three means, so the
per-target CE is computed by the functions it calls, in its order, and checked equal to it.
The decoding sections are step.py's, the page's assembly page.py's.
"""

import torch

import mars
from scripts.tour.markup import cells, fn, grid, num, table
from scripts.tour.toy import EOS, ID, MASK, PAD, VOCAB, B, words


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
    out += ["", "By default train.py runs this loss through the engine's window "
            "([`fast/window.py`](../fast/window.py)), the same loss and gradients: it keeps only the noisy "
            "blocks the loss reads, runs the clean queries as ordinary causal attention with no mask "
            "tensor and hands attention only the kept noisy queries' rows of this mask. "
            "`--fast_loss=false` runs it as drawn here.", ""]
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
    inputs, position_ids = mars.two_stream_batch(ids, labels, MASK)  # (N, 2l) each: [clean | noisy]
    mask = mars.mars_attention_mask(l, B)  # (2l, 2l)
    h = model.hidden(inputs, position_ids, mask)  # (N, 2l, C)
    h_clean, h_noisy = h[:, :l], h[:, l:]  # (N, l, C) each: what mars_loss hands mars.summed_loss
    rows, src, tokens = mars._targets(labels)  # (n,) each: target src+1 is read at output src
    ce_noisy = mars._ce_at(model, h_noisy, rows, src, tokens)  # (n,)
    l_mask = mars._per_sequence_mean(ce_noisy, rows, N)
    ce_clean = mars._clean_at(model, h_clean, rows, src, tokens)  # (n,): the CE, as no teacher is given
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
            f"One forward, `model.hidden(inputs ({N}, {2 * l}), position_ids, mask ({2 * l}, {2 * l}))` -> h "
            f"({N}, {2 * l}, {C}), split into the two streams' outputs for {fn('mars.summed_loss')}; the LM "
            f"head runs only on the {n} outputs that carry loss, per stream: "
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
