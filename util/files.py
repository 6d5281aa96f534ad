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
import os
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


def weight_files(path):
    """Map every tensor name of an HF-layout directory to the safetensors file that holds it
    (model.safetensors, or the shards of model.safetensors.index.json)."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        with open_safetensors(single) as f:
            return {k: single for k in f.keys()}
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise BadFileError(index, "no 'weight_map' object of tensor name -> file name")
        out = {}
        for key, name in weight_map.items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index}: shard {name!r} (for {key!r}) not found")
            out[key] = file
        return out
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                            "(only safetensors weights are loaded)")


def check_hf_config(d: dict, model_type: str, source: str):
    """Refuse the config.json settings that change model.py's computation and that it does not
    build (`source` names the file)."""
    if d.get("use_sliding_window"):
        raise BadFileError(source, "use_sliding_window=true is not supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise BadFileError(source, f"unsupported rope type {rope!r}")
    if d.get("hidden_act", "silu") != "silu":
        raise BadFileError(source, f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
    if model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise BadFileError(source, f"{key}=true is not supported for a llama model "
                                           "(only Llama without biases)")
        if d.get("pretraining_tp", 1) != 1:
            raise BadFileError(source, f"pretraining_tp={d['pretraining_tp']} is not supported")


def read_weights(path, expected, dtype, device="cpu", skip=(), what="the model"):
    """The tensors of an HF-layout directory (weight_files) as {name: tensor in `dtype`}: every
    name of `expected` ({name: shape}) with that shape, names in `skip` ignored; an unexpected,
    missing or misshapen tensor is an error naming the file and the key."""
    by_file, state = {}, {}
    for key, file in weight_files(path).items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with open_safetensors(file, device) as f:
            for key in keys:
                if key in skip:
                    continue
                if key not in expected:
                    raise KeyError(f"{file}: unexpected key {key!r} (not a parameter of {what})")
                t = f.get_tensor(key)
                if t.shape != expected[key]:
                    raise ValueError(f"{file}: tensor {key!r} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(expected[key])} from config.json")
                state[key] = t.to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise KeyError(f"{path}: missing weight(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return state
