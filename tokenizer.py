"""Byte-level BPE tokenizers (Qwen2.5, SmolLM2, ...) on tiktoken: loading, encode/decode, MARS's loss span.

What it is: a byte-level BPE (GPT-2 byte alphabet) with a pre-tokenizer regex, an optional
NFC normaliser and added tokens matched inside text, read from a checkpoint's
`tokenizer.json` (HF `tokenizers`' file) or `vocab.json` + `merges.txt` + added tokens,
and run by tiktoken. It gives the same ids as HF without importing it, for the
pre-tokenizers real checkpoints use (`pattern_of`: Qwen2's regex; SmolLM2's digit
split + GPT-2's ByteLevel; plain GPT-2) and for vocabularies that lack a token for some
byte (HF then drops that byte; so do we). Anything else is refused by name. It saves
files that `transformers` loads.

The chat template comes from the checkpoint (tokenizer_config.json's `chat_template`, or
chat_template.jinja); a checkpoint without one gets Qwen2.5-Instruct's. save() writes back
the template it was loaded with, so a model trained here keeps its data's default system turn.

What it leaves to others: rendering a template as transformers does (chat_template.py),
training the default data's tiny tokenizer (data/bpe.py, `train_bpe`), writing `mars.json`
(checkpoint.py).

How it maps to MARS (docs/spec.md):
- §2 `[MASK]` is a new token `<|mask|>` = the first id after the highest id the
  checkpoint knows (151665 for Qwen2.5, whose last added token is `<|file_sep|>`
  151664), unless the checkpoint's `mars.json` names another id (a converted SmolLM2
  reuses a reserved token, see scripts/convert_gguf.py). A new `<|mask|>` is never
  parsed from text: the training and decoding code writes `tok.mask_id` directly.
- §2 rows are ChatML conversations (`Tokenizer.encode_chat`); the loss covers only the
  last assistant turn's content, its `<|im_end|>` and the `\\n` after it
  (`Tokenizer.encode_chat_with_loss_mask`), found in the rendered text of any
  ChatML-style template.
- §2/§5 EOS is `<|im_end|>` (`tok.eos_id`); the pad token is tokenizer_config.json's
  `pad_token` (Qwen2.5: `<|endoftext|>`).

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
from itertools import pairwise
from pathlib import Path

import regex  # installed with tiktoken (which needs it); stdlib `re` has no \p{L}
import tiktoken

from chat_template import QWEN25_CHAT_TEMPLATE, render_chat
from util.atomic import write_text
from util.files import checked, read_json_object, reading

# Qwen2's pre-tokenizer: contractions, letter runs (one leading non-letter), single digits
# (so numbers are spelled digit by digit), punctuation runs, newlines, other whitespace.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# GPT-2's regex (HF's ByteLevel pre-tokenizer with use_regex=true).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2: Digits(individual_digits) splits every digit off, then GPT-2's regex runs on each
# piece. As one regex: a digit is a chunk of its own, and a whitespace run ends where a piece
# ends, i.e. also before a digit ("x  1" -> "x", "  ", "1", not "x", " ", " ", "1").
DIGITS_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

MASK_TOKEN = "<|mask|>"  # docs/spec.md §2


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



# ---------------------------------------------------------------- tokenizer.json components
# The pre-tokenizers we run, as tokenizer.json spells them; each is one regex for tiktoken.
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
QWEN2_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
    BYTE_LEVEL]}
NFC = {"type": "NFC"}
PLAIN_BPE = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
QWEN25_SPECIAL_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
SUPPORTED = ("Split(Regex, Isolated) + ByteLevel(use_regex=false); Digits(individual_digits=true) + "
             "ByteLevel(use_regex=true); ByteLevel(use_regex=true); all with add_prefix_space=false")


def _describe(spec) -> str:
    parts = spec.get("pretokenizers", [spec]) if spec else []
    return " + ".join(json.dumps(p, sort_keys=True) for p in parts) or "null"


def pattern_of(pre_tokenizer: dict | None, where: str) -> str:
    """The tiktoken regex equal to a tokenizer.json `pre_tokenizer`; a clear error otherwise."""
    steps = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer])
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    last = steps[-1] if kinds and kinds[-1] == "ByteLevel" else {}
    ok = last and not last.get("add_prefix_space")
    if ok and kinds == ["ByteLevel"] and last.get("use_regex", True):
        return GPT2_PATTERN
    first = steps[0]
    if ok and kinds == ["Digits", "ByteLevel"] and first.get("individual_digits") and last.get("use_regex"):
        return DIGITS_GPT2_PATTERN
    if ok and kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True):
        isolated = first.get("behavior") == "Isolated" and not first.get("invert")
        if "Regex" in first.get("pattern", {}) and isolated:
            return first["pattern"]["Regex"]
    raise ValueError(f"{where}: unsupported pre_tokenizer {_describe(pre_tokenizer)} "
                     f"(supported: {SUPPORTED})")


def normalizer_of(normalizer: dict | None, where: str) -> bool:
    """True for NFC, False for none; a clear error for any other normaliser."""
    steps = (normalizer or {}).get("normalizers", [normalizer] if normalizer else [])
    kinds = [s.get("type") if isinstance(s, dict) else s for s in steps]
    if kinds in ([], ["NFC"]):
        return kinds == ["NFC"]
    raise ValueError(f"{where}: unsupported normalizer {json.dumps(normalizer)} (only NFC or none)")


def _check_bpe_model(model: dict, where: str):
    """The BPE options under which HF's BPE is the plain byte-level merge loop we run."""
    if model.get("type") != "BPE":
        raise ValueError(f"{where}: unsupported model type {model.get('type')!r} (only BPE)")
    for key in ("dropout", "byte_fallback", "ignore_merges", "continuing_subword_prefix",
                "end_of_word_suffix"):
        if model.get(key) not in (None, False, ""):  # absent, null, false, 0.0 or ""
            raise ValueError(f"{where}: unsupported model.{key}={model[key]!r}")


def _read_tokenizer_json(file: Path):
    """tokenizer.json -> (vocab entries, merge pairs, added records, pre_tokenizer, normalizer,
    unk_token), each component checked (a clear error names what is not supported)."""
    spec = read_json_object(file)
    with reading(file):  # a key of another type than HF writes names the file
        model = spec.get("model") or {}
        _check_bpe_model(model, str(file))
        post = spec.get("post_processor")
        if post is not None and post.get("type") != "ByteLevel":
            raise ValueError(f"{file}: unsupported post_processor {post.get('type')!r} (it would add "
                             "tokens; only ByteLevel or none)")
        pattern_of(spec.get("pre_tokenizer"), f"{file}")
        normalizer_of(spec.get("normalizer"), f"{file}")
        merges = [m.split(" ") if isinstance(m, str) else m for m in model.get("merges", [])]
        records = [(file, rec["id"], rec) for rec in spec.get("added_tokens", [])]
    return (model.get("vocab", {}), merges, records, spec.get("pre_tokenizer"), spec.get("normalizer"),
            model.get("unk_token"))


def _read_slow_files(path: Path):
    """vocab.json + merges.txt -> (vocab entries, merge pairs); Qwen2's pre-tokenizer and NFC."""
    vocab_file, merges_file = path / "vocab.json", path / "merges.txt"
    for f in (vocab_file, merges_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (a tokenizer needs tokenizer.json, or vocab.json "
                                    "and merges.txt)")
    merges = []
    with reading(merges_file):
        lines = merges_file.read_text(encoding="utf-8").split("\n")
    for n, line in enumerate(lines, 1):
        if line.startswith("#version") or (not line and n == len(lines)):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):
            raise ValueError(f"{merges_file}: line {n} {line!r} is not two tokens")
        merges.append((pair, f"{merges_file}: line {n} {line!r}"))
    return read_json_object(vocab_file), merges


def _read_added(records) -> dict[int, dict]:
    """id -> HF's added-token record, from every file that lists them (they must agree)."""
    added = {}
    for f, i, rec in records:
        with reading(f):  # an added token that is not a {"content": ...} record
            checked(f, "content", rec["content"], str)
            if any(rec.get(flag) for flag in ("lstrip", "rstrip", "single_word")):
                raise ValueError(f"{f}: added token {rec['content']!r} sets lstrip, rstrip or "
                                 "single_word, which this tokenizer does not implement")
            if i in added and added[i]["content"] != rec["content"]:
                raise ValueError(f"{f}: id {i} is {rec['content']!r}, elsewhere {added[i]['content']!r}")
            rec = {k: rec[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word",
                                       "special") if k in rec}
        added.setdefault(checked(f, "id", i, int, 0), rec)
    return added


def _bpe_tables(entries: dict, merges, added: dict, vocab_where: str):
    """Spelled vocab / merges -> (bytes -> id, [(bytes, bytes)]), added tokens left out."""
    added_names = {rec["content"]: i for i, rec in added.items()}
    vocab = {}
    for name, i in checked(vocab_where, "vocab", entries, dict).items():
        if name in added_names:  # some files list added tokens in the vocab too
            if added_names[name] != i:
                raise ValueError(f"{vocab_where}: {name!r} has id {i}, but {added_names[name]} "
                                 "as an added token")
            continue
        vocab[_to_bytes(name, f"{vocab_where}: entry")] = checked(vocab_where, name, i, int, 0)
    pairs = []
    for pair, where in merges:
        a, b = (_to_bytes(p, where) for p in pair)
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise ValueError(f"{where} uses a token not in the vocabulary")
        pairs.append((a, b))
    return vocab, pairs


def _token_name(value):
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(path: Path, config: dict):
    """chat_template.jinja (transformers >= 4.43 saves it apart) or tokenizer_config's; else None."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


# ---------------------------------------------------------------- the tokenizer
class Tokenizer:
    """A byte-level BPE tokenizer. Build it with `Tokenizer.from_dir` or `data.bpe.train_bpe`."""

    def __init__(self, vocab: dict[bytes, int], merges: list[tuple[bytes, bytes]],
                 added_tokens: dict[int, dict], source: str = "<memory>", *,
                 pre_tokenizer: dict | None = QWEN2_PRE_TOKENIZER, normalizer: dict | None = NFC,
                 chat_template: str | None = None, special_tokens: dict | None = None,
                 mask_id: int | None = None, merges_source: str | None = None):
        # vocab: the BPE tokens (bytes -> id); merges: in order; added_tokens: id -> HF's record
        # {"content", "special", ...}; pre_tokenizer / normalizer: tokenizer.json's specs;
        # special_tokens: tokenizer_config's names (bos_token, eos_token, pad_token, unk_token).
        # All kept as read, so save() writes them back.
        self.vocab, self.merges, self.added_tokens = dict(vocab), list(merges), dict(added_tokens)
        self.pre_tokenizer, self.normalizer = pre_tokenizer, normalizer
        self.chat_template = chat_template or QWEN25_CHAT_TEMPLATE
        self.special_tokens = dict(special_tokens or QWEN25_SPECIAL_TOKENS)
        self._nfc = normalizer_of(normalizer, source)
        self._set_named_ids(source, mask_id)
        self._build_encoder(pattern_of(pre_tokenizer, source), merges_source or source)

    def _set_named_ids(self, source, mask_id):
        self.added_ids = {rec["content"]: i for i, rec in self.added_tokens.items()}
        for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            if name not in self.added_ids:
                raise ValueError(f"{source}: added token {name} is missing (a ChatML tokenizer)")
        self.endoftext_id = self.added_ids["<|endoftext|>"]
        pad = self.special_tokens.get("pad_token")
        self.pad_id = self.added_ids.get(pad, self.endoftext_id)  # Qwen2.5 pads with <|endoftext|>
        self.im_start_id = self.added_ids["<|im_start|>"]
        self.eos_id = self.added_ids["<|im_end|>"]  # end of an assistant turn (MARS §2, §5)
        existing = [*self.vocab.values(), *self.added_tokens]
        self.mask_id = mask_id if mask_id is not None else self.added_ids.get(MASK_TOKEN, max(existing) + 1)
        self.vocab_size = max(*existing, self.mask_id) + 1  # rows an embedding table needs
        # Every id decodes through one table; added tokens (and a new <|mask|>) to their text.
        self._id_to_bytes = {i: t for t, i in self.vocab.items()}
        self._id_to_bytes |= {i: rec["content"].encode() for i, rec in self.added_tokens.items()}
        self._id_to_bytes.setdefault(self.mask_id, MASK_TOKEN.encode())

    def _build_encoder(self, pattern, source):
        # Tiktoken ranks: the line of each buildable token's live merge (see the docstring).
        try:
            live = _live_merges(self.merges)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        singles = [bytes([b]) for b in range(256) if bytes([b]) in self.vocab]
        by_line = sorted((t for t in live if len(t) > 1), key=lambda t: live[t][0])
        if all(a < b for a, b in pairwise(self.vocab[t] for t in by_line)):
            # Usual case (Qwen2.5, SmolLM2, train_bpe, HF's trainer): ids follow merge order.
            ranks, self._rank_to_id = {t: self.vocab[t] for t in singles + by_line}, None
        else:
            ranks = {t: n for n, t in enumerate(singles + by_line)}
            self._rank_to_id = [self.vocab[t] for t in ranks]
        self._enc = tiktoken.Encoding("bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        # Bytes without a token (SmolLM2 has none for 21 bytes): HF's BPE drops them from the
        # chunk and merges across the gap; such text takes the slow path in _encode_text.
        self._missing = bytes(b for b in range(256) if bytes([b]) not in self.vocab)
        self._split = regex.compile(pattern)
        # Added tokens are found in raw text before normalisation, longest first (as HF does).
        names = sorted(self.added_ids, key=len, reverse=True)
        self._added_re = regex.compile("(" + "|".join(map(regex.escape, names)) + ")")

    # ---- loading and saving ----

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Read tokenizer.json (preferred) or vocab.json + merges.txt, the added tokens
        (tokenizer_config.json's `added_tokens_decoder` and/or tokenizer.json's), the chat
        template and special tokens, and mars.json's `mask_id` when the directory has one."""
        path = Path(path)
        config_file, fast_file = path / "tokenizer_config.json", path / "tokenizer.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        with reading(config_file):
            records = [(config_file, int(i), r) for i, r in config.get("added_tokens_decoder", {}).items()]
        spec = dict(pre_tokenizer=QWEN2_PRE_TOKENIZER, normalizer=NFC)
        if fast_file.is_file():
            entries, pairs, fast_records, spec["pre_tokenizer"], spec["normalizer"], unk = \
                _read_tokenizer_json(fast_file)
            records += fast_records
            merges, where = [(p, f"{fast_file}: merge {' '.join(p)!r}") for p in pairs], fast_file
        else:
            (entries, merges), unk, where = _read_slow_files(path), None, path / "vocab.json"
        added = _read_added(records)
        vocab, merge_pairs = _bpe_tables(entries, merges, added, str(where))
        missing = [b for b in range(256) if bytes([b]) not in vocab]
        if missing and unk is not None:
            raise ValueError(f"{where}: no token for byte(s) {missing[:8]} and unk_token {unk!r} set "
                             "(HF would emit unk; only vocabularies without unk_token are supported)")
        special = {k: checked(config_file, k, _token_name(config[k]), str)
                   for k in ("bos_token", "eos_token", "pad_token", "unk_token") if config.get(k) is not None}
        mars = path / "mars.json"
        mask_id = read_json_object(mars).get("mask_id") if mars.is_file() else None
        mask_id = None if mask_id is None else checked(mars, "mask_id", mask_id, int, 0)
        return cls(vocab, merge_pairs, added, source=str(path), chat_template=_chat_template(path, config),
                   special_tokens=special or None, mask_id=mask_id,
                   merges_source=str(fast_file if fast_file.is_file() else path / "merges.txt"), **spec)

    def save(self, path) -> None:
        """Write tokenizer.json (HF `tokenizers`' file, with our pre-tokenizer and normaliser) and
        tokenizer_config.json (the added tokens, the special tokens and the chat template as
        read); with Qwen2's pre-tokenizer also vocab.json + merges.txt (Qwen2Tokenizer's files).
        A new `<|mask|>` is not written: it is derived again on load (a reused one lives in
        mars.json, which the checkpoint writer owns)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        vocab = {_to_str(t): i for t, i in sorted(self.vocab.items(), key=lambda kv: kv[1])}
        merges = [[_to_str(a), _to_str(b)] for a, b in self.merges]
        qwen2 = self.pre_tokenizer == QWEN2_PRE_TOKENIZER and self._nfc
        if qwen2:
            write_text(path / "vocab.json", json.dumps(vocab, ensure_ascii=False))
            write_text(path / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        added = [{"id": i} | rec for i, rec in sorted(self.added_tokens.items())]
        model = PLAIN_BPE | {"vocab": vocab, "merges": merges}
        fast = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                "normalizer": self.normalizer, "pre_tokenizer": self.pre_tokenizer,
                "post_processor": BYTE_LEVEL, "decoder": BYTE_LEVEL, "model": model}
        write_text(path / "tokenizer.json", json.dumps(fast, ensure_ascii=False))
        config = {"add_prefix_space": False,
                  "added_tokens_decoder": {str(i): rec for i, rec in sorted(self.added_tokens.items())},
                  "bos_token": None, "chat_template": self.chat_template,
                  "clean_up_tokenization_spaces": False,
                  "errors": "replace", "model_max_length": 32768, "split_special_tokens": False,
                  "tokenizer_class": "Qwen2Tokenizer" if qwen2 else "PreTrainedTokenizerFast",
                  "unk_token": None} | self.special_tokens
        write_text(path / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))

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
                ranks = self._encode_text(unicodedata.normalize("NFC", piece) if self._nfc else piece)
                ids += ranks if self._rank_to_id is None else [self._rank_to_id[r] for r in ranks]
        return ids

    def _encode_text(self, text: str) -> list[int]:
        """Ranks of text without added tokens. Text with a byte the vocabulary lacks is split
        here and the byte dropped from its chunk before BPE, as HF's BPE drops it."""
        if not self._missing:
            return self._enc.encode_ordinary(text)
        raw = text.encode("utf-8", errors="surrogatepass")
        if len(raw.translate(None, self._missing)) == len(raw):
            return self._enc.encode_ordinary(text)
        ranks = []
        for chunk in self._split.findall(text):
            kept = chunk.encode("utf-8", errors="surrogatepass").translate(None, self._missing)
            if kept:
                ranks += self._enc._encode_single_piece(kept)
        return ranks

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self._id_to_bytes[int(i)] for i in ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ---- chat (MARS §2) ----

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, through this checkpoint's chat template."""
        return render_chat(messages, add_generation_prompt, self.chat_template, self.special_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """Ids of the templated conversation; equals HF's apply_chat_template(tokenize=True)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def encode_chat_with_loss_mask(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """Ids of the templated conversation and, per id, whether it carries loss (MARS §2):
        the last assistant turn's content, its `<|im_end|>` and the `\\n` after it.

        The span is found in the rendered text of any ChatML-style template: the last
        "<|im_start|>assistant\\n" + content + "<|im_end|>\\n". The whole string is tokenised at
        once (as HF does) and the span found by byte offsets: tokenising prompt and answer
        apart can differ, e.g. "assistant\\n" + "\\nHi" makes one "\\n\\n" token. A token that
        straddles the start of the answer carries loss.
        """
        last = max((n for n, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ValueError("encode_chat_with_loss_mask: the conversation has no assistant turn")
        text = self.render_chat(messages)
        header, answer = "<|im_start|>assistant\n", messages[last]["content"] + "<|im_end|>\n"
        at = text.rfind(header + answer)
        if at < 0:
            raise ValueError("encode_chat_with_loss_mask: the chat template does not render the last "
                             "assistant turn ChatML-style (<|im_start|>assistant\\n...<|im_end|>\\n)")
        start, end = at + len(header), at + len(header) + len(answer)
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
