"""The tour's subject: a tiny seeded random Qwen2 over a vocabulary of words, and the settings
every section of docs/tour.md shares (block size, τ, drafts, the prompt).

The seed and std were picked so that the first τ step and the exact step each accept one mask
prediction and reject the next; the page's sections (batch.py, step.py) and its assembly
(page.py) read these values, this module computes nothing of the method.
"""

import torch

from model import Qwen2, Qwen2Config, init_weights

# A vocabulary of words, so that the trace reads as text; ids are the list indices.
VOCAB = ["<pad>", "<eos>", "<mask>", "Q:", "A:", "1", "2", "3", "4", "5", "+", "=", "hi", "hello",
         "there", "!"]
ID = {w: i for i, w in enumerate(VOCAB)}
PAD, EOS, MASK = ID["<pad>"], ID["<eos>"], ID["<mask>"]
B = 4  # block size, training and decoding
TAU = 0.8  # the τ of section 2: no probability on the page lies within 1e-3 of it
K = 2  # exact mode's drafts per step (K <= B)
SEED, STD = 139, 0.5  # init seed and std: chosen so that both steps accept one mask prediction
PROMPT = "Q: 2 + 3 ="
MAX_NEW = 8  # new tokens per decoding request
CONFIG = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
              tie_word_embeddings=True)


def tiny_model():
    """A 2-layer Qwen2 over VOCAB, seeded; a large std makes it peaked (argmaxes far from ties)."""
    return init_weights(Qwen2(Qwen2Config(**CONFIG)), std=STD, seed=SEED).to(torch.float64).eval()


def words(ids):
    """Token ids -> their words, space-separated."""
    return " ".join(VOCAB[t] for t in ids)
