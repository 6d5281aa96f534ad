"""The graders of task set v2 (issue 61): is a model's reply right, whatever the form of its answer?

The v1 graders (data/tasks/grade.py, which committed pages regrade with: unchanged) read
"The answer is X." only. A model fine-tuned for a short while, or a base model, also writes
"Answer: X", "The final answer is X", "**X**", "18 apples" or "$18"; these graders take the
same answer in those forms, and a reply cut by the length cap stays wrong.

  final_answer(reply, stopped)   X of the LAST answer cue of the reply: "the answer is",
                  "the final answer is" or "answer:" (any case, an optional ":" after "is", "**"
                  bold marks ignored everywhere). X is the rest of the cue's line up to the first
                  period that ends a sentence (a period followed by a space or the end), or
                  the whole rest of the line when that line is followed by a newline or when
                  `stopped` (the reply ended by itself, not at the length cap). None when there
                  is no cue, or when the reply ends in the cue's line without that period and
                  not `stopped`: "The answer is 1" cut where "8." would have followed is no
                  answer, whatever the expected value. The caller that knows a reply stopped at
                  its end-of-turn token (not the cap) says so, and "Answer: 18" at the end counts
  grade_number    "gsm" and "convert": X is one number, an optional "$" before it, commas only
                  as thousands separators ("1,20" is not a number), an optional decimal part,
                  optional words after it ("18 apples", "18 dollars"); right when it equals the
                  expected number (18 = 18.0 = $18)
  grade_exact     "extract": X, without wrapping quotes ("", '', curly ones, ``) and with runs
                  of spaces read as one, equals the expected string IGNORING CASE ("oslo" is
                  Oslo): every field of data/tasks/v2/records.py differs from the others of its
                  paragraph by more than case, so case cannot make a wrong field right

A period inside a number ("3.5") does not end the sentence, so "The answer is 3." cut where
"5." would have followed reads as 3 (the v1 rule too; v2's answers are whole numbers and
period-free strings). What this module does not know: how problems are made
(data/tasks/v2/), models.
"""

import re
from decimal import Decimal

CUE_RE = re.compile(r"\b(?:the\s+(?:final\s+)?answer\s+is\b\s*:?|answer\s*:)[ \t]*", re.IGNORECASE)
SENTENCE_RE = re.compile(r"(.*?)\.(?=\s|$)")  # up to the first period that ends a sentence
NUMBER_RE = re.compile(r"(?:\$\s*)?(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?:\s*[A-Za-z][A-Za-z ]*)?")
QUOTES = {'"': '"', "'": "'", "\u201c": "\u201d", "\u2018": "\u2019", "`": "`"}


def final_answer(reply, stopped=False):
    """X of the reply's last answer cue, or None (module docstring)."""
    text = reply.replace("**", "")
    found = list(CUE_RE.finditer(text))
    if not found:
        return None
    line, newline, _ = text[found[-1].end():].partition("\n")
    m = SENTENCE_RE.match(line)
    if m:
        x = m.group(1)
    elif newline or stopped:
        x = line
    else:
        return None  # cut in the answer's line
    return x.strip() or None


def grade_number(reply, expected, stopped=False):
    """Right when the final answer is one number equal to `expected` (an int or its text)."""
    x = final_answer(reply, stopped)
    m = NUMBER_RE.fullmatch(x) if x is not None else None
    return m is not None and Decimal(m.group(1).replace(",", "")) == Decimal(str(expected))


def grade_exact(reply, expected, stopped=False):
    """Right when the final answer, unquoted, with single spaces, is `expected` ignoring case."""
    x = final_answer(reply, stopped)
    if x is None:
        return False
    if len(x) >= 2 and QUOTES.get(x[0]) == x[-1]:
        x = x[1:-1]
    return " ".join(x.split()).casefold() == " ".join(str(expected).split()).casefold()


GRADERS = {"gsm": grade_number, "convert": grade_number, "extract": grade_exact}


def is_correct(problem, reply, stopped=False):
    """The grader of the problem's family on a reply's text."""
    return GRADERS[problem["family"]](reply, problem["answer"], stopped)
