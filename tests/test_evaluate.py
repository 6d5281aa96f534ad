"""evaluate.wrong_steps_by_phase against the §5 step written out on HF transformers."""

import torch
from conftest import make_hf_model

from evaluate import wrong_steps_by_phase
from model import Qwen2

MASK, EOS = 250, 251


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
            if c[0] != ref[0]:
                continue
            kept = 1
            while kept < B and p[kept] >= tau:
                kept += 1
            kept = min(kept, len(ref))
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
