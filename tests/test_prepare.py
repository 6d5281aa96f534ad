"""Proofs for data/prepare.py: chat JSONL -> ids / loss mask / offsets (docs/spec.md §2).

Claims, each against an independent reference:
  * every good row is stored exactly: decoding its ids gives the ChatML text written out
    by hand here, and the loss tokens decode to the last assistant turn's content +
    "<|im_end|>\\n" and form one contiguous span at the end of the row;
  * a conversation with turns after its last assistant turn is trimmed to end there;
  * every kind of bad row (invalid JSON, a garbled or truncated line, missing keys,
    unknown role, no assistant turn, prompt or row too long) is skipped and counted
    under its own reason, exactly; the file is never abandoned halfway;
  * the .npz holds int32 / uint8 / int64 arrays readable without pickle, written
    atomically, and the CLI prints the summary;
  * generated rows are stored as the ids given (prompt, reply, the template's tail when
    finished; a row the cap cut ends on a whole block with no EOS), written out by hand;
  * the teacher arrays keep each row's first entries, in order, and load back with each
    row's span (t_offsets); malformed ones are refused.
"""

import json

import numpy as np
import pytest

from data.bpe import train_bpe
from data.prepare import add_teacher, load_npz, main, prepare, prepare_generated, save_npz
from tokenizer import Tokenizer

SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."  # Qwen2.5's default


def chatml(messages):
    """The ChatML text, written out by hand (the default system turn when none is given)."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": SYSTEM}] + messages
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


GOOD = [
    [u("What is 2 + 3?"), a("2 + 3 = 5.")],
    [{"role": "system", "content": "Be brief."}, u("Hi"), a("Hello."), u("Name a fruit."), a("A pear.")],
]
TRIMMED = [u("Say yes."), a("Yes."), u("And again?")]  # trailing user turn: trimmed to its answer
LONG_REPLY = [u("Count."), a(" ".join(["one two three"] * 40))]  # a row over MAX_LEN
LONG_PROMPT = [u(" ".join(["words in the prompt"] * 6)), a("Ok.")]  # prompt over MAX_PROMPT only
MAX_LEN, MAX_PROMPT = 128, 80


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [chatml(m) for m in GOOD + [TRIMMED, LONG_REPLY, LONG_PROMPT]]
    path = tmp_path_factory.mktemp("tok")
    train_bpe(texts, 40).save(path)
    tok = Tokenizer.from_dir(path)
    # the premises of the tests below, measured on the hand-written text
    n_row = lambda m: len(tok.encode(chatml(m)))
    n_prompt = lambda m: len(tok.encode(chatml(m[:-1]) + "<|im_start|>assistant\n"))
    assert all(n_row(m) <= MAX_LEN and n_prompt(m) + 2 <= MAX_PROMPT for m in GOOD + [TRIMMED[:2]])
    assert n_row(LONG_REPLY) > MAX_LEN and n_prompt(LONG_REPLY) + 2 <= MAX_PROMPT
    assert n_row(LONG_PROMPT) <= MAX_LEN and n_prompt(LONG_PROMPT) > MAX_PROMPT + 2
    return tok


def jsonl_lines():
    """(line bytes, expected reason or None) for a file with one of each kind of row."""
    good = [json.dumps({"messages": m, "id": i}).encode() for i, m in enumerate(GOOD)]
    return [
        (good[0], None),
        (b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "assis', "invalid_json"),  # truncated
        (b'\xff\xfe{"messages": \x00\x81garbled', "invalid_json"),  # not UTF-8
        (b"[1, 2, 3]", "not_an_object"),
        (json.dumps({"conversation": GOOD[0]}).encode(), "missing_messages"),
        (json.dumps({"messages": []}).encode(), "missing_messages"),
        (json.dumps({"messages": [{"content": "Hi"}, a("Yo")]}).encode(), "missing_role_or_content"),
        (json.dumps({"messages": [u(None), a("Yo")]}).encode(), "missing_role_or_content"),
        (json.dumps({"messages": [u("Hi"), {"role": "tool", "content": "{}"}, a("Yo")]}).encode(),
         "unknown_role"),
        (json.dumps({"messages": [u("Hi")]}).encode(), "no_assistant_turn"),
        (b"", "blank_line"),
        (json.dumps({"messages": LONG_REPLY}).encode(), "too_long"),
        (json.dumps({"messages": LONG_PROMPT}).encode(), "prompt_too_long"),
        (good[1], None),
        (json.dumps({"messages": TRIMMED}).encode(), None),
        (b'{"messages": [{"role": "user", "cont', "invalid_json"),  # the file's last line, cut short
    ]


def check_row(tok, ids, loss, messages):
    """The stored row against the hand-written ChatML text of `messages` (already trimmed)."""
    assert tok.decode(ids) == chatml(messages)
    n_loss = int(loss.sum())
    assert n_loss > 0 and loss[-n_loss:].all() and not loss[:-n_loss].any()  # one span at the end
    assert tok.decode(ids[-n_loss:]) == messages[-1]["content"] + "<|im_end|>\n"


def test_good_rows_are_stored_exactly_and_bad_rows_counted(tok):
    lines = jsonl_lines()
    arrays, stats = prepare([line for line, _ in lines], tok, max_len=MAX_LEN, max_prompt_len=MAX_PROMPT)
    expected = {}
    for _, reason in lines:
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    assert stats["skipped"] == expected
    assert stats["rows"] == len(lines) and stats["kept"] == 3 and stats["trimmed"] == 1
    assert stats["examples"]["invalid_json"] == [2, 3, 16]  # 1-based row numbers

    ids, loss, off = arrays["ids"], arrays["loss"], arrays["offsets"]
    assert ids.dtype == np.int32 and loss.dtype == np.uint8 and off.dtype == np.int64
    assert off[0] == 0 and off[-1] == len(ids) == len(loss) == stats["tokens"]
    for i, messages in enumerate([GOOD[0], GOOD[1], TRIMMED[:2]]):
        check_row(tok, ids[off[i]:off[i + 1]], loss[off[i]:off[i + 1]], messages)
    assert stats["loss_tokens"] == int(loss.sum())


def test_limits_are_inclusive_and_optional(tok):
    """A row of exactly max_len tokens is kept; without max_prompt_len no prompt is too long."""
    n = len(tok.encode(chatml(LONG_PROMPT)))
    _, stats = prepare([{"messages": LONG_PROMPT}], tok, max_len=n)
    assert stats["kept"] == 1
    _, stats = prepare([{"messages": LONG_PROMPT}], tok, max_len=n - 1)
    assert stats["skipped"] == {"too_long": 1}


def test_cli_writes_npz_atomically_and_prints_summary(tok, tmp_path, capsys):
    src = tmp_path / "chat.jsonl"
    src.write_bytes(b"\n".join(line for line, _ in jsonl_lines()))  # no final newline: cut last line
    tok_dir = tmp_path / "tok"
    tok.save(tok_dir)
    out = tmp_path / "sub" / "train.npz"
    main(["--input", str(src), "--tokenizer", str(tok_dir), "--out", str(out), "--max-len", str(MAX_LEN),
          "--max-prompt-len", str(MAX_PROMPT)])
    text = capsys.readouterr().out
    assert "read 16 rows, kept 3" in text and "skipped 13" in text and "trimmed 1" in text
    for reason, count in (("invalid_json", 3), ("missing_messages", 2), ("too_long", 1),
                          ("prompt_too_long", 1), ("unknown_role", 1), ("blank_line", 1)):
        assert any(line.split()[:3] == ["skipped", str(count), reason] for line in text.splitlines()), reason
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.npz"]  # no temp file left
    with np.load(out, allow_pickle=False) as f:
        assert sorted(f.files) == ["ids", "loss", "offsets"]
        ids, loss, off = f["ids"], f["loss"], f["offsets"]
    assert len(off) == 4
    check_row(tok, ids[off[2]:off[3]], loss[off[2]:off[3]], TRIMMED[:2])


def test_no_usable_row_is_an_error_and_writes_nothing(tok, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\nnot json\n')
    tok_dir = tmp_path / "tok"
    tok.save(tok_dir)
    out = tmp_path / "out.npz"
    with pytest.raises(SystemExit, match="no usable rows"):
        main(["--input", str(src), "--tokenizer", str(tok_dir), "--out", str(out)])
    assert not out.exists()


def test_load_npz_rejects_malformed_files(tmp_path):
    good = {"ids": np.arange(5, dtype=np.int32), "loss": np.ones(5, np.uint8),
            "offsets": np.array([0, 2, 5], np.int64)}
    save_npz(good, str(tmp_path / "ok.npz"))
    assert load_npz(str(tmp_path / "ok.npz"))["offsets"].tolist() == [0, 2, 5]
    np.savez(tmp_path / "no_loss.npz", ids=good["ids"], offsets=good["offsets"])
    with pytest.raises(ValueError, match=r"missing array\(s\) \['loss'\]"):
        load_npz(str(tmp_path / "no_loss.npz"))
    np.savez(tmp_path / "bad_off.npz", ids=good["ids"], loss=good["loss"], offsets=np.array([0, 4, 3]))
    with pytest.raises(ValueError, match="offsets"):
        load_npz(str(tmp_path / "bad_off.npz"))
    with pytest.raises(FileNotFoundError, match="data/prepare.py"):
        load_npz(str(tmp_path / "absent.npz"))


def test_generated_rows_are_the_given_ids():
    rows = [{"prompt_ids": [1, 2, 3], "reply_ids": [7, 8, 9, 5], "finished": True},  # 5: its EOS
            {"prompt_ids": [1, 2], "reply_ids": [6, 6, 6, 6, 6, 6, 6], "finished": False}]  # cut by the cap
    a = prepare_generated(rows, tail_ids=[4], block_size=4)
    assert a["offsets"].tolist() == [0, 8, 16]
    assert a["ids"][:8].tolist() == [1, 2, 3, 7, 8, 9, 5, 4]
    assert a["loss"][:8].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert a["ids"][8:].tolist() == [1, 2] + [6] * 6 and a["loss"][8:].tolist() == [0, 0] + [1] * 6  # 9 -> 8
    assert a["ids"].dtype == np.int32 and a["loss"].dtype == np.uint8
    with pytest.raises(ValueError, match="no loss token"):
        prepare_generated([{"prompt_ids": [1, 2, 3, 1, 2], "reply_ids": [6], "finished": False}], [4], 4)


def test_teacher_arrays_keep_each_rows_first_entries_and_load_back(tmp_path):
    a = prepare_generated([{"prompt_ids": [1, 2, 3], "reply_ids": [7, 8, 5], "finished": True},
                           {"prompt_ids": [1], "reply_ids": [6, 6, 6, 6], "finished": False}], [4], 2)
    k = 3  # row 0: 4 targets (7, 8, 5, 4); row 1: cut to 4 tokens, 3 targets, a teacher for 4 given
    per_row = [(np.full((4, k), -float(i), np.float32), np.arange(4 * k).reshape(4, k) + 100 * i,
                np.full(4, 0.1 * i, np.float32)) for i in (1, 2)]
    t = add_teacher(a, per_row)
    assert (t["t_logp"].dtype, t["t_ids"].dtype, t["t_rest"].dtype) == (np.float16, np.int32, np.float32)
    assert t["t_ids"].tolist() == per_row[0][1].tolist() + per_row[1][1][:3].tolist()  # the first 3 of row 1
    save_npz(t, str(tmp_path / "t.npz"))
    d = load_npz(str(tmp_path / "t.npz"))
    assert d["t_offsets"].tolist() == [0, 4, 7] and d["t_rest"][4:].tolist() == pytest.approx([0.2] * 3)
    with pytest.raises(ValueError, match="a teacher for 2 targets"):
        add_teacher(a, [(x[:2], y[:2], z[:2]) for x, y, z in per_row])
    np.savez(tmp_path / "bad.npz", **{**{k: v for k, v in t.items()}, "t_rest": t["t_rest"][:-1]})
    with pytest.raises(ValueError, match="teacher arrays"):
        load_npz(str(tmp_path / "bad.npz"))
