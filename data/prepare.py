"""Chat data (JSONL) -> the token arrays train.py reads (MARS_SPEC §2).

    python data/prepare.py --input dolci.jsonl --tokenizer DIR --out data/dolci/train.npz \
        [--max-len 512] [--max-prompt-len N]

Each input line is one conversation, `{"messages": [{"role": ..., "content": ...}, ...]}`
(the paper used allenai/Dolci-Instruct-SFT; any file of that shape works; other keys
are ignored). A row is tokenised with `tok.encode_chat_with_loss_mask`: the conversation
rendered by the tokenizer directory's chat template (any ChatML-style one; Qwen2.5's when
the directory has none), with loss only on the LAST assistant turn's content, its
`<|im_end|>` and the `\n` after it (§2). Block padding with EOS and batch padding happen later,
in train.py (mars.pad_row / mars.collate), so one file serves every block size B.

Output (np.savez, no pickled objects; read with `load_npz`):
    ids      int32  (T,)   all rows' token ids, concatenated
    loss     uint8  (T,)   1 where the token carries loss
    offsets  int64  (N+1,) row i is ids[offsets[i]:offsets[i+1]]

Bad rows never stop a file halfway: each is skipped and counted under one reason
(SKIP_REASONS), and a summary is printed at the end. One decision of ours: a
conversation that ends with user/system turns after its last assistant turn is
TRIMMED to end at that assistant turn, not skipped. The loss is on the last
assistant turn anyway (§2); the turns after it are never trained on, and the
trimmed prefix is a complete, valid example. Trimmed rows are counted apart.
"""

import json
import os
import sys
from collections import Counter

import numpy as np

ROLES = ("system", "user", "assistant")
SKIP_REASONS = {
    "blank_line": "an empty line",
    "invalid_json": "not valid JSON (or not UTF-8)",
    "not_an_object": "the line is JSON but not an object",
    "missing_messages": "no 'messages' list, or an empty one",
    "missing_role_or_content": "a message lacks 'role' or a string 'content'",
    "unknown_role": f"a role other than {', '.join(ROLES)}",
    "no_assistant_turn": "no assistant message to put the loss on",
    "encode_error": "the tokenizer refused the conversation",
    "no_loss_tokens": "tokenised, but no token carries loss",
    "prompt_too_long": "prompt longer than --max-prompt-len tokens",
    "too_long": "row longer than --max-len tokens",
}


def check_row(row):
    """A parsed row -> (messages ending with the last assistant turn, trimmed?) or a skip reason.

    `row` is a dict or a JSON line (str / bytes; a blank line is skipped and counted).
    Returns (messages, None, trimmed) for a usable row, (None, reason, False) otherwise.
    """
    if isinstance(row, bytes | str):
        if not row.strip():
            return None, "blank_line", False
        try:
            row = json.loads(row)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
            return None, "invalid_json", False
    if not isinstance(row, dict):
        return None, "not_an_object", False
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, "missing_messages", False
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            return None, "missing_role_or_content", False
        if m["role"] not in ROLES:
            return None, "unknown_role", False
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return None, "no_assistant_turn", False
    return messages[: last + 1], None, last + 1 < len(messages)


def prepare(rows, tok, max_len=512, max_prompt_len=None):
    """Tokenise an iterable of rows (dicts or JSON lines) -> (arrays, stats).

    arrays: {"ids", "loss", "offsets"} as described in the module docstring.
    stats:  {"rows": read, "kept": n, "trimmed": n, "tokens": T, "loss_tokens": n,
             "skipped": {reason: count}, "examples": {reason: [row numbers (1-based), ...]}}.
    The prompt length of a row is the number of tokens before its first loss token.
    """
    ids, loss, lengths = [], [], []  # one small array per row: ~5 bytes a token, not a list of ints
    skipped, examples = Counter(), {}
    n_read = n_trimmed = 0
    for n_read, row in enumerate(rows, 1):
        messages, reason, trimmed = check_row(row)
        if reason is None:
            try:
                row_ids, row_mask = tok.encode_chat_with_loss_mask(messages)
            except ValueError:
                reason = "encode_error"
        if reason is None:
            first_loss = next((i for i, m in enumerate(row_mask) if m), None)
            if first_loss is None:
                reason = "no_loss_tokens"
            elif max_prompt_len is not None and first_loss > max_prompt_len:
                reason = "prompt_too_long"
            elif len(row_ids) > max_len:
                reason = "too_long"
        if reason is not None:
            skipped[reason] += 1
            examples.setdefault(reason, [])
            if len(examples[reason]) < 5:
                examples[reason].append(n_read)
            continue
        if min(row_ids) < 0 or max(row_ids) >= 2**31:
            raise ValueError(f"row {n_read}: token ids do not fit int32")
        n_trimmed += trimmed
        ids.append(np.asarray(row_ids, dtype=np.int32))
        loss.append(np.asarray(row_mask, dtype=np.uint8))
        lengths.append(len(row_ids))
    arrays = {"ids": np.concatenate(ids) if ids else np.zeros(0, np.int32),
              "loss": np.concatenate(loss) if loss else np.zeros(0, np.uint8),
              "offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)}
    stats = {"rows": n_read, "kept": len(lengths), "trimmed": n_trimmed, "tokens": int(arrays["ids"].size),
             "loss_tokens": int(arrays["loss"].sum()), "skipped": dict(skipped), "examples": examples}
    return arrays, stats


def summary(stats, source="input"):
    """The human-readable report printed at the end of a file."""
    lines = [f"{source}: read {stats['rows']} rows, kept {stats['kept']} "
             f"({stats['tokens']} tokens, {stats['loss_tokens']} with loss), "
             f"skipped {sum(stats['skipped'].values())}, "
             f"trimmed {stats['trimmed']} (turns after the last assistant turn dropped)"]
    for reason, count in sorted(stats["skipped"].items(), key=lambda kv: -kv[1]):
        rows = ", ".join(map(str, stats["examples"].get(reason, [])))
        lines.append(f"  skipped {count:>7} {reason:<24} {SKIP_REASONS[reason]} (e.g. rows {rows})")
    return "\n".join(lines)


def save_npz(arrays, path):
    """Write the arrays to `path` atomically (a temp file in the same directory, then rename)."""
    from util.atomic import atomic_write  # here: `python data/prepare.py` puts the repo on the path in main

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # numpy gets a file object, so it does not append ".npz" to the temp file's name
    arrays = {k: arrays[k] for k in ("ids", "loss", "offsets")}
    atomic_write(path, lambda f: np.savez(f, **arrays), mode="wb")


def load_npz(path):
    """Read and check a prepared file -> {"ids", "loss", "offsets"}; a clear error if malformed."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (make it with data/prepare.py)")
    with np.load(path, allow_pickle=False) as f:
        missing = {"ids", "loss", "offsets"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: missing array(s) {sorted(missing)}")
        a = {k: f[k] for k in ("ids", "loss", "offsets")}
    off = a["offsets"]
    if a["ids"].shape != a["loss"].shape or a["ids"].ndim != 1:
        raise ValueError(f"{path}: 'ids' {a['ids'].shape} and 'loss' {a['loss'].shape} must be equal 1-D")
    if off.ndim != 1 or off.size < 1 or off[0] != 0 or off[-1] != a["ids"].size or (np.diff(off) < 0).any():
        raise ValueError(f"{path}: 'offsets' must rise from 0 to len(ids)={a['ids'].size}")
    return a


def prepare_file(input_path, tok, out_path, max_len=512, max_prompt_len=None):
    """JSONL file -> .npz; prints the summary; returns the stats."""
    with open(input_path, "rb") as f:  # bytes: a garbled line is one bad row, not a crash
        arrays, stats = prepare(f, tok, max_len, max_prompt_len)  # row numbers = line numbers
    print(summary(stats, input_path))
    if stats["kept"] == 0:
        raise SystemExit(f"{input_path}: no usable rows, nothing written")
    save_npz(arrays, out_path)
    print(f"wrote {out_path}: {stats['kept']} rows, {stats['tokens']} tokens")
    return stats


def main(argv=None):
    import argparse

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True, help="JSONL file, one {'messages': [...]} per line")
    ap.add_argument("--tokenizer", required=True, help="tokenizer dir (tokenizer.json or vocab.json + "
                    "merges.txt, tokenizer_config.json)")
    ap.add_argument("--out", required=True, help="output .npz path")
    ap.add_argument("--max-len", type=int, default=512, help="skip rows longer than this (tokens)")
    ap.add_argument("--max-prompt-len", type=int, default=None, help="skip rows with a longer prompt")
    a = ap.parse_args(argv)
    prepare_file(a.input, Tokenizer.from_dir(a.tokenizer), a.out, a.max_len, a.max_prompt_len)


if __name__ == "__main__":
    main()
