"""util/flops.py counts what torch counts: the model FLOPs of an AR and a MARS training step
(forward + backward) equal torch.utils.flop_counter's count of the same step on tiny models
(Qwen2 with GQA, Llama without biases; several lengths, windows and w_ar), so the MFU the
benchmarks print rests on the step's own matmuls, not on a guess."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fast.window import mars_loss_windowed, noisy_window, use_two_stream
from mars import IGNORE, ar_loss
from model import Qwen2, Qwen2Config, init_weights
from util.flops import ar_step_flops, mars_step_flops


def counted(fn):
    """torch's count of fn()'s forward and backward. Attention runs as sdpa's math path (plain
    matmuls), which the counter counts on the CPU too (it has no formula for the CPU's flash op)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as m:
        fn().backward()
    return m.get_total_flops()


def batch(N, l, prompt, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 2, (N, l), generator=g)
    labels = ids.clone()
    labels[:, :prompt] = IGNORE
    labels[1, l - 4:] = IGNORE  # a shorter reply in row 1
    return ids, labels


@pytest.mark.parametrize("bias,n_kv", [(True, 2), (False, 4)])
@pytest.mark.parametrize("l,prompt,w_ar", [(16, 5, 1.0), (24, 9, 1.0), (24, 9, 0.0)])
def test_the_formula_counts_what_the_flop_counter_counts(bias, n_kv, l, prompt, w_ar):
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_kv, attention_bias=bias)
    model = init_weights(Qwen2(cfg), seed=0)
    ids, labels = batch(3, l, prompt, cfg.vocab_size)
    targets = int((labels[:, 1:] != IGNORE).sum())
    _, W = noisy_window(labels, 4)
    assert W < l  # the window is trimmed: the count follows it
    assert counted(lambda: mars_loss_windowed(use_two_stream(model), ids, labels, 46, 4, w_ar)[0]) == \
        mars_step_flops(cfg, 3, l, W, targets, w_ar)
    assert counted(lambda: ar_loss(model, ids, labels)) == ar_step_flops(cfg, 3, l, targets)
