"""Interactive MARS chat for `python generate.py --ckpt DIR --chat` (docs/spec.md §5).

The model stays loaded; `/tau X` sets τ for the next reply (τ is a per-request number, §5),
so one session can compare AR (`/tau 1`) and multi-token replies; `/temperature X`,
`/top-p X`, `/top-k N`, `/seed N` and `/accept-metric NAME` change the sampling settings
(sampling.Sampling) the same way; `/show` switches the trace of every forward (show.py, on
stderr, before the reply) on and off. Tokens accepted in the same forward share a colour when
the output is a terminal. The conversation is kept and re-templated with the checkpoint's
chat template every turn.

The chat knows no model and no decoding rule: it gets a `decode(prompts, knob)` function
that yields decoding.Step's (generate.py builds it from the command line) and the Knob
whose τ that decoder reads before every step (and whose sampling settings and generators
it reads once per reply: the session's random stream goes on across replies; `/seed`
starts it afresh).
"""

import dataclasses
import sys
import time

from decoding import check_tau

SAMPLING_COMMANDS = {  # chat command -> (sampling.Sampling field, the value's type)
    "/temperature": ("temperature", float), "/top-p": ("top_p", float), "/top-k": ("top_k", int),
    "/seed": ("seed", int), "/accept-metric": ("accept_metric", str),
}


class Printer:
    """Streams a reply; tokens from the same forward share a colour (alternating)."""
    COLOURS = ("\033[36m", "\033[33m")

    def __init__(self, tok, eos_ids, colour):
        self.tok, self.eos_ids, self.colour = tok, set(eos_ids), colour
        self.ids, self.shown, self.n = [], "", 0
        self.generated = 0  # every token the decoder emitted, EOS included (as generate.py counts)

    def add(self, new):
        self.generated += len(new)
        self.ids += [t for t in new if t not in self.eos_ids]
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
            return
        piece, self.shown = text[len(self.shown):], text
        if self.colour and piece:
            piece = f"{self.COLOURS[self.n % 2]}{piece}\033[0m"
        self.n += 1
        print(piece, end="", flush=True)

    def flush(self):
        """End of reply: show what is still held back (an unfinished UTF-8 character)."""
        text = self.tok.decode(self.ids)
        if text != self.shown:
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text


def set_sampling(knob, line):
    """`/temperature 0.7` and the like -> the line to print. A bad value is an error message
    and leaves the settings as they were (Sampling checks itself, naming the setting)."""
    cmd, *arg = line.split()
    name, cast = SAMPLING_COMMANDS[cmd]
    try:
        value = cast(arg[0])
        knob.sampling = dataclasses.replace(knob.sampling, **{name: value})
    except IndexError:
        return f"error: {cmd} needs a value"
    except ValueError as e:
        if str(e).startswith("--"):  # Sampling's message names the flag: name the command
            return f"error: /{str(e)[2:]}"
        return f"error: {cmd} needs {'an integer' if cast is int else 'a number'}, got {arg[0]!r}"
    if name == "seed":
        knob.generators = None  # a fresh stream from the new seed at the next reply
    return f"{cmd[1:]} = {value}"


def chat(tok, decode, knob, eos_ids, header="", shown=None, show=False):
    """Interactive chat on stdin/stdout; `/tau 0.8` changes τ for the next reply (and
    `/temperature 0.7` etc. the sampling), `/show` the trace (`shown(steps, prompts, sampling)`:
    show.trace, `show` its state at the start), `/quit` leaves."""
    messages = []
    print(f"MARS chat ({header}); /tau X changes tau, /temperature X (/top-p, /top-k, /seed, "
          "/accept-metric) the sampling, /show the trace of each forward, /quit leaves")
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if line.strip() in ("/quit", "/exit"):
            return
        if line.startswith("/tau"):
            try:
                tau = float(line.split()[1])
                check_tau(tau, knob.sampling.accept_metric)
            except (IndexError, ValueError):
                print("error: /tau needs a number > 0, e.g. /tau 0.8")
                continue
            knob.tau = tau  # read by the decoder before its next step; the model stays loaded
            print(f"tau = {tau}")
            continue
        if line.strip() == "/show" and shown is not None:
            show = not show
            print(f"show = {'on' if show else 'off'}")
            continue
        if line.split()[:1] and line.split()[0] in SAMPLING_COMMANDS:
            print(set_sampling(knob, line))
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = tok.encode_chat(messages, add_generation_prompt=True)
            t0, steps = time.perf_counter(), decode([ids], knob)
            if show:  # the trace on stderr as the forwards run, then the reply
                steps = list(shown(steps, [ids], knob.sampling))
            printer, step = Printer(tok, eos_ids, sys.stdout.isatty()), None
            for step in steps:
                printer.add(step.tokens[0])
            printer.flush()
        except ValueError as e:
            messages.pop()
            print(f"error: {e}")
            continue
        dt, n = time.perf_counter() - t0, printer.generated
        messages.append({"role": "assistant", "content": tok.decode(printer.ids)})
        print(f"\n[{n} tokens, {step.forwards} forwards, {n / step.forwards:.2f} tokens/forward, "
              f"{n / dt:.1f} tokens/s]")
