"""Reference distributions and the chi-square test for the sampling proofs (issue 13).

Not collected by pytest (no test_ prefix); imported by tests/test_sampling.py and by the
decoder distribution tests of phase 2. It knows no decoder: a decoder's samples come in
as a (N, L) tensor of token ids, and the exact AR distribution they must follow is
enumerated here from a model's next-token logits. It shares no code with sampling.py: the
processed distribution is Hugging Face's own warpers (hf_probs), so a wrong
sampling.processed_probs cannot make its own reference.

  critical_value(df)                 the 0.999 chi-square quantile (scipy)
  chi_square(counts, probs)          the statistic and its degrees of freedom
  histogram(seqs, V)                 counts of each length-L sequence, shape (V,)*L
  hf_probs(logits, s)                HF's temperature -> top-k -> top-p warpers, then softmax
  ar_distribution(next_logits, prompt, L, V, s)   exact P(x_1..x_L | prompt) under
                                     sampling settings s, and its top-p margin
  hf_next_logits(hf)                 next_logits for a transformers causal LM
  tiny_hf_model(path)                a random HF Qwen2 with an 8-token vocabulary

A decoder under test provides only: draw(prompt, n_rows, L) -> LongTensor (n_rows, L),
the first L generated tokens of n_rows independent samples (no EOS ids, so every row
generates L tokens).
"""

import itertools
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from scipy.stats import chi2
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


# ---------------------------------------------------------------- the test
def critical_value(df, level=0.999):
    """The `level` quantile of chi-square with df degrees of freedom (scipy.stats.chi2)."""
    if df < 1:
        raise ValueError(f"a chi-square test needs >= 2 cells, got df = {df}")
    return float(chi2.ppf(level, df))


def chi_square(counts, probs, min_expected=5.0):
    """Pearson's statistic of observed counts against cell probabilities (same shape).
    Cells of probability 0 are not cells: a count in one is impossible, so the statistic
    is infinite. Cells expecting fewer than `min_expected` counts are pooled into one (the
    usual validity rule of the chi-square approximation). -> (statistic, degrees of freedom)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    live = probs > 0
    if counts[~live].sum() > 0:
        return math.inf, int(live.sum()) - 1
    expected = counts.sum() * probs[live] / probs[live].sum()
    counts, small = counts[live], expected < min_expected
    if small.sum() > 1:  # pool the small cells
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1


def histogram(seqs, V):
    """seqs (N, L) of ids < V -> counts (V,)*L of each sequence."""
    N, L = seqs.shape
    flat = (seqs.long() * V ** torch.arange(L - 1, -1, -1, device=seqs.device)).sum(1)
    return torch.bincount(flat.cpu(), minlength=V ** L).reshape((V,) * L)


# ---------------------------------------------------------------- the exact AR distribution
def hf_probs(logits, s):
    """Sampling settings s (temperature, top_k, top_p) applied by HF's warpers in generate()'s
    order (utils.py _get_logits_processor), then softmax: float32 (..., V). Temperature 0 (no
    HF warper) is the greedy rule as a distribution: the one-hot of the argmax."""
    x = logits.float()
    if s.temperature == 0:
        return F.one_hot(x.argmax(-1), x.shape[-1]).float()
    if s.temperature != 1.0:
        x = TemperatureLogitsWarper(float(s.temperature))(None, x)
    if s.top_k:
        x = TopKLogitsWarper(s.top_k)(None, x)
    if s.top_p < 1.0:
        x = TopPLogitsWarper(s.top_p)(None, x)
    return x.softmax(-1)


@torch.no_grad()
def ar_distribution(next_logits, prompt, L, V, s):
    """Exact distribution of the first L sampled tokens after `prompt`: (V,)*L float64,
    P(x) = prod_t hf_probs(next_logits(prompt + x_<t), s)[x_t], every prefix
    enumerated (V^0 + .. + V^(L-1) forwards, in one batch per length).

    Also -> the top-p margin: the smallest |cumulative mass - (1 - top_p)| met by the
    top-p cut at any prefix (inf when top-p is off). A decoder's logits differ from the
    reference's in float rounding; with a margin far above that, the same tokens are cut
    and the zero cells really are zero (the tests assert it)."""
    probs, margin = torch.ones(()), math.inf
    for t in range(L):
        prefixes = [list(prompt) + list(x) for x in itertools.product(range(V), repeat=t)]
        logits = next_logits(torch.tensor(prefixes)).float()  # (V^t, V)
        margin = min(margin, top_p_margin(logits, s))
        step = hf_probs(logits, s).double().reshape((V,) * t + (V,))
        probs = probs[..., None] * step
    return probs, margin


def top_p_margin(logits, s):
    """Distance of the top-p cut from a tie: min |cumsum of ascending probs - (1 - top_p)|."""
    if s.top_p >= 1.0 or s.temperature == 0:
        return math.inf
    kept = hf_probs(logits, SimpleNamespace(temperature=s.temperature, top_k=s.top_k, top_p=1.0))
    cum = kept.sort(-1).values.cumsum(-1)  # the cumulative mass the top-p warper compares
    return float((cum - (1 - s.top_p)).abs().min())


def hf_next_logits(hf):
    """next_logits(prefixes (M, T)) -> (M, V) for a transformers causal LM, fp32."""
    return lambda ids: hf(input_ids=ids).logits[:, -1].float()


def tiny_hf_model(path=None, seed=0, vocab_size=8):
    """A random HF Qwen2 (eager, fp32) with an 8-token vocabulary, saved to `path` if
    given. initializer_range 0.05 keeps the distributions spread (every 3-token cell has
    expected count >= a few at 20,000 samples), unlike conftest's peaked greedy model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, initializer_range=0.05, attn_implementation="eager")
    hf = Qwen2ForCausalLM(cfg).eval()
    if path is not None:
        hf.save_pretrained(str(path))
    return hf
