"""The greedy argmax by block maxima: torch.argmax's answer, faster on the CPU.

torch's CPU argmax kernel is not vectorised, while its max is: for 9 x 49,152 logits (an
exact K = 2 step on SmolLM2) torch.argmax takes 210 µs and `block_argmax` 45 (AMD EPYC, 2
threads; results/SPEED.md). It is the engine model's greedy pick (FastQwen2.argmax, which the
decoders read through decoding.greedy_pick, and the device loops of loop.py), proven equal to
torch.argmax on ties, NaN, infinities and signed zeros (tests/test_sampling.py), so it changes
no token. Nothing of the core is replaced: a reference model keeps sampling.argmax.
"""


def block_argmax(logits, width=128):
    """torch.argmax(logits.float(), -1): the index of the largest entry, the first one on
    ties, NaN counted as the largest (as torch's), whatever the device.

    On the CPU it reads the vocabulary in blocks of `width`: the maximum of each block
    (amax, which keeps NaN), the first block whose maximum is the largest, and the first
    largest inside that block, which is the first largest of all."""
    x = logits.float()
    V = x.shape[-1]
    if x.device.type != "cpu" or V % width or x.numel() == 0:  # on a GPU argmax is fast
        return x.argmax(-1)
    blocks = x.unflatten(-1, (V // width, width))  # (..., V/width, width)
    first = blocks.amax(-1).argmax(-1, keepdim=True)  # (..., 1): the block of the first largest
    inside = blocks.gather(-2, first[..., None].expand(*first.shape, width))[..., 0, :]  # (..., width)
    return first[..., 0] * width + inside.argmax(-1)
