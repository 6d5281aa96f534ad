"""Manual check (not a test, not counted as CI coverage): exact mode on the TRAINED default
checkpoint equals HF `generate(do_sample=False)` on held-out prompts while using fewer
forwards than tokens. Needs `python train.py` first.

    python -m scripts.check_trained_exact [out/default/mars] [data/default]
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from checkpoint import load_checkpoint
from data.synthetic import read_jsonl
from exact import generate_exact
from util.files import USER_ERRORS, error_line

ckpt = sys.argv[1] if len(sys.argv) > 1 else "out/default/mars"
data = sys.argv[2] if len(sys.argv) > 2 else "data/default"
try:
    ck = load_checkpoint(ckpt)
except USER_ERRORS as e:  # a broken checkpoint: a message, not a traceback
    sys.exit(error_line(e))
tok, model, B = ck.tok, ck.model, ck.block_size or 4
hf = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
problems = read_jsonl(os.path.join(data, "test.jsonl"))[:40]
prompts = [tok.encode_chat(p["messages"][:-1], add_generation_prompt=True) for p in problems]
eos = ck.eos_ids
greedy = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=list(eos), pad_token_id=tok.pad_id)
refs = [hf.generate(torch.tensor([p]), generation_config=greedy)[0, len(p):].tolist() for p in prompts]
ok = True
for K in (2, 4):
    out = generate_exact(model, prompts, block_size=B, drafts=K, max_new_tokens=64, mask_id=ck.mask_id,
                         eos_ids=eos)
    same = sum(r == g.ids for r, g in zip(refs, out))
    tokens, forwards = sum(len(g.ids) for g in out), sum(g.forwards for g in out)
    print(f"K={K}: {same}/{len(prompts)} equal to HF generate; {tokens} tokens in {forwards} forwards "
          f"({tokens / forwards:.2f} tokens/forward)")
    ok &= same == len(prompts) and forwards < tokens
sys.exit(0 if ok else 1)
