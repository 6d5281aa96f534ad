"""The engine: what makes the reference fast on a given machine, applied from outside.

The root's model.py, kvcache.py and the loops of generate.py and exact.py are the reference a
student steps through. Nothing there knows this package (the arrow runs one way: fast/
imports the core, never the reverse). `make_fast(model)` takes a loaded model.Qwen2 and, in
place, swaps in what computes the same thing faster (gpt-fast's quantize.py does the same
with its modules):

  linear.py     every nn.Linear -> FastLinear: weights packed once for oneDNN's CPU matmul,
                and in bf16/fp16 the rows of a call in tiles of one fixed size (row invariance)
  attention.py  every Attention -> TiledAttention: over a bf16/fp16 cache, query tiles of one
                size against every slot (row invariance)
  cache.py      FastCache: whole key blocks of slots, read in full in bf16/fp16; static (no
                host sync in a forward) for a compiled step
  step.py       FastQwen2: the model's new_cache and attention mask for the above, and its
                decoding steps through one compiled, fixed-width step (`compile=True`)
  argmax.py     the greedy argmax by block maxima (torch's CPU argmax is not vectorised); installed
                as sampling.argmax for the whole process (the same answer: proven)

  loop.py       AR, the τ window and exact mode with the whole step on the device (issue 49):
                forward, head, pick, the acceptance, EOS/budget cut and cache update in one
                function, compiled whole, the host reading the device once every few steps
                (generate.py --device-loop)
  sample.py     sampling on the device: counter-based uniforms, the inverse CDF, speculative
                acceptance

For training (issue 50; train.py uses fast.train under compile=true):

  train.py      the static MARS step: rows and the noisy window bucketed on the host, the loss
                over every output with its target or the ignore index (no nonzero, no sync)
  loss.py       linear + cross-entropy, and linear + KL to a teacher, in row chunks: the logits
                never held whole
  flex.py       the two-stream mask as a FlexAttention mask_mod and BlockMask, the attention
                module that runs it (train.py --flex_attention=true: CUDA only, flex has no
                backward on the CPU; not yet run on a GPU)

The decoders are the reference's (generate.py, exact.py): they call model.hidden, model.new_cache
and sampling.argmax, and these are what the engine replaces. What it must keep, and where it
is proven (tests/test_engine.py, test_bf16.py, test_compile.py, test_compile_bf16.py):
  * in exact arithmetic (float64) every swap computes the reference's numbers: the packed
    matmul, the tiles, the static cache and the compiled step give the reference's tokens;
  * in bf16 a row's bits do not depend on its batch or its decoder (the tiles), so exact mode
    equals AR bit for bit; the reference makes no such promise.
"""

from fast.step import FastQwen2, make_fast

__all__ = ["FastQwen2", "make_fast"]
