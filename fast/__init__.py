"""The engine: what makes the reference fast on a given machine, applied from outside.

The root's model.py, kvcache.py, mars.py and the loops of generate.py and exact.py are the
reference a student steps through. Nothing there knows this package (the arrow runs one way:
fast/ imports the core, never the reverse), and nothing here replaces a name of a core module:
the engine changes the model it is given, its classes and its modules (gpt-fast's quantize.py
does the same), and every other model of the process stays the reference.

For decoding, `make_fast(model)` (generate.py --fast) swaps, in place, in a loaded model.Qwen2:

  linear.py     every nn.Linear -> FastLinear: weights packed once for oneDNN's CPU matmul,
                and in bf16/fp16 the rows of a call in tiles of one fixed size (row invariance)
  attention.py  every Attention -> TiledAttention: over a bf16/fp16 cache, query tiles of one
                size against every slot (row invariance)
  cache.py      FastCache: whole key blocks of slots, read in full in bf16/fp16; static (no
                host sync in a forward) for a compiled step
  step.py       FastQwen2: the model's new_cache, attention mask and greedy pick for the above,
                and its decoding steps through one compiled, fixed-width step (`compile=True`;
                `switch_step` turns it on and off)
  argmax.py     the greedy argmax by block maxima (torch's CPU argmax is not vectorised):
                FastQwen2.argmax, torch.argmax's answer (proven)

Two kinds of decoder run it. The reference's (generate.py, exact.py) run a FastQwen2 as they run
the reference: they call model.hidden, model.new_cache, model.lm_head and the model's greedy pick
(decoding.greedy_pick), and these are what the engine replaces. The engine's own:

  loop.py       AR, the τ window and exact mode with the whole step on the device (issue 49):
                forward, head, pick, the acceptance, EOS/budget cut and cache update in one
                function, compiled whole, the host reading the device once every few steps
                (generate.py --device-loop)
  sample.py     sampling on the device: counter-based uniforms, the inverse CDF, speculative
                acceptance

For training (train.py's engine wiring, in one place; mars.py stays the textbook forward):

  window.py     the two-stream window: the clean stream plain causal, only the noisy blocks the
                loss reads, use_two_stream's attention in two calls (train.py's default, fast_loss)
  train.py      the static MARS step (compile=true): rows and the noisy window bucketed on the
                host, the loss over every output with its target or the ignore index (no
                nonzero, no sync)
  loss.py       linear + cross-entropy, and linear + KL to a teacher, in row chunks: the logits
                never held whole
  flex.py       the two-stream mask as a FlexAttention mask_mod and BlockMask, the attention
                module that runs it (train.py --flex_attention=true: CUDA only, flex has no
                backward on the CPU; not yet run on a GPU)

What it must keep, and where it is proven:
  * in exact arithmetic (float64) every swap computes the reference's numbers: the packed
    matmul, the tiles, the static cache, the compiled step and the device loops give the
    reference decoders' tokens, the block argmax torch.argmax's picks, and the training
    forwards mars.mars_loss's loss and gradients;
  * in bf16 a row's bits do not depend on its batch or its decoder (the tiles), so exact mode
    equals AR bit for bit; the reference makes no such promise.
Decoding: tests/test_engine.py, test_exact.py (*_fast), test_sampling.py (the argmax),
test_bf16.py, test_compile.py, test_compile_bf16.py, test_fast_loop.py, test_device_sampling.py.
Training: tests/test_fast_paths.py, test_fast_train.py, test_fast_loss.py, test_fast_flex.py.
"""

from fast.step import FastQwen2, make_fast, switch_step

__all__ = ["FastQwen2", "make_fast", "switch_step"]
