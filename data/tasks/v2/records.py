"""Extraction of one field from a short paragraph, task set v2 (issue 61): record frames composed
with the field asked.

A template is a pair (frame, field). A FRAME is a kind of record (a dentist appointment, a
train, a vet visit, ...): how to draw its values, two wordings of its paragraph, and for each
of its three fields a question and the one-sentence solution that points at the value. The
answer is the value's text as it stands in the paragraph (a name, a city, a code such as
"QX-4471", a date, a time, a number), graded as a string (data/tasks/v2/grade.py). No value
holds a period, so "The answer is X." ends where X ends.

What this module does not know: splits (data/tasks/v2/__init__.py), the reply's final line,
grading.
"""

from collections import namedtuple

from data.tasks.pools import CITIES, COLORS, code, date, full_name

Record = namedtuple("Record", "draw texts asks")  # asks: field -> (question, solution sentence)

PETS = ("Biscuit", "Pepper", "Luna", "Milo", "Coco", "Rex", "Daisy", "Oreo", "Ziggy", "Maple")
SPECIES = ("cat", "dog", "rabbit", "parrot", "hamster", "tortoise")
DISHES = ("lentil soup", "apple cake", "fish pie", "corn bread", "bean stew", "plum tart", "onion quiche")
TITLES = ("Rivers of Light", "The Silent Forest", "Paper Cities", "Iron and Glass", "Winter Birds",
          "Faces of the Sea")
ROLES = ("data analyst", "night nurse", "bus driver", "line cook", "web designer", "lab assistant")
UNITS = ("Sales", "Finance", "Research", "Support", "Design", "Logistics")


def clock(rng):
    return f"{rng.randint(7, 21):02d}:{rng.choice(['00', '15', '30', '45'])}"


FRAMES = {
    "dentist": Record(
        lambda rng: {"patient": full_name(rng), "date": date(rng), "time": clock(rng)},
        ("{patient} has a dentist appointment on {date} at {time}.",
         "Reminder: the dental checkup for {patient} is at {time} on {date}."),
        {"patient": ("Who is the patient?", "The patient is {patient}."),
         "date": ("On what date is the appointment?", "The appointment is on {date}."),
         "time": ("At what time is the appointment?", "It is at {time}.")}),
    "train": Record(
        lambda rng: {"train": code(rng, 2, 3), "platform": str(rng.randint(1, 12)),
                     "city": rng.choice(CITIES), "time": clock(rng)},
        ("Train {train} to {city} leaves from platform {platform} at {time}.",
         "Platform {platform}: the {time} train {train}, calling at {city}."),
        {"train": ("What is the train's number?", "The train is {train}."),
         "platform": ("Which platform does the train leave from?", "It leaves from platform {platform}."),
         "city": ("Where is the train going?", "The train goes to {city}.")}),
    "vet": Record(
        lambda rng: {"pet": rng.choice(PETS), "owner": full_name(rng), "species": rng.choice(SPECIES)},
        ("{owner} brought {pet}, a {species}, to the vet.",
         "The vet saw a {species} named {pet}; its owner is {owner}."),
        {"pet": ("What is the pet's name?", "The pet is called {pet}."),
         "owner": ("Who owns the pet?", "The owner is {owner}."),
         "species": ("What kind of animal is the pet?", "The pet is a {species}.")}),
    "bike": Record(
        lambda rng: {"ticket": code(rng, 1, 4), "color": rng.choice(COLORS), "date": date(rng)},
        ("Bike repair ticket {ticket}: a {color} bike, ready on {date}.",
         "The {color} bike under ticket {ticket} will be fixed by {date}."),
        {"ticket": ("What is the repair ticket's number?", "The ticket is {ticket}."),
         "color": ("What color is the bike?", "The bike is {color}."),
         "date": ("When will the bike be ready?", "It will be ready on {date}.")}),
    "trip": Record(
        lambda rng: {"group": f"{rng.randint(1, 9)}{rng.choice('ABCD')}", "city": rng.choice(CITIES),
                     "date": date(rng), "teacher": full_name(rng)},
        ("Class {group} visits {city} on {date} with {teacher}.",
         "On {date}, {teacher} takes class {group} on a trip to {city}."),
        {"group": ("Which class goes on the trip?", "The class is {group}."),
         "city": ("Which city does the class visit?", "The class visits {city}."),
         "teacher": ("Which teacher leads the trip?", "The trip is led by {teacher}.")}),
    "recipe": Record(
        lambda rng: {"dish": rng.choice(DISHES), "minutes": str(rng.randint(15, 90)),
                     "temp": str(rng.randint(16, 24) * 10)},
        ("Bake the {dish} at {temp} degrees for {minutes} minutes.",
         "Recipe card: {dish}, {minutes} minutes in the oven at {temp} degrees."),
        {"dish": ("Which dish does the recipe make?", "The dish is {dish}."),
         "minutes": ("How many minutes does it bake?", "It bakes for {minutes} minutes."),
         "temp": ("At how many degrees does it bake?", "The oven is at {temp} degrees.")}),
    "weather": Record(
        lambda rng: {"city": rng.choice(CITIES), "high": str(rng.randint(-5, 35)),
                     "wind": f"{rng.randint(5, 60)} km/h"},
        ("Tomorrow in {city}: a high of {high} degrees and winds of {wind}.",
         "Forecast for {city}, high {high} degrees, wind {wind}."),
        {"city": ("Which city is the forecast for?", "The forecast is for {city}."),
         "high": ("What is the high temperature in degrees?", "The high is {high} degrees."),
         "wind": ("How strong is the wind?", "The wind is {wind}.")}),
    "locker": Record(
        lambda rng: {"locker": str(rng.randint(1, 300)), "pin": str(rng.randint(1000, 9999)),
                     "city": rng.choice(CITIES)},
        ("Your parcel is in locker {locker} at {city} station; the PIN is {pin}.",
         "PIN {pin} opens locker {locker} at the {city} station."),
        {"locker": ("Which locker holds the parcel?", "The parcel is in locker {locker}."),
         "pin": ("What is the PIN?", "The PIN is {pin}."),
         "city": ("At which city's station is the locker?", "The locker is at {city} station.")}),
    "exhibit": Record(
        lambda rng: {"title": rng.choice(TITLES), "hall": f"Hall {rng.choice('ABCDEFG')}",
                     "curator": full_name(rng)},
        ("The exhibition {title} opens in {hall}, curated by {curator}.",
         "{curator} curates {title}, which is on show in {hall}."),
        {"title": ("What is the exhibition called?", "The exhibition is {title}."),
         "hall": ("Where is the exhibition shown?", "It is shown in {hall}."),
         "curator": ("Who curates the exhibition?", "The curator is {curator}.")}),
    "job": Record(
        lambda rng: {"role": rng.choice(ROLES), "unit": rng.choice(UNITS), "city": rng.choice(CITIES)},
        ("Wanted: a {role} for the {unit} team in {city}.",
         "The {unit} team in {city} is hiring a {role}."),
        {"role": ("What job is offered?", "The job is {role}."),
         "unit": ("Which team is hiring?", "The team is {unit}."),
         "city": ("In which city is the job?", "The job is in {city}.")}),
    "talk": Record(
        lambda rng: {"speaker": full_name(rng), "room": f"Room {rng.randint(1, 30)}", "time": clock(rng)},
        ("{speaker} gives a talk in {room} at {time}.",
         "At {time}, {room} hosts a talk by {speaker}."),
        {"speaker": ("Who gives the talk?", "The speaker is {speaker}."),
         "room": ("Where is the talk?", "The talk is in {room}."),
         "time": ("At what time is the talk?", "The talk starts at {time}.")}),
    "transfer": Record(
        lambda rng: {"sender": full_name(rng), "ref": code(rng, 3, 4), "date": date(rng)},
        ("On {date}, {sender} sent a bank transfer with reference {ref}.",
         "Transfer {ref} from {sender} arrived on {date}."),
        {"sender": ("Who sent the transfer?", "The sender is {sender}."),
         "ref": ("What is the transfer's reference?", "The reference is {ref}."),
         "date": ("On what date was the transfer?", "The date is {date}.")}),
}


def make(rng, frame_name, field):
    """One problem of the template (frame, field) -> (question, steps, answer)."""
    r = FRAMES[frame_name]
    values = r.draw(rng)
    question, evidence = r.asks[field]
    return f"{rng.choice(r.texts).format(**values)}\n\n{question}", [evidence.format(**values)], values[field]
