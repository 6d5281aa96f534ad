"""Unit conversions of task set v2 (issue 61): unit frames composed with conversion chains.

A template is a pair (frame, chain). A FRAME is a pair of units and the factor between them,
at most 12 (a week is 7 days, a foot 12 inches, a gallon 4 quarts, ...), stated in the question
in one of two wordings (what a 135M model knows of units is not what is measured), and a
sentence that measures something in them. A CHAIN is the shape of the conversion:

  to_small   a big units in small ones               a * f
  to_big     y small units in big ones               y / f (exact)
  mixed      a big and r small units in small ones   a * f, + r
  less       a big units less r small ones           a * f, - r
  sum        a big plus b big units in small ones    a + b, * f

The solution is one line per step, one equation "a op b = c" each. Ranges, for the reason of
data/tasks/v2/frames.py (the 135M model's errors beyond the times table): a count of big units
2..9 with a * f + f <= 99 (so a sum or a difference with r < f stays under 100), r in 1..f-1,
a quotient 2..9, and a + b <= 9 before a product.

What this module does not know: splits (data/tasks/v2/__init__.py), the reply's final line,
grading (data/tasks/v2/grade.py).
"""

from collections import namedtuple

from data.tasks.pools import person

Unit = namedtuple("Unit", "big bigs small smalls factor facts measure")  # measure: "... {q} ..."

FRAMES = {
    "weeks": Unit("week", "weeks", "day", "days", 7, ("A week has 7 days.", "There are 7 days in one week."),
                  "{n}'s trip lasts {q}."),
    "feet": Unit("foot", "feet", "inch", "inches", 12,
                 ("A foot is 12 inches.", "There are 12 inches in one foot."), "{n}'s shelf is {q} long."),
    "yards": Unit("yard", "yards", "foot", "feet", 3, ("A yard is 3 feet.", "One yard equals 3 feet."),
                  "{n}'s garden path is {q} long."),
    "dozens": Unit("dozen", "dozen", "egg", "eggs", 12, ("A dozen is 12 eggs.", "One dozen means 12 eggs."),
                   "{n} buys {q} at the farm."),
    "gallons": Unit("gallon", "gallons", "quart", "quarts", 4,
                    ("A gallon is 4 quarts.", "There are 4 quarts in a gallon."),
                    "{n}'s tank holds {q} of water."),
    "quarts": Unit("quart", "quarts", "pint", "pints", 2,
                   ("A quart is 2 pints.", "One quart equals 2 pints."), "{n}'s pot holds {q} of soup."),
    "quarters": Unit("dollar", "dollars", "quarter", "quarters", 4,
                     ("A dollar is 4 quarters.", "One dollar is worth 4 quarters."), "{n} has {q} in coins."),
    "dimes": Unit("dollar", "dollars", "dime", "dimes", 10,
                  ("A dollar is 10 dimes.", "It takes 10 dimes to make a dollar."),
                  "{n}'s jar holds {q} in change."),
    "centimeters": Unit("centimeter", "centimeters", "millimeter", "millimeters", 10,
                        ("A centimeter is 10 millimeters.", "There are 10 millimeters in a centimeter."),
                        "{n}'s pencil is {q} long."),
    "years": Unit("year", "years", "month", "months", 12,
                  ("A year has 12 months.", "There are 12 months in one year."), "{n}'s lease runs for {q}."),
    "decades": Unit("decade", "decades", "year", "years", 10,
                    ("A decade is 10 years.", "One decade lasts 10 years."),
                    "{n}'s old town hall has stood {q}."),
    "packs": Unit("pack", "packs", "can", "cans", 6, ("A pack holds 6 cans.", "Each pack has 6 cans in it."),
                  "{n} buys {q} of juice."),
    "nickels": Unit("nickel", "nickels", "cent", "cents", 5,
                    ("A nickel is worth 5 cents.", "One nickel equals 5 cents."), "{n}'s purse holds {q}."),
    "hands": Unit("hand", "hands", "inch", "inches", 4,
                  ("A hand is 4 inches.", "Horses are measured in hands, and one hand is 4 inches."),
                  "{n}'s pony is {q} tall."),
}
CHAINS = ("to_small", "to_big", "mixed", "less", "sum")


def of(k, one, many):
    return f"{k} {one if k == 1 else many}"


def make(rng, frame_name, chain):
    """One problem of the template (frame, chain) -> (question, steps, answer)."""
    u, name = FRAMES[frame_name], person(rng).name
    f, fact = u.factor, rng.choice(u.facts)
    a, r = rng.randint(2, min(9, (99 - f) // f)), rng.randint(1, f - 1)
    big, small = lambda k: of(k, u.big, u.bigs), lambda k: of(k, u.small, u.smalls)  # noqa: E731
    measure = lambda q: u.measure.format(n=name, q=q)  # noqa: E731
    first = f"{big(a)} is {a} * {f} = {small(a * f)}."
    if chain == "to_small":
        q = rng.choice([f"{fact} How many {u.smalls} are in {big(a)}?",
                        f"{measure(big(a))} {fact} How many {u.smalls} is that?"])
        return q, [first], a * f
    if chain == "to_big":
        k = rng.randint(2, 9)
        q = rng.choice([f"{fact} How many {u.bigs} are in {small(k * f)}?",
                        f"{measure(small(k * f))} {fact} How many {u.bigs} is that?"])
        return q, [f"{small(k * f)} is {k * f} / {f} = {big(k)}."], k
    if chain == "mixed":
        q = rng.choice([f"{fact} How many {u.smalls} are in {big(a)} and {small(r)}?",
                        f"{measure(f'{big(a)} and {small(r)}')} {fact} How many {u.smalls} is that in all?"])
        return q, [first, f"Adding {small(r)}: {a * f} + {r} = {small(a * f + r)}."], a * f + r
    if chain == "less":
        q = rng.choice([f"{fact} What is {big(a)} minus {small(r)}, in {u.smalls}?",
                        f"{measure(big(a))} {fact} If {small(r)} {'is' if r == 1 else 'are'} taken off, "
                        f"how many {u.smalls} are left?"])
        return q, [first, f"Taking away {small(r)}: {a * f} - {r} = {small(a * f - r)}."], a * f - r
    a = rng.randint(2, 7)
    b = rng.randint(2, 9 - a)  # a + b <= 9
    q = rng.choice([f"{fact} How many {u.smalls} are in {big(a)} plus {big(b)}?",
                    f"{measure(big(a))} Then {big(b)} more are added. {fact} How many {u.smalls} is that "
                    f"in all?"])
    return q, [f"{a} + {b} = {big(a + b)}.", f"{big(a + b)} is {a + b} * {f} = {small((a + b) * f)}."], \
        (a + b) * f
