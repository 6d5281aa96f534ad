"""evaluate.wrong_steps_by_phase against the §5 step written out on HF transformers; evaluate's
reference-reply NLL against one unpadded HF forward per reply, in float64."""

import math

import torch
from conftest import hf_float64, make_hf_model
from greedy_margin import top2_gap

from evaluate import mean_nll, reply_nll, wrong_steps_by_phase
from model import Qwen2

MASK, EOS = 250, 251
# top-2 logit gap of every argmax the count reads: this peaked model's (initializer_range 0.6) fp32
# logits differ from HF's by up to 4.2e-5 (measured, tests/test_generate.py PEAKED_GAP): 24x
PEAKED_GAP = 1e-3


class IdsTokenizer:
    """encode_chat for messages that carry their own token ids."""
    mask_id, eos_id = MASK, EOS

    def encode_chat(self, messages, add_generation_prompt=False):
        return [t for m in messages for t in m["ids"]]


def hf_rule_by_phase(hf, rows, B, tau):
    """The same count, one HF forward per prefix, the τ rule spelled out."""
    out = {r: [0, 0] for r in range(B)}
    for prompt, reply in rows:
        full = prompt + reply
        for n in range(len(prompt), len(full)):
            ref = full[n:n + B]
            with torch.no_grad():
                logits = hf(torch.tensor([full[:n] + [MASK] * B])).logits[0].float()
            c = [int(logits[n - 1 + j].argmax()) for j in range(B)]
            p = [float(logits[n - 1 + j].softmax(-1)[c[j]]) for j in range(B)]
            # a near-tie (|p - τ| tiny) could flip between fp32 paths: assert a margin
            assert all(abs(pj - tau) >= 1e-4 for pj in p[1:]), f"near-tie at prefix {n}: {p} vs {tau}"
            assert top2_gap(logits[n - 1]) > PEAKED_GAP, f"near-tie at prefix {n}"  # c_0
            if c[0] != ref[0]:
                continue
            kept = 1
            while kept < B and p[kept] >= tau:
                kept += 1
            kept = min(kept, len(ref))
            # the accepted candidates are compared with the reply: none may be a near-tie
            assert (top2_gap(logits[n - 1:n - 1 + kept]) > PEAKED_GAP).all(), f"near-tie at prefix {n}"
            out[n % B][0] += 1
            out[n % B][1] += int(c[:kept] != ref[:kept])
    return out


def test_wrong_steps_by_phase_is_the_rule_written_out_on_hf(tmp_path):
    hf = make_hf_model(tmp_path, seed=2, initializer_range=0.6)
    model = Qwen2.from_pretrained(str(tmp_path)).eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in (5, 6, 7, 9, 10, 11):
        prompt = torch.randint(0, 200, (length,), generator=g).tolist()
        with torch.no_grad():  # a reply the model itself would write (c_0 right), then EOS
            reply = hf.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False)[0, length:]
        rows.append((prompt, [t for t in reply.tolist() if t != EOS] + [EOS]))
    problems = [{"messages": [{"role": "user", "ids": p}, {"role": "assistant", "ids": r}]} for p, r in rows]
    for B, tau in ((4, 0.5), (3, 0.3)):
        got = wrong_steps_by_phase(model, IdsTokenizer(), problems, B, tau, batch_size=7)
        want = hf_rule_by_phase(hf, rows, B, tau)
        assert got == want
        assert sum(n for n, _ in want.values()) > 40 and sum(w for _, w in want.values()) > 0


def test_reply_nll_is_hf_teacher_forced_nll(tmp_path):
    """reply_nll's per-row sums (batched, right-padded with EOS) equal -sum log p(reply token |
    its prefix) from one unpadded HF forward per row, every reply token through the first EOS
    after the prompt counted once; float64 on both sides, so the bound is rounding's (1e-9)."""
    hf = make_hf_model(tmp_path, seed=3)
    model = Qwen2.from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    problems, want = [], []
    for plen, rlen in ((3, 4), (6, 1), (2, 9), (5, 5), (4, 2)):  # varied lengths: padding is exercised
        prompt = torch.randint(0, 200, (plen,), generator=g).tolist()
        reply = torch.randint(0, 200, (rlen,), generator=g).tolist() + [EOS]
        tail = [7, EOS]  # after the reply's EOS: not part of the reply, never counted
        problems.append({"messages": [{"role": "user", "ids": prompt},
                                      {"role": "assistant", "ids": reply + tail}]})
        full = torch.tensor([prompt + reply])
        with torch.no_grad(), hf_float64(hf):
            logp = hf(full).logits[0].double().log_softmax(-1)
        want.append([-sum(float(logp[plen - 1 + j, t]) for j, t in enumerate(reply)), len(reply)])
    got = reply_nll(model, IdsTokenizer(), problems, batch_size=3)
    assert [n for _, n in got] == [n for _, n in want]
    for (a, _), (b, _) in zip(got, want):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)
    assert math.isclose(mean_nll(got), sum(s for s, _ in want) / sum(n for _, n in want), rel_tol=1e-9)
    assert mean_nll(got) > 1.0  # a random model: the replies are far from certain
