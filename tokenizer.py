"""Qwen2 / Qwen2.5 tokenizer on tiktoken, the ChatML template, and MARS's loss span.

What it is: the byte-level BPE of Qwen2.5 (GPT-2 byte alphabet, Qwen2's
pre-tokenizer regex, NFC normalisation, added tokens matched inside text),
read from a checkpoint's `vocab.json` + `merges.txt` + added tokens and run by
tiktoken. It gives the same ids as `transformers`' Qwen2Tokenizer without
importing it. It also trains a tiny tokenizer of the same kind (`train_bpe`)
for the project's miniature model, and saves files that `transformers` loads.

How it maps to MARS (../shared/MARS_SPEC.md):
- §2 `[MASK]` is a new token `<|mask|>` = the first id after the highest id the
  checkpoint knows (151665 for Qwen2.5, whose last added token is
  `<|file_sep|>` 151664). It is never parsed from text: the training and
  decoding code writes `tok.mask_id` directly.
- §2 rows are ChatML conversations (`render_chat`, `Tokenizer.encode_chat`);
  the loss covers only the last assistant turn's content, its `<|im_end|>` and
  the `\\n` after it (`Tokenizer.encode_chat_with_loss_mask`).
- §2/§5 EOS is `<|im_end|>` (`tok.eos_id`); the pad token is `<|endoftext|>`.

Why tiktoken reproduces Hugging Face's BPE: HF merges the adjacent pair whose
*merge line* in merges.txt comes first; tiktoken merges the adjacent pair whose
*concatenation* has the lowest rank, and returns a chunk that is itself a token
at once. These agree when (1) a token's rank is the line of the merge that
builds it, and (2) tiktoken only knows tokens that HF's merges build from the
token's own bytes (`_live_merges`). Trained vocabularies pass (2) for every
token; a converted or hand-edited one may not, and we keep such tokens for
decoding only, so that HF and we both spell them out in pieces.
"""

import json
import unicodedata
from collections import Counter, defaultdict
from heapq import heapify, heappop, heappush
from itertools import pairwise
from pathlib import Path

import regex  # installed with tiktoken (which needs it); stdlib `re` has no \p{L}
import tiktoken

# Qwen2's pre-tokenizer: contractions, letter runs (one leading non-letter), single digits
# (so numbers are spelled digit by digit), punctuation runs, newlines, other whitespace.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

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
MASK_TOKEN = "<|mask|>"
DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct's chat template, written into tokenizer_config.json by save() so that
# transformers' apply_chat_template works on our files. render_chat() is its non-tool branch.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501, RUF100


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, used to spell bytes in vocab.json/merges.txt.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
    0x7F-0xA0, 0xAD) are shifted to chr(256 + n) so every token is visible text.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    shifted = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + n) for n, b in enumerate(shifted)}


BYTE_TO_CHAR = bytes_to_unicode()


# str.translate tables: GPT-2 characters <-> Latin-1 characters (= bytes); a character outside
# the alphabet becomes U+FFFF, which then fails to encode as Latin-1.
_TO_LATIN1 = str.maketrans({chr(b): "\uffff" for b in range(256)}
                           | {c: chr(b) for b, c in BYTE_TO_CHAR.items()})
_FROM_LATIN1 = str.maketrans({chr(b): c for b, c in BYTE_TO_CHAR.items()})


def _to_str(token: bytes) -> str:
    return token.decode("latin-1").translate(_FROM_LATIN1)


def _to_bytes(name: str, where) -> bytes:
    try:
        return name.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: {name!r} is not spelled in GPT-2's byte alphabet") from None


def _live_merges(merges: list[tuple[bytes, bytes]]) -> dict[bytes, tuple[int, bytes, bytes]]:
    """For every token HF's BPE can build from its own bytes: (line, left, right) of the merge
    that builds it (a token's *live* merge). Other lines of merges.txt are never applied by HF.

    HF's BPE on a chunk merges, again and again, the adjacent pair listed first (leftmost on
    ties). Reading merges.txt in order (every trainer and converter writes a line after the
    lines that build its two parts), line j "l r" is live iff l and r can be built, l + r was
    not built by an earlier line, and on the way from bytes(l + r) to [l, r] no pair across the
    l|r boundary gets merged first (`crosses`). Checking that walks only the right edge of l
    and the left edge of r, so it stays fast for a 150k-token vocabulary.
    """
    line = {pair: j for j, pair in enumerate(merges)}  # HF keeps the last of repeated lines
    live = {bytes([b]): (-1, b"", b"") for b in range(256)}  # bytes exist from the start

    def crosses(left, right):
        # Walk back in time along the right edge of `left` and the left edge of `right`,
        # undoing whichever edge token formed last; each (a, b) met was adjacent until
        # a_end / b_end. Was its merge applied in that window? (On a tie, leftmost first.)
        a, b, a_end, b_end = left, right, len(line), len(line)
        while len(a) > 1 or len(b) > 1:
            if live[a][0] > live[b][0]:
                a_end, a = live[a][0], live[a][2]
            else:
                b_end, b = live[b][0], live[b][1]
            j = line.get((a, b))
            if j is not None and j < a_end and j <= b_end:
                return True
        return False

    early = []  # lines met before one of their parts was built
    for n, (left, right) in enumerate(merges):
        token = left + right
        if left not in live or right not in live:
            early.append((n, left if left not in live else right))
        elif token not in live and not crosses(left, right):
            live[token] = (line[left, right], left, right)
    for n, part in early:  # fine if the part is never built (the line is dead), else not
        if part in live:
            raise ValueError(f"merge #{n + 1} uses {part!r}, which only a later merge builds "
                             "(HF's order is then not a rank that tiktoken can express)")
    return live


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Qwen2.5-Instruct's ChatML template (no tools) as plain Python."""
    messages = list(messages)
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": DEFAULT_SYSTEM_PROMPT})
    for m in messages:
        if m["role"] not in ("system", "user", "assistant") or m.get("tool_calls"):
            raise ValueError(f"render_chat: role {m['role']!r} / tool calls are not supported")
        if not isinstance(m["content"], str):
            raise TypeError(f"render_chat: a {m['role']} message's content is not a string")
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Tokenizer:
    """A Qwen2-style tokenizer. Build it with `Tokenizer.from_dir` or `train_bpe`."""

    render_chat = staticmethod(render_chat)

    def __init__(
        self,
        vocab: dict[bytes, int],
        merges: list[tuple[bytes, bytes]],
        added_tokens: dict[int, dict],
        source: str = "<memory>",
    ):
        # vocab: the BPE tokens (bytes -> id); merges: merges.txt in order; added_tokens: id ->
        # HF's record {"content", "special", ...}, kept as read so save() writes it back.
        self.vocab, self.merges, self.added_tokens = dict(vocab), list(merges), dict(added_tokens)
        self.added_ids = {rec["content"]: i for i, rec in self.added_tokens.items()}
        for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            if name not in self.added_ids:
                raise ValueError(f"{source}: added token {name} is missing (a Qwen2.5 tokenizer)")
        self.endoftext_id = self.added_ids["<|endoftext|>"]
        self.pad_id = self.endoftext_id  # Qwen2.5 pads with <|endoftext|>
        self.im_start_id = self.added_ids["<|im_start|>"]
        self.eos_id = self.added_ids["<|im_end|>"]  # end of an assistant turn (MARS §2, §5)
        existing = [*self.vocab.values(), *self.added_tokens]
        self.mask_id = self.added_ids.get(MASK_TOKEN, max(existing) + 1)
        self.vocab_size = max(*existing, self.mask_id) + 1  # rows an embedding table needs

        # Every id decodes through one table; added tokens (and <|mask|>) to their text.
        self._id_to_bytes = {i: t for t, i in self.vocab.items()}
        self._id_to_bytes |= {i: rec["content"].encode() for i, rec in self.added_tokens.items()}
        self._id_to_bytes.setdefault(self.mask_id, MASK_TOKEN.encode())

        # Tiktoken ranks: the line of each buildable token's live merge (see the docstring).
        try:
            live = _live_merges(self.merges)
        except ValueError as e:
            raise ValueError(f"{source}/merges.txt: {e}") from None
        by_line = sorted((t for t in live if len(t) > 1), key=lambda t: live[t][0])
        multi_ids = [self.vocab[t] for t in by_line]
        if all(a < b for a, b in pairwise(multi_ids)):
            # Usual case (Qwen2.5, train_bpe, HF's trainer): ids already follow merge order.
            ranks = {t: self.vocab[t] for t in by_line}
            ranks |= {bytes([b]): self.vocab[bytes([b])] for b in range(256)}
            self._rank_to_id = None
        else:
            ranks = {bytes([b]): b for b in range(256)}
            ranks |= {t: 256 + n for n, t in enumerate(by_line)}
            self._rank_to_id = [self.vocab[t] for t in ranks]
        self._enc = tiktoken.Encoding("qwen2", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={})
        # Added tokens are found in raw text before normalisation, longest first (as HF does).
        names = sorted(self.added_ids, key=len, reverse=True)
        self._added_re = regex.compile("(" + "|".join(map(regex.escape, names)) + ")")

    # ---- loading and saving ----

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Read vocab.json, merges.txt and the added tokens (tokenizer_config.json's
        `added_tokens_decoder` and/or tokenizer.json's `added_tokens`)."""
        path = Path(path)
        vocab_file, merges_file = path / "vocab.json", path / "merges.txt"
        for f in (vocab_file, merges_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing (a Qwen2 tokenizer needs vocab.json and "
                                        "merges.txt)")

        added = {}  # id -> record
        config_file, fast_file = path / "tokenizer_config.json", path / "tokenizer.json"
        records = []
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            records += [(config_file, int(i), rec)
                        for i, rec in config.get("added_tokens_decoder", {}).items()]
        if fast_file.is_file():
            fast = json.loads(fast_file.read_text(encoding="utf-8")).get("added_tokens", [])
            records += [(fast_file, rec["id"], rec) for rec in fast]
        for f, i, rec in records:
            if any(rec.get(flag) for flag in ("lstrip", "rstrip", "single_word")):
                raise ValueError(f"{f}: added token {rec['content']!r} sets lstrip, rstrip or "
                                 "single_word, which this tokenizer does not implement")
            if i in added and added[i]["content"] != rec["content"]:
                raise ValueError(f"{f}: id {i} is {rec['content']!r}, elsewhere "
                                 f"{added[i]['content']!r}")
            rec = {k: rec[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word",
                                       "special") if k in rec}
            added.setdefault(i, rec)
        added_names = {rec["content"]: i for i, rec in added.items()}

        vocab = {}
        for name, i in json.loads(vocab_file.read_text(encoding="utf-8")).items():
            if name in added_names:  # some files list added tokens in vocab.json too
                if added_names[name] != i:
                    raise ValueError(f"{vocab_file}: {name!r} has id {i}, but {added_names[name]} "
                                     "as an added token")
                continue
            vocab[_to_bytes(name, f"{vocab_file}: entry")] = i
        missing = [b for b in range(256) if bytes([b]) not in vocab]
        if missing:
            raise ValueError(f"{vocab_file}: no token for byte(s) {missing[:8]} (byte-level BPE)")

        merges = []
        lines = merges_file.read_text(encoding="utf-8").split("\n")
        for n, line in enumerate(lines, 1):
            if line.startswith("#version") or (not line and n == len(lines)):
                continue
            pair = line.split(" ")
            if len(pair) != 2 or not all(pair):
                raise ValueError(f"{merges_file}: line {n} {line!r} is not two tokens")
            a, b = (_to_bytes(p, f"{merges_file}: line {n}") for p in pair)
            if a not in vocab or b not in vocab or a + b not in vocab:
                raise ValueError(f"{merges_file}: line {n} {line!r} uses a token not in vocab.json")
            merges.append((a, b))
        return cls(vocab, merges, added, source=str(path))

    def save(self, path) -> None:
        """Write vocab.json, merges.txt and tokenizer_config.json (Qwen2Tokenizer, the added
        tokens as read, Qwen2.5-Instruct's chat template). `<|mask|>` is not written: it is
        derived again on load, and a checkpoint's files stay exactly as Qwen ships them."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        vocab = {_to_str(t): i for t, i in sorted(self.vocab.items(), key=lambda kv: kv[1])}
        (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        merges = "".join(f"{_to_str(a)} {_to_str(b)}\n" for a, b in self.merges)
        (path / "merges.txt").write_text("#version: 0.2\n" + merges, encoding="utf-8")
        config = {
            "add_prefix_space": False,
            "added_tokens_decoder": {str(i): rec for i, rec in sorted(self.added_tokens.items())},
            "bos_token": None,
            "chat_template": QWEN25_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        config = json.dumps(config, indent=2, ensure_ascii=False)
        (path / "tokenizer_config.json").write_text(config, encoding="utf-8")

    # ---- text <-> ids ----

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> ids. Added tokens written in the text become their ids (HF's default);
        with allow_special=False they are spelled as ordinary text."""
        pieces = self._added_re.split(text) if allow_special else [text]
        ids = []
        for n, piece in enumerate(pieces):
            if n % 2:  # the split's captured group: an added token
                ids.append(self.added_ids[piece])
            elif piece:
                ranks = self._enc.encode_ordinary(unicodedata.normalize("NFC", piece))
                ids += ranks if self._rank_to_id is None else [self._rank_to_id[r] for r in ranks]
        return ids

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self._id_to_bytes[int(i)] for i in ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ---- ChatML (MARS §2) ----

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """Ids of the templated conversation; equals HF's apply_chat_template(tokenize=True)."""
        return self.encode(render_chat(messages, add_generation_prompt))

    def encode_chat_with_loss_mask(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """Ids of the templated conversation and, per id, whether it carries loss (MARS §2):
        the last assistant turn's content, its `<|im_end|>` and the `\\n` after it.

        The whole string is tokenised at once (as HF does) and the span found by byte offsets:
        tokenising prompt and answer apart can differ, e.g. "assistant\\n" + "\\nHi" makes one
        "\\n\\n" token. A token that straddles the start of the answer carries loss.
        """
        last = max((n for n, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ValueError("encode_chat_with_loss_mask: the conversation has no assistant turn")
        text = render_chat(messages)
        start = len(render_chat(messages[:last], add_generation_prompt=True))
        end = start + len(messages[last]["content"] + "<|im_end|>\n")
        ids = self.encode(text)
        # Byte offsets in the (normalised) token stream; the cuts sit next to "\n" or an added
        # token, so NFC cannot move text across them.
        lo = len(self.decode_bytes(self.encode(text[:start])))
        hi = len(self.decode_bytes(ids)) - len(self.decode_bytes(self.encode(text[end:])))
        mask, pos = [], 0
        for i in ids:
            n = len(self._id_to_bytes[i])
            mask.append(pos + n > lo and pos < hi)
            pos += n
        return ids, mask


def train_bpe(texts, n_merges: int, added_tokens=QWEN25_ADDED_TOKENS) -> Tokenizer:
    """Train a byte-level BPE with Qwen2's pre-tokenizer (for the tiny default model).

    Ids: the 256 bytes (in byte order), then one token per merge, then `added_tokens`
    (Qwen2.5's 22, in Qwen2.5's order), then `<|mask|>`. Each step merges the most frequent
    adjacent pair (ties: smallest ids), everywhere, left to right, exactly as HF's BPE will
    apply it later; this is what makes the saved files give the same ids in HF. Training
    stops early once every word is a single token.
    """
    split_added = regex.compile("(" + "|".join(map(regex.escape, added_tokens)) + ")")
    pretokenize = regex.compile(QWEN2_PATTERN)
    counts = Counter()
    for text in texts:  # words = pre-tokenised chunks; added tokens are never learned
        for piece in split_added.split(text)[::2]:
            counts.update(pretokenize.findall(unicodedata.normalize("NFC", piece)))
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

    token = [bytes([b]) for b in range(256)]
    merges = []
    while len(merges) < n_merges and heap:
        c, pair = heappop(heap)
        if -c != pair_count[pair] or c == 0:
            continue  # stale entry
        a, b = pair
        new = len(token)
        token.append(token[a] + token[b])
        merges.append((token[a], token[b]))
        touched = set()
        for w in where.pop(pair):
            old, f = words[w], freq[w]
            merged, i = [], 0
            while i < len(old):  # left to right, non-overlapping (as HF's merge does)
                if i + 1 < len(old) and old[i] == a and old[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(old[i])
                    i += 1
            for p in pairwise(old):
                pair_count[p] -= f
                touched.add(p)
            for p in pairwise(merged):
                pair_count[p] += f
                where[p].add(w)
                touched.add(p)
            words[w] = merged
        for p in touched:
            if pair_count[p] > 0:
                heappush(heap, (-pair_count[p], p))

    vocab = {t: i for i, t in enumerate(token)}
    added = {len(token) + n: {"content": name, "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False,
                              "special": name not in QWEN25_ADDED_TOKENS[QWEN25_N_SPECIAL:]}
             for n, name in enumerate(added_tokens)}
    return Tokenizer(vocab, merges, added, source="train_bpe")
