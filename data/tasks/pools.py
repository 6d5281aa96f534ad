"""What the task templates fill their slots with: people, objects, places, and the number helpers
they share (data/tasks/: the task set of issue 54).

Every template of every split draws from these pools, as GSM8K's problems share names and
objects: what the splits keep apart is the template, its sentences and its reasoning, not the
nouns (data/tasks/__init__.py). tests/test_tasks.py masks these words out to compare the
splits' wordings. This module knows nothing of splits, replies or grading.
"""

from collections import namedtuple

Person = namedtuple("Person", "name he his him")  # a name and its pronouns ("she", "her", "her")

FEMALE = ("Mia", "Ava", "Nora", "Lily", "Emma", "Zoe", "Ruth", "Iris", "Hana", "Priya", "Sofia", "Grace",
          "Elena", "Maya", "Chloe", "Amara", "Julia", "Tara", "Ines", "Lucy")
MALE = ("Leo", "Omar", "Sam", "Ben", "Noah", "Ivan", "Kenji", "Ravi", "Tom", "Luca", "Felix", "Hugo",
        "Mateo", "Ethan", "Jonas", "Amir", "Oscar", "Theo", "Diego", "Max")
SURNAMES = ("Lee", "Patel", "Garcia", "Novak", "Kim", "Silva", "Brown", "Rossi", "Okafor", "Berg",
            "Tanaka", "Moreau", "Khan", "Weber", "Costa", "Nilsen")
CITIES = ("Oslo", "Lima", "Porto", "Denver", "Nairobi", "Kyoto", "Dublin", "Quito", "Austin", "Perth",
          "Leeds", "Seville", "Bergen", "Tucson", "Hanoi", "Krakow", "Geneva", "Cusco", "Malmo", "Bremen")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple", "gray", "silver")
FRUITS = ("apples", "oranges", "pears", "plums", "peaches", "lemons", "mangoes", "apricots")
TOYS = ("marbles", "stickers", "cards", "beads", "buttons", "shells", "stamps", "coins")
SNACKS = ("cookies", "muffins", "cupcakes", "brownies", "pretzels", "bagels", "scones", "donuts")
GOODS = ("notebooks", "pens", "folders", "mugs", "candles", "socks", "towels", "batteries", "bowls",
         "plates", "erasers", "rulers")
PLANTS = ("tomato plants", "rose bushes", "pepper plants", "tulips", "sunflowers", "carrot rows")
WORDS = FEMALE + MALE + SURNAMES + CITIES + MONTHS + COLORS + FRUITS + TOYS + SNACKS + GOODS + PLANTS


def person(rng, not_=()):
    """A random person whose name is not in `not_` (two people of one problem differ)."""
    names = [n for n in FEMALE + MALE if n not in not_]
    name = rng.choice(names)
    return Person(name, "she", "her", "her") if name in FEMALE else Person(name, "he", "his", "him")


def cap(word):
    """The word with its first letter upper-case ("she" -> "She" at a sentence's start)."""
    return word[:1].upper() + word[1:]


def code(rng, letters=2, digits=4):
    """An identifier such as "QX-4471": upper-case letters, a hyphen, digits (no leading zero)."""
    head = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXZ") for _ in range(letters))
    return f"{head}-{rng.randint(10 ** (digits - 1), 10 ** digits - 1)}"


def full_name(rng, not_=()):
    """"First Last", the first name not in `not_`."""
    return f"{person(rng, not_).name} {rng.choice(SURNAMES)}"


def date(rng):
    """A day of a month, "14 May" (days 1 to 28: every month has them)."""
    return f"{rng.randint(1, 28)} {rng.choice(MONTHS)}"
