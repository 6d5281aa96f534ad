"""The FLOPs of a training step, and MFU: what a step does, against what the hardware could.

Model FLOPs, as nanoGPT's estimate_mfu and the PaLM paper count them: 2 per multiply-add of
every matmul of the forward (the linears, the LM head on the rows it runs on, attention's
QK^T and PV over the (query, key) pairs it computes), times 3 for forward + backward.
Recomputation (gradient checkpointing, fast/loss.py's chunked head) is work the hardware does
but not model FLOPs: it lowers MFU, as it should. tests/test_flops.py checks the count against
torch.utils.flop_counter on tiny models.
"""


def linear_flops_per_token(cfg):
    """Forward FLOPs of one token through every layer's linears (q, k, v, o, gate, up, down)."""
    C, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return 2 * cfg.num_hidden_layers * (C * q + 2 * C * kv + q * C + 3 * C * I)


def step_flops(cfg, tokens, head_rows, attn_pairs):
    """Model FLOPs of one forward + backward: `tokens` through the layers, `head_rows` through
    the LM head, `attn_pairs` (query, key) pairs per layer and head summed over the batch."""
    forward = (tokens * linear_flops_per_token(cfg) + head_rows * 2 * cfg.hidden_size * cfg.vocab_size
               + attn_pairs * 4 * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers)
    return 3 * forward


def mars_step_flops(cfg, rows, l, W, targets, w_ar=1.0):
    """fast.window.mars_loss_windowed (train.py's default MARS loss) on `rows` rows of l tokens
    with a noisy window of W (fast.window.noisy_window; W = l with trim=False): l + W
    tokens a row, attention computed densely in two calls (clean l x l, noisy W x (l + W)), the
    head on each loss target once per stream (once if w_ar = 0)."""
    return step_flops(cfg, rows * (l + W), targets * (2 if w_ar else 1), rows * (l * l + W * (l + W)))


def ar_step_flops(cfg, rows, l, targets):
    """mars.ar_loss on `rows` rows of l tokens: causal attention computed densely (l x l)."""
    return step_flops(cfg, rows * l, targets, rows * l * l)


def mfu(flops, seconds, peak_flops):
    """The share of the hardware's peak (FLOP/s) that `flops` done in `seconds` is."""
    return flops / seconds / peak_flops
