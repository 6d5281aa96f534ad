"""What each forward proposed and what the rule kept: `generate.py --show` (`/show` in the chat),
and the lines a run ends with (docs/spec.md §5, §6, §8; docs/method.md has a trace of a trained model).

A debugger stopped in generate.accept shows one step; `--show` prints every step of a run, on
stderr (the reply alone stays on stdout, beside generate.py's other notes). In τ mode:

    forward 3 · position 31 · cache +3 → 34 " 4 ="
      ✓ c_0 "7" 0.99  ✓ c_1 "." 0.97  ✗ c_2 "\\n" 0.81  · c_3 "7" 0.95
      c_2 p=0.81 < τ=0.9: stop → kept "7" "."

the forward, the position of the step's first token (prompt included), what the forward wrote
to the KV cache (§6: the window cache writes the tokens kept the step before); the B candidates
with their confidences (✓ kept, ✗ the first to fail, · never compared); the rule that decided,
and the tokens kept (§5). Exact mode shows c_0 and the drafts the forward verified against the
AR tokens, and the bonus (§8). The block cache's prefill and block extensions are forwards that
only write the cache: a line of their own.

It decides nothing: it reads the decoders' records (decoding.Step: proposed, conf, accepted,
committed), so what it prints is what ran; it knows no model and no rule (generate.accept,
exact.verify). Coloured on a terminal, plain text in a pipe or a file (or with NO_COLOR set).
"""

import json
import os
import struct
import sys

GREEN, RED, DIM, BOLD, CYAN = "32", "31", "2", "1", "36"


class Trace:
    """The lines of each step of one run, for its prompts (lists of ids)."""

    def __init__(self, prompts, sampling, tok=None, eos_ids=(), exact=False, colour=False):
        self.seqs = [list(p) for p in prompts]  # prompt + the tokens kept so far, per row
        self.prompt_lens = [len(p) for p in prompts]
        self.cached = [0] * len(prompts)  # tokens in each row's KV cache
        self.done = [False] * len(prompts)  # finished before the step now shown
        self.forwards = 0  # forwards shown so far
        self.metric, self.greedy = sampling.accept_metric, sampling.greedy
        self.tok, self.eos_ids, self.exact, self.colour = tok, frozenset(eos_ids), exact, colour

    # ------------------------------------------------------------ text
    def paint(self, text, code):
        return f"\033[{code}m{text}\033[0m" if self.colour else text

    def word(self, t):
        """One token as its text, quoted ("\\n" escaped); its id without a tokenizer."""
        return str(t) if self.tok is None else json.dumps(self.tok.decode([t]), ensure_ascii=False)

    def words(self, ids):
        return " ".join(self.word(t) for t in ids)

    def cache_note(self, b, n):
        """`cache +n → total` and the tokens written (as one text); the prompt is named, not printed."""
        start = self.cached[b]
        self.cached[b] += n
        ids = self.seqs[b][start: start + n]
        what = "(the prompt)" if start == 0 and n == self.prompt_lens[b] else (
            json.dumps(self.tok.decode(ids), ensure_ascii=False) if self.tok else " ".join(map(str, ids)))
        return self.paint(f"cache +{n} → {self.cached[b]} {what}", CYAN)

    # ------------------------------------------------------------ one step
    def lines(self, step):
        """The lines of one decoding.Step: each row it decoded (named when the batch has several).

        The step's own forward is its last; the forwards before it (step.forwards jumps by 2) are
        the block cache's prefill or a block extension, which only write the cache; a block step
        at slot 0 with B = 1 runs no forward (c_0 comes from the stored last hidden state)."""
        first, last, out = self.forwards + 1, step.forwards, []
        self.forwards = last
        rows = [b for b in range(len(self.seqs)) if not self.done[b]]
        name = (lambda b: f" · row {b}") if len(self.seqs) > 1 else (lambda b: "")
        if last > first and step.committed:
            label = f"forward {first}" if last - first == 1 else f"forwards {first}-{last - 1}"
            out += [f"{self.paint(label, BOLD)}{name(b)} · {self.cache_note(b, step.committed[b])}"
                    for b in rows if step.committed[b]]
        for b in rows:
            position, decoded = len(self.seqs[b]), step.tokens[b] or (step.proposed and step.proposed[b])
            body = self.decision(step, b) if decoded else []  # reads the row as it was before the step
            self.seqs[b] += step.tokens[b]  # before the cache note: exact mode commits this step's tokens
            if not decoded:
                continue
            head = self.paint(f"forward {last}", BOLD) if last >= first else "no forward"
            head += f"{name(b)} · position {position}"
            if last == first and step.committed and step.committed[b]:
                head += f" · {self.cache_note(b, step.committed[b])}"
            out += [head] + [f"  {line}" for line in body]
        self.done = list(step.done)
        return out

    def decision(self, step, b):
        """What row b's forward proposed, and the rule's decision with the tokens kept."""
        kept = f"→ kept {self.paint(self.words(step.tokens[b]), GREEN)}{self.ending(step, b)}"
        if step.proposed is None:  # a decoder that records no proposal (the device loop)
            return [kept]
        body = self.exact_rule(step, b) if self.exact else self.tau_rule(step, b)
        return body[:-1] + [f"{body[-1]} {kept}"]

    def tau_rule(self, step, b):
        """τ mode (§5.2-5): the candidates (✓ kept, ✗ the first that failed, · never compared), and
        the rule: c_0 always, then c_1, c_2, ... while p >= τ (H <= τ for the entropy metric)."""
        c, n, tau = step.proposed[b], step.accepted[b], step.tau
        conf = step.conf[b] if step.conf else None  # None: AR mode compares nothing
        cells = []
        for j, t in enumerate(c):
            mark, code = ("✓", GREEN) if j < n else ("✗", RED) if j == n and conf else ("·", DIM)
            p = f" {self.number(conf[j], tau)}" if conf else ""
            cells.append(self.paint(f"{mark} c_{j} {self.word(t)}{p}", code))
        sym = {"probability": "p", "entropy": "H", "margin": "m"}[self.metric]
        entropy = self.metric == "entropy"  # a bound from above: kept while H <= τ
        if conf is None:
            rule = f"τ={tau:g}: AR mode, c_0 alone"
        elif n < len(c):
            rule = f"c_{n} {sym}={self.number(conf[n], tau)} {'>' if entropy else '<'} τ={tau:g}: stop"
        else:
            rule = f"c_1..c_{len(c) - 1} {sym} {'≤' if entropy else '≥'} τ={tau:g}" if len(c) > 1 else "B = 1"
        return ["  ".join(cells), rule]

    def exact_rule(self, step, b):
        """Exact mode (§8): c_0 and the drafts the forward verified (✓ the AR token, ✗ the first that is
        not, · never compared); the bonus after the accepted drafts is the AR token there."""
        d, a, kept = step.proposed[b], step.accepted[b] - 1, step.tokens[b]
        if step.forwards == 1:
            return ["the prefill [prompt | K masks]: c_0 is the AR token; the masks draft forward 2's d_1.."]
        cells = [f"c_0 {self.word(self.seqs[b][-1])}"] + [
            self.paint(f"{'✓' if i < a else '✗' if i == a else '·'} d_{i + 1} {self.word(t)}",
                       GREEN if i < a else RED if i == a else DIM) for i, t in enumerate(d)]
        bonus = self.word(kept[a]) if len(kept) > a else "(cut)"
        if not d:
            rule = f"no drafts: the bonus {bonus} is the AR token after c_0"
        elif a < len(d) and self.greedy:
            rule = f"d_{a + 1} {self.word(d[a])} ≠ the AR token {bonus}: rejected, {bonus} is the bonus"
        elif a < len(d):
            rule = f"d_{a + 1} rejected (speculative sampling): the bonus {bonus} drawn from the residual"
        else:
            run = "d_1" if len(d) == 1 else f"d_1..d_{len(d)}"
            rule = f"{run} accepted: the bonus {bonus} is the AR token after d_{len(d)}"
        return ["  ".join(cells), rule]

    def ending(self, step, b):
        """Why a row ends at this step: an EOS kept, or the token budget; what the rule accepted past
        the cut is dropped (decoding.Rows.keep)."""
        if not step.done[b]:
            return ""
        kept = step.tokens[b]
        why = "EOS" if kept and kept[-1] in self.eos_ids else "max-new-tokens"
        dropped = step.accepted[b] - len(kept) if step.accepted else 0
        return f" ({why}: done{f', {dropped} more dropped' if dropped > 0 else ''})"

    @staticmethod
    def number(x, tau):
        """x with 2 decimals, or more where 2 would put it on the wrong side of τ (0.8996 is not 0.90).
        τ as the rule met it: rounded to float32, as torch compares a float32 tensor with a number."""
        tau = struct.unpack("f", struct.pack("f", tau))[0]
        for digits in (2, 3, 4, 6, 9):
            text = f"{x:.{digits}f}"
            if (float(text) >= tau) == (x >= tau) and (float(text) <= tau) == (x <= tau):
                return text
        return repr(x)


def trace(steps, prompts, sampling, tok=None, eos_ids=(), exact=False, out=None):
    """A decoder's steps, shown: print each step's lines as it passes (to `out`, default stderr;
    coloured on a terminal) and pass the step on. sampling: the run's (the metric τ is compared
    with; exact mode's rule at temperature 0 or above); exact: the steps are exact_steps'."""
    out = out or sys.stderr
    shown = Trace(prompts, sampling, tok, eos_ids, exact, out.isatty() and not os.environ.get("NO_COLOR"))
    for step in steps:
        lines = shown.lines(step)
        if lines:
            print("\n".join(lines), file=out, flush=True)
        yield step


def report(results, tok, eos_ids, as_json, seconds):
    """The lines a run ends with: per prompt the reply (stdout) and its tokens, forwards and tokens
    per forward (stderr), or one JSON object (stdout); then the run's tokens per second (stderr)."""
    for r in results:
        tpf = round(len(r.ids) / r.forwards, 4)
        record = {"ids": r.ids, "forwards": r.forwards, "tokens_per_forward": tpf}
        if tok is not None:
            record["text"] = tok.decode([t for t in r.ids if t not in eos_ids])
        if as_json:
            print(json.dumps(record))
        else:
            print(record.get("text", " ".join(map(str, r.ids))))
            print(f"[{len(r.ids)} tokens, {r.forwards} forwards, {record['tokens_per_forward']:.2f} "
                  "tokens/forward]", file=sys.stderr)
    n = sum(len(r.ids) for r in results)
    print(f"[{n} tokens in {seconds:.2f}s: {n / seconds:.1f} tokens/s]", file=sys.stderr)
