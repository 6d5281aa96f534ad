"""The graders of the task set (issue 54): is a model's reply to a problem right?

Every reply of the task set ends with one fixed line, "The answer is X." (data/tasks/), and a
grader reads only that sentence:

  final_answer(reply)    X of the LAST "The answer is X." (case-insensitive, an optional ":"
                         after "is", "**" bold marks ignored), X being what stands before the
                         first period that ends the sentence (a period followed by a space, a
                         newline or the end); None when there is no such sentence. A reply cut
                         before that period ("The answer is 12", "The answer is Osl") has no
                         answer: it is wrong whatever the expected value
  grade_number           "gsm" and "convert": X is one number, an optional "$" before it, commas
                         only as thousands separators ("1,200"; "1,20" is not a number), an
                         optional decimal part, optional unit words after it ("18 apples");
                         right when it equals the expected number (1200 = 1200.0 = $1,200)
  grade_exact            "extract": X, without wrapping quotes and with runs of spaces read as
                         one, equals the expected string exactly (case included)

A grader sees text only: a reply stopped by the length cap right after a complete answer
sentence counts as answered (the task set's answers hold no period, so that sentence is the
whole answer). What this module does not know: how problems are made (data/tasks/), models.
"""

import re
from decimal import Decimal

ANSWER_RE = re.compile(r"the answer is:?[ \t]*", re.IGNORECASE)
SENTENCE_RE = re.compile(r"(.*?)\.(?=\s|$)")  # up to the first period that ends a sentence
NUMBER_RE = re.compile(r"\$?\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?:\s+[A-Za-z][A-Za-z ]*)?")
QUOTES = {'"': '"', "'": "'", "\u201c": "\u201d", "`": "`"}


def final_answer(reply):
    """X of the reply's last complete "The answer is X." sentence, or None (module docstring)."""
    found = list(ANSWER_RE.finditer(reply))
    if not found:
        return None
    rest = reply[found[-1].end():].split("\n")[0].replace("**", "")
    m = SENTENCE_RE.match(rest)
    return m.group(1).strip() if m else None


def grade_number(reply, expected):
    """Right when the final answer is one number equal to `expected` (an int or its text)."""
    x = final_answer(reply)
    m = NUMBER_RE.fullmatch(x) if x is not None else None
    return m is not None and Decimal(m.group(1).replace(",", "")) == Decimal(str(expected))


def grade_exact(reply, expected):
    """Right when the final answer, unquoted and with single spaces, is exactly `expected`."""
    x = final_answer(reply)
    if x is None:
        return False
    if len(x) >= 2 and QUOTES.get(x[0]) == x[-1]:
        x = x[1:-1]
    return " ".join(x.split()) == expected


GRADERS = {"gsm": grade_number, "convert": grade_number, "extract": grade_exact}


def is_correct(problem, reply):
    """The grader of the problem's family on a reply's text."""
    return GRADERS[problem["family"]](reply, problem["answer"])
