"""Unit conversions: the templates of the "convert" family of the task set (issue 54).

Each template is a function rng -> (question, steps, answer): a quantity in one or two units,
the factor between them stated in the question (a 135M model's knowledge of units is not what
is measured), the worked conversion as sentences with one equation "a op b = c" per step, and
the whole-number result (a division is always exact). Two wordings per template. Graded like
the word problems: the final number (data/tasks/grade.py).

What this module does not know: splits, the reply's final line (data/tasks/__init__.py),
grading.
"""

from data.tasks.pools import person


def hours_to_minutes(rng):
    h, m = rng.randint(1, 12), rng.randint(1, 59)
    q = rng.choice([f"How many minutes are there in {h} hours and {m} minutes? An hour has 60 minutes.",
                    f"A film runs {h} h {m} min. Given 60 minutes per hour, what is its length in minutes?"])
    return q, [f"{h} hours is {h} * 60 = {h * 60} minutes.",
               f"Adding {m} minutes gives {h * 60} + {m} = {h * 60 + m} minutes."], h * 60 + m


def minutes_to_hours(rng):
    h = rng.randint(2, 99)
    q = rng.choice([f"Convert {h * 60} minutes to hours, using 60 minutes = 1 hour.",
                    f"A job took {h * 60} minutes. Since there are 60 minutes in one hour, how many hours "
                    f"did it take?"])
    return q, [f"Dividing by 60: {h * 60} / 60 = {h} hours."], h


def days_to_hours(rng):
    d, h = rng.randint(2, 20), rng.randint(1, 23)
    q = rng.choice([f"How many hours are in {d} days and {h} hours, if a day lasts 24 hours?",
                    f"A trip lasts {d} days plus {h} hours. With 24 hours in each day, give its length in "
                    f"hours."])
    return q, [f"{d} days is {d} * 24 = {d * 24} hours.",
               f"Then {d * 24} + {h} = {d * 24 + h} hours."], d * 24 + h


def weeks_to_days(rng):
    w, d = rng.randint(2, 30), rng.randint(1, 6)
    q = rng.choice([f"How many days are in {w} weeks and {d} days? A week has 7 days.",
                    f"A course runs for {w} weeks and {d} extra days. Counting 7 days per week, how many "
                    f"days is that?"])
    return q, [f"{w} weeks is {w} * 7 = {w * 7} days.",
               f"Plus {d}: {w * 7} + {d} = {w * 7 + d} days."], w * 7 + d


def km_to_meters(rng):
    k, m = rng.randint(1, 40), rng.randint(1, 999)
    q = rng.choice([f"Write {k} km and {m} m in meters. One kilometer is 1000 meters.",
                    f"A race route is {k} kilometers {m} meters long. With 1000 m in a km, how many meters "
                    f"long is it?"])
    return q, [f"{k} km is {k} * 1000 = {k * 1000} meters.",
               f"Adding {m} meters, {k * 1000} + {m} = {k * 1000 + m} meters."], k * 1000 + m


def meters_to_cm(rng):
    a, b = rng.randint(1, 30), rng.randint(1, 99)
    q = rng.choice([f"How many centimeters are in {a} meters and {b} centimeters? A meter is 100 "
                    f"centimeters.",
                    f"{person(rng).name} measures a rope of {a} m {b} cm. Using 100 cm per meter, what is "
                    f"its length in cm?"])
    return q, [f"{a} meters is {a} * 100 = {a * 100} cm.", f"Then {a * 100} + {b} = {a * 100 + b} cm."], \
        a * 100 + b


def kg_to_grams(rng):
    k, g = rng.randint(1, 25), rng.randint(1, 999)
    q = rng.choice([f"A bag weighs {k} kg and {g} g. How many grams is that? (1 kg = 1000 g)",
                    f"Express {k} kilograms {g} grams in grams, knowing a kilogram is 1000 grams."])
    return q, [f"{k} kg is {k} * 1000 = {k * 1000} grams.",
               f"With the rest, {k * 1000} + {g} = {k * 1000 + g} grams."], k * 1000 + g


def grams_to_kg(rng):
    k = rng.randint(2, 99)
    q = rng.choice([f"How many kilograms are {k * 1000} grams? There are 1000 grams in a kilogram.",
                    f"{person(rng).name}'s parcel weighs {k * 1000} g. What is that in kg, at 1000 g per "
                    f"kg?"])
    return q, [f"{k * 1000} / 1000 = {k} kilograms."], k


def liters_to_ml(rng):
    l, ml = rng.randint(1, 20), rng.randint(1, 999)
    q = rng.choice([f"How many milliliters are in {l} liters and {ml} milliliters? One liter is 1000 mL.",
                    f"A jug holds {l} L {ml} mL of juice. If 1 L equals 1000 mL, how much juice is that "
                    f"in mL?"])
    return q, [f"{l} liters is {l} * 1000 = {l * 1000} mL.",
               f"Adding {ml} mL: {l * 1000} + {ml} = {l * 1000 + ml} mL."], l * 1000 + ml


def dollars_to_cents(rng):
    d, c = rng.randint(1, 99), rng.randint(1, 99)
    q = rng.choice([f"How many cents are {d} dollars and {c} cents? A dollar is 100 cents.",
                    f"{person(rng).name} has ${d} and {c} cents in coins. With 100 cents to a dollar, "
                    f"what is the amount in cents?"])
    return q, [f"{d} dollars is {d} * 100 = {d * 100} cents.",
               f"So {d * 100} + {c} = {d * 100 + c} cents."], d * 100 + c


def feet_to_inches(rng):
    f, i = rng.randint(2, 12), rng.randint(1, 11)
    q = rng.choice([f"A shelf is {f} feet {i} inches wide. How wide is it in inches? One foot is 12 inches.",
                    f"Convert {f} ft {i} in to inches (12 inches make a foot)."])
    return q, [f"{f} feet is {f} * 12 = {f * 12} inches.", f"Then {f * 12} + {i} = {f * 12 + i} inches."], \
        f * 12 + i


def yards_to_inches(rng):
    y = rng.randint(2, 99)
    q = rng.choice([f"How many inches are in {y} yards? A yard is 3 feet and a foot is 12 inches.",
                    f"A field is {y} yards long. With 3 feet per yard and 12 inches per foot, find its "
                    f"length in inches."])
    return q, [f"{y} yards is {y} * 3 = {y * 3} feet.",
               f"At 12 inches a foot, {y * 3} * 12 = {y * 36} inches."], y * 36


def dozens_to_items(rng):
    d, e = rng.randint(2, 25), rng.randint(1, 11)
    q = rng.choice([f"A shop has {d} dozen eggs and {e} loose eggs. How many eggs is that? A dozen is 12.",
                    f"{person(rng).name} bought {d} dozen roses plus {e} single roses. Counting 12 in a "
                    f"dozen, how many roses in all?"])
    return q, [f"{d} dozen is {d} * 12 = {d * 12}.",
               f"With the others, {d * 12} + {e} = {d * 12 + e}."], d * 12 + e


def hours_to_seconds(rng):
    h, m = rng.randint(1, 12), rng.randint(1, 59)
    q = rng.choice([f"How many seconds are in {h} hours and {m} minutes? An hour has 60 minutes and a minute "
                    f"has 60 seconds.",
                    f"A battery lasts {h} hours {m} minutes. Using 60 seconds per minute and 60 minutes per "
                    f"hour, how many seconds does it last?"])
    minutes = h * 60 + m
    return q, [f"{h} hours make {h} * 60 = {h * 60} minutes.",
               f"With {m} more, {h * 60} + {m} = {minutes} minutes.",
               f"{minutes} minutes is {minutes} * 60 = {minutes * 60} seconds."], minutes * 60


def cm_to_meters(rng):
    m = rng.randint(2, 99)
    q = rng.choice([f"How many meters are {m * 100} centimeters? 100 centimeters make one meter.",
                    f"A ribbon is {m * 100} cm long. In meters, with 100 cm per meter, how long is it?"])
    return q, [f"{m * 100} / 100 = {m} meters."], m


TEMPLATES = (hours_to_minutes, minutes_to_hours, days_to_hours, weeks_to_days, km_to_meters, meters_to_cm,
             kg_to_grams, grams_to_kg, liters_to_ml, dollars_to_cents, feet_to_inches, yards_to_inches,
             dozens_to_items, hours_to_seconds, cm_to_meters)
