"""Proofs for tokenizer.py, chat_template.py and data/bpe.py, each against an independent
reference (HF `tokenizers` / `transformers`, or a rule read straight off the string), never
against our own output.

- A byte-level BPE trained by HF's `tokenizers` with Qwen2's normaliser and pre-tokenizer,
  loaded by `transformers` (Qwen2Tokenizer), gives the same ids as ours on a mixed corpus.
- Our ChatML ids equal HF's apply_chat_template with Qwen2.5-Instruct's template.
- The MARS §2 loss span is exactly the last assistant content + <|im_end|> + "\\n".
- `<|mask|>` is the first id after the highest one (151665 for a Qwen2.5 id layout).
- `train_bpe`'s saved files load in `transformers` and give the same ids as ours.
"""

import json
import random
import unicodedata
from itertools import pairwise

import pytest
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer

from chat_template import chatml_template, render_chat
from data.bpe import train_bpe
from tokenizer import Tokenizer

QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2.5's added tokens (ids 151643..151664): the first 14 are special, the rest are not.
ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]

# Qwen2.5-Instruct's chat template, copied here as the reference (non-tool branch verbatim;
# the tool branch is not exercised).
CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501, RUF100

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. I'm sure you'll see it's fine; they've "
    "DONE IT'S WORK, haven't they? Numbers like 3.14159, 2024-06-01 and 1,000,000 matter. "
)
CODE = (
    "def add(a, b):\n    return a + b  # sum\n\n\nclass Foo:\n\tx = [1, 2, 3]\r\n"
    "    if x != None and y >= 10:\n        print(f'{x!r}')\n"
)
CJK = "今天天气很好，我们去公园散步吧。東京は日本の首都です。한국어 문장입니다. "
EMOJI = "Emoji 😀😃 👍🏽 👨‍👩‍👧 🇫🇷 ✨ ok "
ODD = "tabs\t\tand  spaces   \n\n  \t\n end\u00a0nbsp \u2028 line… “quotes” — dash ½ ² Ⅷ "
NON_NFC = "cafe\u0301 A\u030a \u1100\u1161\u11a8 Å "  # NFC composes all of these


def corpus(seed: int, n: int) -> list[str]:
    """Documents mixing the fixed parts above with random words in several scripts."""
    rng = random.Random(seed)
    parts = [ENGLISH, CODE, CJK, EMOJI, ODD, NON_NFC, "12 + 345 = 357\n", "x" * 7 + " ", " " * 9]
    scripts = ["bcdfglmnprstv", "aeiou", "абвгдежзик", "的一是不了人我在有他这中", "αβγδεζ", "_"]

    def word():
        return "".join(rng.choice(rng.choice(scripts)) for _ in range(rng.randint(1, 8)))

    docs = []
    for _ in range(n):
        doc = [rng.choice(parts) if rng.random() < 0.3 else word() + rng.choice(" \n,.") for _ in
               range(rng.randint(1, 30))]
        docs.append("".join(doc))
    return docs


MIXED = corpus(1, 40) + [
    ENGLISH, CODE, CJK, EMOJI, ODD, NON_NFC, "", " ", "\n\n  \t", "  leading", "trailing  \n",
    "a<|im_end|>b", "<|im_start|>user\nhi<|im_end|>\n", "<tool_call>{}</tool_call>",
    "<|im_end", "<|im_end|><|im_end|>", "<|endoftext|>" * 3, "<|mask|> is plain text",
    "Ünïcödé wörds ÀÉÎ Ωμέγα Привет мир", "0123456789 9876543210", "e\u0301", "\r\n\r\n x",
    "🤷🏻‍♀️🤷🏻‍♀️", "\u0000\u0001\u007f control", "zzqqxx unseen wordsfoobarbazqux",
]


def qwen_config(added_ids: dict[str, int], chat_template: str = CHAT_TEMPLATE) -> dict:
    """tokenizer_config.json as Qwen2.5-Instruct ships it (without `additional_special_tokens`)."""
    decoder = {
        str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": ADDED.index(name) < 14}
        for name, i in added_ids.items()
    }
    return {
        "add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": None,
        "chat_template": chat_template, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 32768,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }


def write_files(path, vocab: dict[str, int], merges: list[str], added_ids: dict[str, int]):
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges),
                                     encoding="utf-8")
    config = json.dumps(qwen_config(added_ids))
    (path / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Qwen2-style BPE trained by HF `tokenizers`, saved as vocab.json + merges.txt."""
    hf = HFTokenizer(models.BPE())
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(corpus(0, 2000), trainer)
    path = tmp_path_factory.mktemp("hf_bpe")
    hf.model.save(str(path))  # vocab.json, merges.txt
    n = hf.get_vocab_size()
    (path / "tokenizer_config.json").write_text(
        json.dumps(qwen_config({name: n + k for k, name in enumerate(ADDED)})), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_tok(hf_dir):
    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def tok(hf_dir):
    return Tokenizer.from_dir(hf_dir)


def test_hf_loads_the_slow_file_layout_as_qwen2(hf_tok):
    # transformers 5 has no Python BPE: Qwen2Tokenizer builds a `tokenizers` BPE from the files.
    assert type(hf_tok).__name__ == "Qwen2Tokenizer"


def test_same_ids_as_hf_on_mixed_text(tok, hf_tok):
    for s in MIXED:
        assert tok.encode(s) == hf_tok.encode(s), repr(s)


def test_every_vocab_entry_as_text_encodes_as_in_hf(tok, hf_tok):
    # A chunk that is itself a token: tiktoken returns it whole, HF builds it by merges.
    texts = [hf_tok.convert_tokens_to_string([name]) for name in hf_tok.get_vocab()]
    texts = [t for t in texts if "\ufffd" not in t]  # drop parts of a character
    assert len(texts) > 2000
    assert [tok.encode(t) for t in texts] == [hf_tok.encode(t) for t in texts]


def test_decode_round_trips_to_nfc(tok, hf_tok):
    for s in MIXED:
        ids = tok.encode(s)
        assert tok.decode(ids) == unicodedata.normalize("NFC", s), repr(s)
        assert tok.decode(ids) == hf_tok.decode(ids), repr(s)
    assert tok.encode("e\u0301") == tok.encode("\u00e9")


def test_added_tokens_and_named_ids(tok, hf_tok):
    ids = tok.encode("x<|im_start|>y<|im_end|><|endoftext|><tool_call>")
    assert ids == hf_tok.encode("x<|im_start|>y<|im_end|><|endoftext|><tool_call>")
    assert tok.im_start_id == hf_tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_id == hf_tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.endoftext_id == tok.pad_id == hf_tok.pad_token_id
    # allow_special=False spells added tokens as text, like HF's split_special_tokens=True.
    hf_split = AutoTokenizer.from_pretrained(hf_tok.name_or_path, split_special_tokens=True)
    assert tok.encode("a<|im_end|>b", allow_special=False) == hf_split.encode("a<|im_end|>b")


def test_mask_is_first_id_after_the_highest(tok, hf_tok):
    highest = max(hf_tok.get_vocab().values())
    assert tok.mask_id == highest + 1 and tok.vocab_size == highest + 2
    assert tok.decode([tok.mask_id]) == "<|mask|>"
    assert tok.mask_id not in tok.encode("<|mask|>")  # never parsed from text (HF doesn't know it)


def test_qwen25_id_layout_gives_mask_151665(hf_dir, tmp_path):
    # A small vocab with Qwen2.5's added-token ids: a gap from the vocab up to 151643.
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = (hf_dir / "merges.txt").read_text(encoding="utf-8").split("\n")[1:-1]
    path = write_files(tmp_path, vocab, merges, {name: 151643 + k for k, name in enumerate(ADDED)})
    qwen = Tokenizer.from_dir(path)
    assert (qwen.endoftext_id, qwen.im_start_id, qwen.eos_id) == (151643, 151644, 151645)
    assert qwen.pad_id == 151643
    assert qwen.mask_id == 151665 and qwen.vocab_size == 151666
    assert qwen.encode("hi<|file_sep|>") == Tokenizer.from_dir(hf_dir).encode("hi") + [151664]
    assert qwen.decode([151645, 151665]) == "<|im_end|><|mask|>"
    # A checkpoint that already lists <|mask|> keeps its id.
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151700"] = {"content": "<|mask|>", "special": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(path).mask_id == 151700


def test_tokens_hf_cannot_build_and_ids_out_of_merge_order(tmp_path):
    # "abc" is in vocab.json, but HF merges "b c" first and has no "a bc": HF never emits
    # "abc", while plain tiktoken would (a chunk that is a token is returned whole).
    # The ids do not follow merge order either, and "ab cd" is a second, dead way to "abcd".
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet, reverse=True))}
    for i, t in enumerate(["abc", "bc", "ab", "abcd", "cd", "bcd"]):
        vocab[t] = 300 - i
    merges = ["b c", "a b", "c d", "ab c", "bc d", "a bcd", "ab cd"]
    path = write_files(tmp_path, vocab, merges, {name: 400 + k for k, name in enumerate(ADDED)})
    hf, ours = AutoTokenizer.from_pretrained(path), Tokenizer.from_dir(path)
    for s in ["abc", "abcd", "xabcd abc ab bc cd bcd", "aabbccdd abcabc", "dcba"]:
        assert ours.encode(s) == hf.encode(s), s


def test_missing_files_are_named(hf_dir, tmp_path):
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).unlink(missing_ok=True)
        for other in ("vocab.json", "merges.txt"):
            if other != name:
                (tmp_path / other).write_bytes((hf_dir / other).read_bytes())
        with pytest.raises(FileNotFoundError, match=name):
            Tokenizer.from_dir(tmp_path)


def test_bad_merge_line_is_named(hf_dir, tmp_path):
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    added = {name: 5000 + k for k, name in enumerate(ADDED)}
    path = write_files(tmp_path, vocab, ["Ġ t", "zzzz q"], added)
    with pytest.raises(ValueError, match=r"merges.txt: line 3 'zzzz q'"):
        Tokenizer.from_dir(path)
    # HF builds "bbb" only at line 4 ("bb b"; "b bb" never applies), yet line 3 uses it: HF's
    # order is then no rank of tokens, which tiktoken needs. Refused, not silently wrong.
    vocab |= {"bb": 9000, "bbb": 9001, "bbba": 9002}
    path = write_files(tmp_path, vocab, ["b b", "b bb", "bbb a", "bb b"], added)
    with pytest.raises(ValueError, match=r"merges.txt: merge #3 uses b'bbb'"):
        Tokenizer.from_dir(path)


# ---- ChatML (MARS §2) ----

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 345?"}],
    [{"role": "user", "content": "What is 12 + 345?"}, {"role": "assistant", "content": "357"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "今天天气很好?"},
        {"role": "assistant", "content": "是的 😀\n\n  ok"},
        {"role": "user", "content": "  and code?\n"},
        {"role": "assistant", "content": CODE},
    ],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "\nstarts with a newline"},  # "\n\n" straddles
        {"role": "system", "content": "late system message"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "   spaces then <|im_end|> inside e\u0301"},
    ],
    [  # a turn after the last answer: the loss stays on that answer
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "a trailing question"},
    ],
]


def test_chat_ids_equal_hf_apply_chat_template(tok, hf_tok):
    for messages in CONVERSATIONS:
        for gen in (False, True):
            # transformers 5 returns a BatchEncoding unless return_dict=False.
            ref_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen,
                                                 return_dict=False)
            ref_text = hf_tok.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=gen)
            assert render_chat(messages, add_generation_prompt=gen) == ref_text
            assert tok.encode_chat(messages, add_generation_prompt=gen) == ref_ids


def test_saved_chat_template_is_qwen25s(tok, tmp_path):
    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ref = AutoTokenizer.from_pretrained(tmp_path)
    ref.chat_template = CHAT_TEMPLATE
    for messages in CONVERSATIONS:
        assert hf.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(
            messages, tokenize=False)


def test_loss_mask_is_last_answer_im_end_and_newline(tok, hf_tok):
    for messages in CONVERSATIONS[1:]:
        ids, mask = tok.encode_chat_with_loss_mask(messages)
        text = hf_tok.apply_chat_template(messages, tokenize=False)
        enc = hf_tok(text, return_offsets_mapping=True)
        assert ids == enc["input_ids"]
        # Brute force from the string: the span runs from after the last
        # "<|im_start|>assistant\n" to the end of the "<|im_end|>\n" that follows.
        header = "<|im_start|>assistant\n"
        start = text.rindex(header) + len(header)
        end = text.index("<|im_end|>\n", start) + len("<|im_end|>\n")
        expect = [a < end and b > start for a, b in enc["offset_mapping"]]
        assert mask == expect
        answer = [m["content"] for m in messages if m["role"] == "assistant"][-1]
        answer = unicodedata.normalize("NFC", answer)
        assert tok.decode([i for i, m in zip(ids, mask) if m]).endswith(answer + "<|im_end|>\n")
    # The straddle case: tokenising prompt and answer apart gives other ids.
    prompt = render_chat(CONVERSATIONS[3][:2], add_generation_prompt=False)
    head = render_chat(CONVERSATIONS[3][:1], add_generation_prompt=True)
    assert tok.encode(head) + tok.encode(prompt[len(head):]) != tok.encode(prompt)


def test_chat_errors(tok):
    with pytest.raises(ValueError, match="tool"):
        render_chat([{"role": "tool", "content": "{}"}])
    with pytest.raises(ValueError, match="no assistant turn"):
        tok.encode_chat_with_loss_mask([{"role": "user", "content": "hi"}])


# ---- train_bpe ----


@pytest.fixture(scope="module")
def trained():
    rng = random.Random(0)
    rows = []
    for _ in range(800):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        rows.append(render_chat([{"role": "user", "content": f"What is {a} + {b}?"},
                                 {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]))
    return train_bpe(rows + corpus(2, 100), n_merges=300)


def test_train_bpe_files_load_in_hf_with_same_ids(trained, tmp_path):
    trained.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert len(trained.merges) == 300
    for s in MIXED + [render_chat(CONVERSATIONS[2])]:
        assert trained.encode(s) == hf.encode(s), repr(s)
    reloaded = Tokenizer.from_dir(tmp_path)
    assert reloaded.encode(MIXED[0]) == trained.encode(MIXED[0])
    assert reloaded.mask_id == trained.mask_id


def test_train_bpe_id_layout(trained):
    n = 256 + 300
    assert [trained.decode([i]) for i in range(n, n + 22)] == ADDED
    assert trained.mask_id == n + 22 and trained.vocab_size == n + 23
    assert trained.eos_id == n + 2 and trained.pad_id == trained.endoftext_id == n


def test_train_bpe_digits_are_single_tokens(trained):
    ids = trained.encode("12345 + 67890 = 80235")
    digits = [trained.decode([i]) for i in ids if trained.decode([i]).strip().isdigit()]
    assert "".join(digits) == "12345678908023" + "5" and all(len(d) == 1 for d in digits)


def test_train_bpe_first_merge_is_most_frequent_pair():
    # Brute force: count adjacent byte pairs inside the regex chunks of the text.
    import regex

    texts = ["hello hello help", "shell jello"]
    pairs = {}
    for text in texts:
        for chunk in regex.findall(QWEN2_REGEX, text):
            b = chunk.encode()
            for p in pairwise(b):
                pairs[p] = pairs.get(p, 0) + 1
    best = max(pairs.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))[0]
    assert train_bpe(texts, n_merges=1).merges == [(bytes([best[0]]), bytes([best[1]]))]


# ---- chat templates from the checkpoint, tokenizer.json ----

# A template that depends on how it is compiled: block tags on their own lines (trim_blocks,
# lstrip_blocks), transformers' tojson (no HTML escaping), raise_exception, and a
# loop control; its default system turn is its own.
ODD_TEMPLATE = """{% if messages[0]['role'] != 'system' %}
<|im_start|>system
Be {{ "<terse> & kind" | tojson }}.<|im_end|>
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% if loop.index > 8 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_checkpoint_chat_template_renders_as_in_transformers(hf_dir, tmp_path):
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = ODD_TEMPLATE
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_dir(tmp_path)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            ref = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render_chat(messages, add_generation_prompt=gen) == ref
            assert ours.encode_chat(messages, add_generation_prompt=gen) == hf.encode(ref)
    assert ours.render_chat(CONVERSATIONS[0]).startswith('<|im_start|>system\nBe "<terse> & kind".')
    # the loss span is found in this template's text too (MARS §2)
    ids, mask = ours.encode_chat_with_loss_mask(CONVERSATIONS[2])
    assert ours.decode([i for i, m in zip(ids, mask) if m]) == CODE + "<|im_end|>\n"


def test_data_tokenizer_keeps_its_default_system_turn(tmp_path):
    """Our default data's tokenizer carries a ChatML template whose default system turn is the
    data's own, and save() writes the template it was loaded with (train.py re-saves it)."""
    from data.synthetic import DEFAULT_SYSTEM, SYSTEMS

    assert DEFAULT_SYSTEM in SYSTEMS
    tok = train_bpe(corpus(4, 50), n_merges=50, chat_template=chatml_template(DEFAULT_SYSTEM))
    tok.save(tmp_path / "a")
    Tokenizer.from_dir(tmp_path / "a").save(tmp_path / "b")  # loaded and saved again, as train.py does
    hf, ours = AutoTokenizer.from_pretrained(tmp_path / "b"), Tokenizer.from_dir(tmp_path / "b")
    question = [{"role": "user", "content": "Compute 3 + 4 + 8."}]
    text = ours.render_chat(question, add_generation_prompt=True)
    assert text == f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nCompute 3 + 4 + 8." \
                   "<|im_end|>\n<|im_start|>assistant\n"
    assert hf.apply_chat_template(question, tokenize=False, add_generation_prompt=True) == text
    for messages in CONVERSATIONS:
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ours.encode_chat(messages) == ref


def test_saved_tokenizer_json_alone_equals_hf_tokenizers(tok, tmp_path):
    """save() writes tokenizer.json; a directory with only that file (no vocab.json / merges.txt)
    loads, and gives HF `tokenizers`' ids for the same file."""
    tok.save(tmp_path)
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).unlink()
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_dir(tmp_path)
    for s in MIXED:
        assert ours.encode(s) == hf.encode(s, add_special_tokens=False).ids == tok.encode(s), repr(s)
