"""Proofs for show.py, the trace of `generate.py --show`: it shows what ran.

Claims, each read back from the trace the command line prints (stderr, a pipe: plain text):
  * the tokens it says each forward kept, decoded and concatenated, are the reply on stdout,
    and their number is the run's token count;
  * the forwards it labels are 1 .. F, each once, F the run's count (`[N tokens, F forwards ...]`),
    for τ mode with each cache (none, window, block: whose prefill and block extensions are
    forwards of their own) and for exact mode;
  * what it says the rule did is the rule: in τ mode every candidate it marks kept (✓) past c_0
    has p >= τ and the one it marks failed (✗) p < τ; in exact mode the kept tokens are the
    drafts it marks accepted and then the bonus;
  * colour only on a terminal: escape codes there, none in a pipe; `/show` switches it in the chat.
Each run asserts that some forward kept several tokens, so none of this holds vacuously.
"""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model

from checkpoint import load_checkpoint
from generate import mars_decode
from sampling import GREEDY
from show import trace

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "hello world"
TAU = 0.5
RUNS = {  # case -> the decoding flags
    "none": ["--tau", str(TAU), "--cache", "none"],
    "window": ["--tau", str(TAU), "--cache", "window"],
    "block": ["--tau", str(TAU), "--cache", "block", "--block-cache-size", "5"],
    "exact": ["--exact", "--drafts", "3"],
}
CHAT = "hello world\n/show\nhello world\n/quit\n"  # one reply without the trace, one with it
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')  # one token as the trace quotes it (JSON)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tokenizer and a peaked random model whose LM head says little but the letters a-d (its
    other rows are zero: a logit of 0, below the live ones' maxima; id 0, `\\x00`, where all four
    are negative). So replies are ASCII, each token's text stands alone (what lets the trace's tokens
    concatenate to the reply), and with four likely words a mask often guesses the AR token: τ = 0.5
    and exact mode both keep several tokens in some forwards (as tests/test_exact.py's v8)."""
    from data.bpe import train_bpe

    path = tmp_path_factory.mktemp("show")
    tok = train_bpe(["hello world, tell me more about the blue sky"], 20)
    tok.save(path)
    hf = make_hf_model(path, seed=5, vocab_size=tok.vocab_size, initializer_range=0.6,
                       tie_word_embeddings=False)
    live = torch.zeros(tok.vocab_size, dtype=torch.bool)
    live[list(b"abcd")] = True
    with torch.no_grad():
        hf.lm_head.weight[~live] = 0
    hf.save_pretrained(str(path))
    return str(path)


def run_cli(ckpt, args):
    """generate.py on the checkpoint, B = 4, at most 16 new tokens, the reference (fp32), started."""
    base = ["generate.py", "--ckpt", ckpt, "--block-size", "4", "--max-new-tokens", "16", "--dtype",
            "float32"]
    return subprocess.Popen([sys.executable, *base, *args], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def runs(ckpt):
    """Every case's `generate.py --show`, and the chat, started at once (each pays a Python and
    torch start-up) -> {case: (returncode, stdout, stderr)}."""
    procs = {case: run_cli(ckpt, ["--prompt", PROMPT, "--show", *flags]) for case, flags in RUNS.items()}
    procs["chat"] = run_cli(ckpt, ["--chat", "--tau", str(TAU)])
    outputs = {case: p.communicate(CHAT if case == "chat" else None, timeout=300)
               for case, p in procs.items()}
    return {case: (procs[case].returncode, *outputs[case]) for case in procs}


def forwards_of(lines):
    """The forward numbers the trace labels, in order (`forward 3`, `forwards 4-5`)."""
    out = []
    for line in lines:
        m = re.match(r"forwards? (\d+)(?:-(\d+))?", line)
        if m:
            out += list(range(int(m[1]), int(m[2] or m[1]) + 1))
    return out


def kept_of(line):
    """The tokens a `→ kept` line lists, as texts."""
    return [json.loads(q) for q in QUOTED.findall(line.split("→ kept ", 1)[1])]


@pytest.mark.parametrize("case", RUNS)
def test_the_trace_is_the_run(ckpt, runs, case):
    rc, stdout, stderr = runs[case]
    assert rc == 0, stderr
    lines = stderr.splitlines()
    n_tokens, n_forwards = map(int, re.search(r"^\[(\d+) tokens, (\d+) forwards", stderr, re.M).groups())
    assert forwards_of(lines) == list(range(1, n_forwards + 1)), stderr
    kept = [kept_of(line) for line in lines if "→ kept " in line]
    assert sum(map(len, kept)) == n_tokens and max(map(len, kept)) > 1, stderr
    ck = load_checkpoint(ckpt)
    eos = {ck.tok.decode([t]) for t in ck.eos_ids}
    assert "".join(t for step in kept for t in step if t not in eos) + "\n" == stdout
    assert "\033" not in stderr  # a pipe: plain text


def test_tau_rule_as_shown_is_the_rule(runs):
    """Every ✓ candidate past c_0 has p >= τ, every ✗ p < τ, and the rule line names the ✗ one."""
    stderr = runs["window"][2]
    cells = re.findall(r"([✓✗·]) c_(\d+) \"(?:[^\"\\]|\\.)*\" ([0-9.]+)", stderr)
    assert {mark for mark, _, _ in cells} == {"✓", "✗", "·"}, stderr  # kept, failed and unseen all met
    for mark, j, p in cells:
        if mark == "✓" and j != "0":
            assert float(p) >= TAU
        if mark == "✗":
            assert float(p) < TAU and f"c_{j} p={p} < τ={TAU}: stop" in stderr


def test_exact_kept_tokens_are_the_accepted_drafts_and_the_bonus(runs):
    lines = runs["exact"][2].splitlines()
    checked = 0
    for cells, rule in zip(lines, lines[1:]):
        if "→ kept " not in rule or " d_1 " not in cells:
            continue
        accepted = [json.loads(q) for q in re.findall(r"✓ d_\d+ (\"(?:[^\"\\]|\\.)*\")", cells)]
        kept, cut = kept_of(rule), re.search(r"\((EOS|max-new-tokens): done", rule)
        assert kept[: len(accepted)] == accepted[: len(kept)], (cells, rule)
        assert len(kept) == len(accepted) + 1 or cut, (cells, rule)  # the bonus, unless the row ended
        checked += bool(accepted)
    assert checked, "no step accepted a draft"


class Terminal:
    """A stream that says it is a terminal, as stderr does in one."""
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


def test_colour_on_a_terminal_only(ckpt, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    ck = load_checkpoint(ckpt)
    ids = ck.tok.encode_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    decode = lambda: mars_decode(ck.model, [ids], block_size=4, tau=TAU, max_new_tokens=8,
                                 mask_id=ck.mask_id, eos_ids=ck.eos_ids)
    shown = {}
    for name, out in [("terminal", Terminal()), ("file", io.StringIO())]:
        shown[name] = out
        steps = [s.tokens for s in trace(decode(), [ids], GREEDY, ck.tok, ck.eos_ids, out=out)]
        assert steps == [s.tokens for s in decode()]  # the trace passes the steps on untouched
    assert "\033[" in shown["terminal"].text and "→ kept" in shown["terminal"].text
    assert "\033[" not in shown["file"].getvalue() and "→ kept" in shown["file"].getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    plain = Terminal()
    list(trace(decode(), [ids], GREEDY, ck.tok, ck.eos_ids, out=plain))
    assert "\033[" not in plain.text and "→ kept" in plain.text


def test_chat_show_switches_the_trace(runs):
    """`/show` in the chat: no trace for the first reply, one for the second, whose forwards are
    the ones its reply line counts."""
    rc, stdout, stderr = runs["chat"]
    assert rc == 0, stderr
    assert "> show = on" in stdout, stdout
    replies = re.findall(r"\[(\d+) tokens, (\d+) forwards", stdout)
    assert len(replies) == 2, stdout
    assert forwards_of(stderr.splitlines()) == list(range(1, int(replies[1][1]) + 1)), stderr
