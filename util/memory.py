"""Peak training memory of one process, estimated from the config (docs/spec.md §7).

train.py prints this before training on CUDA (and checks it against `gpu_mem_gb`), so a
user learns before the first step whether Qwen2.5-0.5B fits a 24 GB card: MARS doubles
the sequence ([clean | noisy], §3), which the paper reports as about 1.5x AR SFT's peak.
The formula is by part and on the high side; `memory_parts` documents each term.
`needs_checkpointing` is train.py's rule: checkpoint only when the estimate says it is needed.
"""

CHUNK = 1024  # the rows of logits fast/loss.py's chunked head holds at once (linear_cross_entropy's default)


def memory_parts(cfg, S, world=1, static=False):
    """Peak memory of one training process by part, in bytes: an estimate, on the high side.

    P = parameters (a tied matrix once), s = world under FSDP else 1, b = micro_batch_size,
    l = max_len rounded up to B, T = 2l tokens per row (MARS: two streams, the peak),
    h, kv = n_kv_heads * head_dim, i (MLP), L (layers), V (vocab):
      weights, grads  4P/s each    fp32 master weights (what AdamW updates) and gradients
      adamw           8P/s         exp_avg + exp_avg_sq, fp32
      lowp            2P           bf16 weight copies made by autocast (none in fp32); under
                                   FSDP the gathered bf16 root (embeddings, head) + 2 layers
      acts            b*T*L*a      saved for backward, a = 32h + 4kv + 8i bytes per token and
                                   layer in bf16 (fp32 residual into two norms: 16h; q, k before
                                   and after RoPE, GQA-expanded k and v, attention output: 14h +
                                   4kv; qkv and MLP inputs: 4h; gate, up, silu, product: 8i), 2a
                                   in fp32. With checkpointing b*T*(L*4h + a): each layer's
                                   fp32 input, plus one layer recomputed
      logits          b*l*V*(4k+6) the LM head runs on the <= b*l loss targets only (mars);
                                   k = 2 CE streams (1 if w_ar = 0) keep fp32 log-probs, plus
                                   one stream's fp32 and bf16 gradient. With `static` (the
                                   static step of compile=true, fast/loss.py's chunked head):
                                   12*chunk*V + 4*V*h, one chunk's bf16 logits, fp32 softmax
                                   and gradient and bf16 gradient in the backward, and the
                                   head's fp32 weight gradient before it joins the grads; 24*
                                   chunk*V with the teacher (the KL's backward holds the
                                   softmax, the target t and their difference besides)
      cuda            1 GiB        CUDA context, allocator slack
    """
    h, kv, i = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    L, V = cfg.num_hidden_layers, cfg.vocab_size
    root = V * h * (1 if cfg.tie_word_embeddings else 2) + h
    layer = 2 * h * (h + kv) + (h + 2 * kv) + 3 * h * i + 2 * h
    P, s, bf16 = root + L * layer, world if S.fsdp else 1, S.dtype != "float32"
    b, l = S.micro_batch_size, -(-S.max_len // S.block_size) * S.block_size
    a = (32 * h + 4 * kv + 8 * i) * (1 if bf16 else 2)
    chunked = (24 if S.ar_target == "teacher" else 12) * min(CHUNK, b * 2 * l) * V + 4 * V * h
    return {"weights": 4 * P // s, "grads": 4 * P // s, "adamw": 8 * P // s,
            "lowp": 2 * bf16 * (root + 2 * layer if S.fsdp and world > 1 else P),
            "acts": b * 2 * l * ((L * 4 * h + a) if S.gradient_checkpointing else L * a),
            "logits": chunked if static else b * l * V * (4 * (2 if S.w_ar > 0 else 1) + 6), "cuda": 2**30}


def estimate_memory(cfg, S, world=1, static=False):
    """Estimated peak bytes of one training process (the sum of memory_parts)."""
    return sum(memory_parts(cfg, S, world, static).values())


def needs_checkpointing(cfg, S, world=1, static=False):
    """Whether train.py turns gradient checkpointing on by itself: with gpu_mem_gb > 0, when the
    estimate without it exceeds gpu_mem_gb. The estimate is on the high side, so a run it lets
    through without checkpointing fits; checkpointing costs a second forward of every layer."""
    if S.gpu_mem_gb <= 0 or S.gradient_checkpointing:
        return False
    return estimate_memory(cfg, S, world, static) > S.gpu_mem_gb * 2**30
