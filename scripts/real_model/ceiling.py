"""The τ rule's ceiling: what a PERFECT mask could accept on given replies (issue 54; docs/spec.md §5).

The τ rule (§5.4) keeps c_0, then the mask candidates c_1, c_2, ... while their confidence p_j
is >= τ. The best a mask can do is to know the token j places ahead as well as the model
itself knows it once the tokens between are written: its distribution is then the model's
own AR distribution at that position, teacher-forced on the reply. How much the τ rule could
ever accept on a reply is therefore fixed by the model's own AR probabilities there, whatever
the training of the masks. For a reply r_0 .. r_{L-1} (ids, its EOS included when it ended)
after a prompt:

  q_t       = P_AR(r_t | prompt, r_0 .. r_{t-1}): the model's next-token probability of the
              reply's own token, teacher-forced (one plain causal forward, §1), softmax in
              float32 or the model's dtype if wider (§5.3). On the model's own greedy reply r_t
              is the argmax, and q_t is what a perfect mask at that position would report; for
              τ > 0.5, q_t >= τ also means r_t is the argmax, so a position passes only where a
              perfect mask would propose the reply's token.
  share_j   (j = 1 .. B-1) = the share of decoding positions t (c_0 = r_t, t + j <= L-1) whose
              next j positions all pass, q_{t+1} .. q_{t+j} >= τ: how often a perfect mask could
              add j tokens to a step. Pooled over replies (windows that pass / windows).
  tokens per forward bound: decode along the reply with the rule, from t = 0: a step emits
              1 + the leading run of k = 1 .. B-1 with t + k <= L-1 and q_{t+k} >= τ (the
              τ rule, generate.accept: τ >= 1 is AR mode, one token), and the next step starts
              after it; bound = sum L / sum steps over the replies (pooled as the decoder's
              tokens per forward are, scripts/real_model/evaluation.per_prompt).

What this module does not do: choose the replies (the caller: the model's own greedy replies,
or a data set's reference ones) or their prompts, decode, or load models.
"""

import numpy as np
import torch

from generate import accept


@torch.no_grad()
def own_probabilities(model, pairs, batch=8):
    """q of each (prompt ids, reply ids) pair: a float64 array (L,) per pair, q[t] = the model's
    probability of reply[t] after prompt + reply[:t] (module docstring). Rows are batched and
    right-padded (causal: padding after a row changes none of its outputs)."""
    device, out = model.lm_head.weight.device, []
    for i in range(0, len(pairs), batch):
        part = [(list(p), list(r)) for p, r in pairs[i:i + batch]]
        T = max(len(p) + len(r) for p, r in part)
        x = torch.tensor([p + r + [0] * (T - len(p) - len(r)) for p, r in part], device=device)
        h = model.hidden(x)  # (N, T, C)
        for k, (p, r) in enumerate(part):
            logits = model.lm_head(h[k, len(p) - 1:len(p) + len(r) - 1])  # (L, V): output t-1 predicts t
            logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            q = logp.gather(1, torch.tensor(r, device=device)[:, None]).exp()[:, 0]  # (L,)
            out.append(q.double().cpu().numpy())
    return out


def tau_rule_steps(q, tau, block_size):
    """The tokens each step emits along one reply when every mask is perfect (module docstring):
    generate.accept on [q_t, q_{t+1} .. q_{t+B-1}], positions past the reply counted as failing."""
    steps, t, L = [], 0, len(q)
    while t < L:
        window = np.zeros(block_size)
        window[:min(block_size, L - t)] = q[t:t + block_size]
        n = int(accept(torch.from_numpy(window)[None], tau)[0])
        steps.append(min(n, L - t))
        t += steps[-1]
    return steps


def ceiling(qs, tau, block_size):
    """The ceiling at one τ over replies, qs = own_probabilities(...) (module docstring):
    {"tau", "block_size", "replies", "positions" (reply tokens), "share" [share_1 .. share_{B-1}],
    "windows" [their denominators], "tokens_per_forward" (the bound), "tokens" and "forwards"
    (per reply, for an interval over replies)}."""
    passed, windows = np.zeros(block_size - 1, np.int64), np.zeros(block_size - 1, np.int64)
    tokens, forwards = [], []
    for q in qs:
        ok = (np.asarray(q)[1:] >= tau).astype(np.int64)  # position t+1 onwards: c_0 needs no test
        for j in range(1, block_size):
            if len(ok) >= j:  # the L - j decoding positions t with t + j <= L - 1
                passed[j - 1] += int((np.convolve(ok, np.ones(j, np.int64), "valid") == j).sum())
                windows[j - 1] += len(ok) - j + 1
        tokens.append(len(q))
        forwards.append(len(tau_rule_steps(q, tau, block_size)))
    share = [float(p / w) if w else None for p, w in zip(passed, windows)]
    return {"tau": tau, "block_size": block_size, "replies": len(qs), "positions": int(sum(tokens)),
            "share": share, "windows": windows.tolist(),
            "tokens_per_forward": sum(tokens) / sum(forwards) if sum(forwards) else None,
            "tokens": tokens, "forwards": forwards}


def measure(model, pairs, taus, block_size, batch=8):
    """ceiling() at each τ of `taus` for one model and its (prompt, reply) pairs (q computed once)."""
    qs = own_probabilities(model, pairs, batch)
    return [ceiling(qs, tau, block_size) for tau in taus]
