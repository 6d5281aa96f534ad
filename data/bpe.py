"""A byte-level BPE trainer of the Qwen2 kind, for the default data's tiny tokenizer (data/synthetic.py).

What it holds: `train_bpe`, which learns merges on pre-tokenised text (Qwen2's regex, NFC)
the way HF's BPE applies them later, and lays out ids as Qwen2.5 does: the 256 bytes, one
token per merge, Qwen2.5's 22 added tokens, then `<|mask|>` (docs/spec.md §2) derived by
tokenizer.py. The files its Tokenizer saves load in `transformers` with the same ids.

What it leaves to others: loading, encoding and saving (tokenizer.py), the chat template
(chat_template.py), the data it is trained on (data/synthetic.py).
"""

import unicodedata
from collections import Counter, defaultdict
from heapq import heapify, heappop, heappush
from itertools import pairwise

import regex  # installed with tiktoken (which needs it); stdlib `re` has no \p{L}

from chat_template import QWEN25_CHAT_TEMPLATE
from tokenizer import QWEN2_PATTERN, Tokenizer

# Qwen2.5's 22 added tokens, ids 151643..151664 in this order. The first 14 are "special"
# (skipped by decode(skip_special_tokens=True) in HF); the last 8 are plain added tokens.
QWEN25_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN25_N_SPECIAL = 14


def _count_words(texts, added_tokens) -> Counter:
    """Pre-tokenised chunks (Qwen2's regex, NFC) and their counts; added tokens are never learned."""
    split_added = regex.compile("(" + "|".join(map(regex.escape, added_tokens)) + ")")
    pretokenize = regex.compile(QWEN2_PATTERN)
    counts = Counter()
    for text in texts:
        for piece in split_added.split(text)[::2]:
            counts.update(pretokenize.findall(unicodedata.normalize("NFC", piece)))
    return counts


def _merge_word(old, a, b, new):
    """Replace every (a, b) in `old` by `new`, left to right, non-overlapping (as HF's merge does)."""
    merged, i = [], 0
    while i < len(old):
        if i + 1 < len(old) and old[i] == a and old[i + 1] == b:
            merged.append(new)
            i += 2
        else:
            merged.append(old[i])
            i += 1
    return merged


def _learn_merges(counts: Counter, n_merges: int) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """(tokens in id order: the 256 bytes, then one per merge; the merges, in order). Each step
    merges the most frequent adjacent pair of the words, weighted by their counts."""
    words = [list(w.encode()) for w in counts]  # each word as a list of token ids
    freq = list(counts.values())
    pair_count = Counter()
    where = defaultdict(set)  # pair -> words that (may) contain it
    for w, (word, f) in enumerate(zip(words, freq)):
        for pair in pairwise(word):
            pair_count[pair] += f
            where[pair].add(w)
    heap = [(-c, pair) for pair, c in pair_count.items()]  # lazily updated max-heap
    heapify(heap)
    token, merges = [bytes([b]) for b in range(256)], []
    while len(merges) < n_merges and heap:
        c, pair = heappop(heap)
        if -c != pair_count[pair] or c == 0:
            continue  # stale entry
        a, b = pair
        token.append(token[a] + token[b])
        merges.append((token[a], token[b]))
        touched = set()
        for w in where.pop(pair):
            old, f = words[w], freq[w]
            words[w] = _merge_word(old, a, b, len(token) - 1)
            for p in pairwise(old):
                pair_count[p] -= f
                touched.add(p)
            for p in pairwise(words[w]):
                pair_count[p] += f
                where[p].add(w)
                touched.add(p)
        for p in touched:
            if pair_count[p] > 0:
                heappush(heap, (-pair_count[p], p))
    return token, merges


def train_bpe(texts, n_merges: int, added_tokens=QWEN25_ADDED_TOKENS,
              chat_template: str = QWEN25_CHAT_TEMPLATE) -> Tokenizer:
    """Train a byte-level BPE with Qwen2's pre-tokenizer (for the tiny default model).

    Ids: the 256 bytes (in byte order), then one token per merge, then `added_tokens`
    (Qwen2.5's 22, in Qwen2.5's order), then `<|mask|>`. Each step merges the most frequent
    adjacent pair (ties: smallest ids), everywhere, left to right, exactly as HF's BPE will
    apply it later; this is what makes the saved files give the same ids in HF. Training
    stops early once every word is a single token. `chat_template` is what save() writes:
    give the one whose default system turn the training data uses (`chatml_template`).
    """
    token, merges = _learn_merges(_count_words(texts, added_tokens), n_merges)
    vocab = {t: i for i, t in enumerate(token)}
    added = {len(token) + n: {"content": name, "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False,
                              "special": name not in QWEN25_ADDED_TOKENS[QWEN25_N_SPECIAL:]}
             for n, name in enumerate(added_tokens)}
    return Tokenizer(vocab, merges, added, source="train_bpe", chat_template=chat_template)
