"""Reading the files of a checkpoint or data directory: one error for a broken one.

Every file the project reads from a checkpoint or data directory (config.json, the
safetensors weights, mars.json, generation_config.json, the tokenizer files,
train_state.pt, train.npz / val.npz) is checked where it is read, and a broken one raises
`BadFileError(path, what)`, whose message is `PATH: what is wrong` (truncated, not JSON,
a key of the wrong type, a missing key, ...). It is a ValueError, so the CLIs report it
where they report a user's other mistakes: `error: PATH: ...` and a non-zero exit, no
traceback. What each file must hold is for its reader to say; this module only gives
the words.
"""

import json
from contextlib import contextmanager
from dataclasses import fields

from safetensors import SafetensorError, safe_open


class BadFileError(ValueError):
    """A file the project reads is broken; `path` names it, `what` says what is wrong."""

    def __init__(self, path, what):
        super().__init__(f"{path}: {what}")
        self.path, self.what = str(path), str(what)


def read_json_object(path) -> dict:
    """The JSON object in `path` (which must exist); BadFileError if it is empty, not UTF-8,
    not JSON, or JSON but not an object."""
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise BadFileError(path, "empty file (expected a JSON object)")
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data":  # cut short in the middle of a character
            raise BadFileError(path, "not valid JSON (cut short inside a UTF-8 character)") from None
        raise BadFileError(path, f"not UTF-8 text (byte {e.start}; expected a JSON object)") from None
    except ValueError as e:  # json.JSONDecodeError: cut short, or not JSON at all
        raise BadFileError(path, f"not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise BadFileError(path, f"expected a JSON object, got a {type(d).__name__}")
    return d


def open_safetensors(file, device="cpu"):
    """safe_open (a context manager); a file cut short, empty or not safetensors at all is a
    BadFileError (safetensors checks the header and that the data covers it, here)."""
    try:
        return safe_open(file, framework="pt", device=str(device))
    except SafetensorError as e:
        raise BadFileError(file, f"not a readable safetensors file ({e})") from None


def checked(path, key, value, kind, low=None):
    """`value` of `key` in `path` when it is a `kind` (a bool is no int; an int passes for a
    float) and, given `low`, at least `low`; else BadFileError naming the key."""
    ok = isinstance(value, (int, float) if kind is float else kind)
    if not ok or (isinstance(value, bool) and kind is not bool):
        raise BadFileError(path, f"key {key!r} must be {'an' if kind is int else 'a'} {kind.__name__}, "
                                 f"got {value!r}")
    if low is not None and value < low:
        raise BadFileError(path, f"key {key!r} must be >= {low}, got {value!r}")
    return value


def check_fields(path, d, cls, positive=()):
    """Every key of `d` that is a field of dataclass `cls` with an int, float or bool default
    holds a value of that type; those named in `positive` are >= 1."""
    for f in fields(cls):
        if f.name in d and isinstance(f.default, (int, float)):  # bool is an int too
            checked(path, f.name, d[f.name], type(f.default), 1 if f.name in positive else None)


@contextmanager
def reading(path):
    """Around code that trusts a file's layout: a KeyError, TypeError, AttributeError or
    IndexError inside (the file has another layout than the code expects) and a
    UnicodeDecodeError become BadFileError naming `path`."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError) as e:
        if isinstance(e, UnicodeDecodeError):
            raise BadFileError(path, "not UTF-8 text") from None
        raise BadFileError(path, f"unexpected content ({type(e).__name__}: {e})") from None


# what a command line reports as `error: MESSAGE` and a non-zero exit, not a traceback: a
# broken or missing file (BadFileError is a ValueError), a bad option or setting
USER_ERRORS = (ValueError, OSError, KeyError)


def error_line(e) -> str:
    """`error: MESSAGE` for one of USER_ERRORS (a KeyError's message without repr's quotes)."""
    return f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}"
