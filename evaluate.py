"""Held-out accuracy and tokens per forward of a checkpoint on the synthetic test split.

Greedy decoding with the τ-gated acceptance rule of docs/spec.md §5 (τ = 1 is plain AR,
one token per forward). A problem counts as solved when the reply's last line reads
"The answer is X." with X exactly the expected answer (data/synthetic.py).
Tokens per forward = generated tokens / forward passes, summed over all problems
(a problem's forwards are the steps run while it was still generating).

    python evaluate.py --ckpt out/default/mars --taus 1,0.9
    python evaluate.py --ckpt out/default/mars --split hard    # longer problems than training shows
    python evaluate.py --ckpt out/default/mars --taus 0.95 --by-phase 0.95   # wrong steps by phase
    python evaluate.py --ckpt out/default/mars --taus 1 --nll   # + the reference replies' NLL

Accuracy saturates once a model has learned a family; `--nll` adds a measure that does not: the
mean negative log-likelihood of the reference replies under the model in one-token mode
(teacher-forced, the plain causal forward of §1), in nats per reply token.
"""

import argparse
import os
import sys
import time

import torch

from checkpoint import DEFAULT_BLOCK_SIZE, load_checkpoint
from data.synthetic import FAMILIES, is_correct, read_jsonl
from generate import accept, candidates, generate, nocache_logits
from util.atomic import write_json
from util.files import USER_ERRORS, error_line


@torch.no_grad()
def wrong_steps_by_phase(model, tok, problems, block_size, tau, mask_id=None, batch_size=256):
    """How often one §5 step accepts a wrong extra token, by the phase of its prefix.

    Along each reference reply, one step of the τ rule from every prefix (prompt plus
    the first i reply tokens, up to its <|im_end|>): the step is *wrong* when c_0 is
    right but the rule also accepts a c_j (j >= 1) that differs from the reference.
    The phase is the prefix length mod B. Training forms its noisy blocks at multiples
    of B from index 0 (§2-3), so only phase 0 matches what training ever showed; a
    decoder that accepted 1..B tokens per step starts its next step at any phase.
    -> {phase: [steps, wrong steps]} (steps counted only where c_0 is right).
    """
    B, out = block_size, {r: [0, 0] for r in range(block_size)}
    mask = tok.mask_id if mask_id is None else mask_id
    work = []  # (prefix, the reference tokens that follow it, at most B)
    for p in problems:
        prompt = tok.encode_chat(p["messages"][:-1], add_generation_prompt=True)
        full = tok.encode_chat(p["messages"])
        end = full.index(tok.eos_id, len(prompt)) + 1  # the reply up to its <|im_end|>
        work += [(full[:n], full[n:min(n + B, end)]) for n in range(len(prompt), end)]
    for i in range(0, len(work), batch_size):
        chunk = work[i:i + batch_size]
        cands, probs = candidates(nocache_logits(model, [w[0] for w in chunk], B, mask))
        n_acc = accept(probs, tau).tolist()
        for (prefix, ref), c, n in zip(chunk, cands.tolist(), n_acc):
            if c[0] != ref[0]:
                continue
            k = min(n, len(ref))
            out[len(prefix) % B][0] += 1
            out[len(prefix) % B][1] += int(c[:k] != ref[:k])
    return out


@torch.no_grad()
def reply_nll(model, tok, problems, batch_size=64):
    """Per problem [NLL summed over its reference reply (nats), reply tokens], under the causal
    model: for every reply token up to and including its <|im_end|>, -log p(token | everything
    before it). Rows are right-padded with EOS (causal attention: padding after a position cannot
    change its logits) and the padded positions are not counted."""
    rows, out, device = [], [], model.lm_head.weight.device
    for p in problems:
        prompt = tok.encode_chat(p["messages"][:-1], add_generation_prompt=True)
        full = tok.encode_chat(p["messages"])
        rows.append((full[:full.index(tok.eos_id, len(prompt)) + 1], len(prompt)))
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        T = max(len(f) for f, _ in chunk)
        ids = torch.tensor([f + [tok.eos_id] * (T - len(f)) for f, _ in chunk], device=device)
        logp = model(ids[:, :-1]).double().log_softmax(-1)
        for r, (full, start) in enumerate(chunk):  # token j is predicted at position j - 1
            tgt = torch.tensor(full[start:], device=device)
            out.append([-logp[r, start - 1:len(full) - 1].gather(-1, tgt[:, None]).sum().item(), len(tgt)])
    return out


def mean_nll(rows):
    """Nats per token over reply_nll's rows."""
    return sum(s for s, _ in rows) / sum(n for _, n in rows)


@torch.no_grad()
def evaluate(ckpt, data_dir="data/default", taus=(1.0, 0.9), block_size=None, split="test",
             limit=None, batch_size=50, max_new_tokens=96, cache="window", device="cpu",
             model=None, verbose=True, by_phase=(), nll=False):
    """{tau: {"accuracy", "tokens_per_forward", "per_family", "seconds"}} on `split`; each τ
    of `by_phase` also gets "wrong_steps_by_phase" (wrong_steps_by_phase); with `nll`, the
    record of τ = 1 also gets "reply_nll" (mean_nll of reply_nll), overall and "reply_nll_by_family"."""
    ck = load_checkpoint(ckpt, device, model=model)
    tok, model, eos = ck.tok, ck.model, ck.eos_ids
    if tok is None:
        raise ValueError(f"{ckpt}: no tokenizer files (evaluation decodes text)")
    block_size = block_size or ck.block_size or DEFAULT_BLOCK_SIZE
    problems = read_jsonl(os.path.join(data_dir, f"{split}.jsonl"))[:limit]
    prompts = [tok.encode_chat(p["messages"][:-1], add_generation_prompt=True) for p in problems]
    results = {}
    for tau in taus:
        t0 = time.time()
        correct, tokens, forwards = [], 0, 0
        for i in range(0, len(prompts), batch_size):
            gens = generate(model, prompts[i:i + batch_size], block_size=block_size, tau=tau,
                            max_new_tokens=max_new_tokens, mask_id=ck.mask_id, eos_ids=eos,
                            cache=cache)
            for p, g in zip(problems[i:i + batch_size], gens):
                correct.append(is_correct(p, tok.decode([t for t in g.ids if t not in eos])))
                tokens += len(g.ids)
                forwards += g.forwards
        fam = {f: [c for c, p in zip(correct, problems) if p["family"] == f] for f in FAMILIES}
        results[tau] = {
            "accuracy": 100.0 * sum(correct) / len(correct),
            "tokens_per_forward": tokens / forwards,
            "per_family": {f: 100.0 * sum(v) / len(v) for f, v in fam.items() if v},
            "seconds": time.time() - t0,
        }
        if verbose:
            r = results[tau]
            fams = "  ".join(f"{f} {a:.0f}" for f, a in r["per_family"].items())
            print(f"tau={tau:<5} accuracy {r['accuracy']:5.1f}%  tokens/forward "
                  f"{r['tokens_per_forward']:.2f}  ({fams})  {r['seconds']:.0f}s", flush=True)
        if tau in by_phase:
            ph = wrong_steps_by_phase(model, tok, problems, block_size, tau, ck.mask_id)
            results[tau]["wrong_steps_by_phase"] = ph
            if verbose:
                print("  one step from each prefix of the reference replies, wrong extra token accepted:  "
                      + "  ".join(f"phase {r}: {w}/{n}" for r, (n, w) in ph.items()), flush=True)
    if nll:
        if 1.0 not in results:
            raise ValueError(f"nll=True needs τ = 1 among taus (its record holds the NLL), got {list(taus)}")
        r = results[1.0]
        rows = reply_nll(model, tok, problems)
        r["reply_nll"] = mean_nll(rows)
        r["reply_nll_by_family"] = {f: mean_nll([x for x, p in zip(rows, problems) if p["family"] == f])
                                    for f in FAMILIES if any(p["family"] == f for p in problems)}
        if verbose:
            print(f"reference replies' NLL {r['reply_nll']:.4f} nats/token  (" + "  ".join(
                f"{f} {v:.4f}" for f, v in r["reply_nll_by_family"].items()) + ")", flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--data-dir", default="data/default")
    ap.add_argument("--taus", default="1.0,0.9", help="comma-separated τ values")
    ap.add_argument("--block-size", type=int, default=None, help="default: the checkpoint's mars.json")
    ap.add_argument("--split", default="test", help="test, val, or hard (data/synthetic.generate_hard: "
                    "each family longer than in training, scored on its own)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--cache", default="window", choices=["window", "block", "none"])
    ap.add_argument("--by-phase", default="", metavar="TAUS",
                    help="comma-separated τ values (of --taus) at which to also count wrong steps by "
                         "prefix length mod B (wrong_steps_by_phase)")
    ap.add_argument("--nll", action="store_true", help="also the reference replies' NLL in one-token "
                    "mode (reply_nll), stored with τ = 1")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.ckpt):
        sys.exit(f"error: checkpoint directory not found: {a.ckpt}")
    taus = [float(t) for t in a.taus.split(",")]
    by_phase = [float(t) for t in a.by_phase.split(",") if t]
    if missing := [t for t in by_phase if t not in taus]:
        sys.exit(f"error: --by-phase {a.by_phase}: {missing} not among --taus {a.taus}")
    if a.nll and 1.0 not in taus:
        sys.exit(f"error: --nll is stored with τ = 1, which is not among --taus {a.taus}")
    try:
        res = evaluate(a.ckpt, a.data_dir, taus, a.block_size, a.split, a.limit, cache=a.cache,
                       by_phase=by_phase, nll=a.nll)
    except USER_ERRORS as e:  # a broken checkpoint or data file: a message, not a traceback
        sys.exit(error_line(e))
    if a.json:
        write_json(a.json, res)


if __name__ == "__main__":
    main()
