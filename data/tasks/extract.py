"""Extraction of one field from a short paragraph: the templates of the "extract" family of the
task set (issue 54).

Each template is a function rng -> (question, steps, answer): a paragraph about one record
(a parcel, a flight, a booking, ...) in one of two wordings, then a question about one of its
fields; the solution is one sentence that points at the field, and the answer is the field's
exact text (a name, a city, a code such as "QX-4471", a date, a time), graded by exact string
(data/tasks/grade.py). No value holds a period, so "The answer is X." ends where X ends.

What this module does not know: splits, the reply's final line (data/tasks/__init__.py),
grading.
"""

from data.tasks.pools import CITIES, COLORS, code, date, full_name

DEPARTMENTS = ("Sales", "Finance", "Research", "Support", "Design", "Logistics", "Legal", "Marketing")
GENRES = ("mystery", "history", "poetry", "travel", "science", "cooking", "biography", "fantasy")
BANDS = ("The Night Owls", "Blue Lantern", "Paper Moons", "The Quiet Riot", "Green Static", "Salt and Stone")


def ask(rng, paragraph, asks):
    """One of the (question, answer, evidence) of `asks` about `paragraph` -> (question, steps, answer)."""
    question, answer, evidence = rng.choice(asks)
    return f"{paragraph}\n\n{question}", [evidence], answer


def two_cities(rng):
    a, b = rng.sample(CITIES, 2)
    return a, b


def clock(rng):
    return f"{rng.randint(6, 22):02d}:{rng.choice(['00', '15', '30', '45'])}"


def parcel(rng):
    c, who, (a, b), d = code(rng), full_name(rng), two_cities(rng), date(rng)
    text = rng.choice([f"Parcel {c} was sent by {who} from {a} to {b} on {d}.",
                       f"On {d}, {who} shipped parcel {c}; it left {a} bound for {b}."])
    return ask(rng, text, [("Which city was the parcel sent from?", a, f"The parcel left from {a}."),
                           ("Who sent the parcel?", who, f"The sender is {who}."),
                           ("What is the parcel's tracking code?", c, f"The tracking code is {c}."),
                           ("Where is the parcel going?", b, f"Its destination is {b}.")])


def flight(rng):
    c, (a, b), t = code(rng, 2, 3), two_cities(rng), clock(rng)
    gate = f"{rng.choice('ABCDE')}{rng.randint(1, 40)}"
    text = rng.choice([f"Flight {c} to {b} departs from {a} at {t}. Boarding is at gate {gate}.",
                       f"Passengers for {b} should go to gate {gate}: flight {c} leaves {a} at {t} sharp."])
    return ask(rng, text, [("At what time does the flight depart?", t, f"The departure time is {t}."),
                           ("Which gate is the flight boarding at?", gate, f"Boarding is at gate {gate}."),
                           ("What is the flight number?", c, f"The flight number is {c}."),
                           ("What is the flight's destination?", b, f"The flight goes to {b}.")])


def hotel_booking(rng):
    who, nights, room = full_name(rng), rng.randint(2, 14), str(rng.randint(101, 950))
    ref, d = code(rng, 3, 5), date(rng)
    text = rng.choice([f"Booking {ref}: {who} checks in on {d} for {nights} nights and stays in room {room}.",
                       f"The guest {who} arrives on {d}. Room {room} is held for {nights} nights under "
                       f"reference {ref}."])
    return ask(rng, text, [("What is the guest's room number?", room, f"The room is number {room}."),
                           ("How many nights is the stay?", str(nights), f"The stay is {nights} nights."),
                           ("What is the booking reference?", ref, f"The reference is {ref}."),
                           ("On which date does the guest check in?", d, f"The check-in date is {d}.")])


def staff_record(rng):
    who, dept, city, badge = full_name(rng), rng.choice(DEPARTMENTS), rng.choice(CITIES), code(rng, 1, 5)
    text = rng.choice([f"{who} works in the {dept} department at the {city} office and wears badge {badge}.",
                       f"Staff card {badge} belongs to {who}, who joined {dept} and is based in {city}."])
    return ask(rng, text, [("Which department does the employee work in?", dept,
                            f"The department named is {dept}."),
                           ("What is the employee's badge number?", badge, f"The badge is {badge}."),
                           ("In which city is the employee's office?", city, f"The office is in {city}."),
                           ("What is the employee's full name?", who, f"The employee is {who}.")])


def car_rental(rng):
    who, color, plate = full_name(rng), rng.choice(COLORS), code(rng, 3, 3)
    city, d = rng.choice(CITIES), date(rng)
    text = rng.choice([f"{who} rented a {color} car with plate {plate} in {city}. It must be returned by "
                       f"{d}.",
                       f"Rental note: a {color} car, plate {plate}, picked up in {city} by {who}; due back "
                       f"{d}."])
    return ask(rng, text, [("What color is the rented car?", color, f"The car is {color}."),
                           ("What is the car's plate?", plate, f"The plate reads {plate}."),
                           ("By what date must the car be returned?", d, f"It is due back on {d}."),
                           ("Who rented the car?", who, f"The renter is {who}.")])


def concert(rng):
    band, city, d, seat, ticket = rng.choice(BANDS), rng.choice(CITIES), date(rng), \
        f"row {rng.randint(1, 30)} seat {rng.randint(1, 40)}", code(rng, 2, 6)
    text = rng.choice([f"{band} play in {city} on {d}. Ticket {ticket} is for {seat}.",
                       f"Ticket {ticket} admits one to hear {band} on {d} in {city}, {seat}."])
    return ask(rng, text, [("Which band is playing?", band, f"The band is {band}."),
                           ("In which city is the concert?", city, f"The concert is in {city}."),
                           ("Which seat does the ticket give?", seat, f"The ticket is for {seat}."),
                           ("What is the ticket code?", ticket, f"The ticket code is {ticket}.")])


def lab_sample(rng):
    sample, who, temp, d = code(rng, 2, 4), full_name(rng), str(rng.randint(2, 9) * -10), date(rng)
    room = f"Lab {rng.randint(1, 12)}"
    text = rng.choice([f"Sample {sample} was taken by {who} on {d} and stored at {temp} degrees in {room}.",
                       f"{room} keeps sample {sample} at {temp} degrees; {who} collected it on {d}."])
    return ask(rng, text, [("Who collected the sample?", who, f"It was collected by {who}."),
                           ("At what temperature is the sample stored?", temp,
                            f"It is kept at {temp} degrees."),
                           ("Where is the sample kept?", room, f"The sample is in {room}."),
                           ("What is the sample's ID?", sample, f"The sample ID is {sample}.")])


def library_loan(rng):
    who, card, genre, d = full_name(rng), str(rng.randint(100000, 999999)), rng.choice(GENRES), date(rng)
    text = rng.choice([f"Member {who}, card {card}, borrowed a {genre} book that is due on {d}.",
                       f"A {genre} title is out on card {card}, which belongs to {who}; return it by {d}."])
    return ask(rng, text, [("When is the book due?", d, f"The due date is {d}."),
                           ("What is the card number?", card, f"The card number is {card}."),
                           ("What kind of book was borrowed?", genre, f"The book is a {genre} book."),
                           ("Who is the member?", who, f"The member is {who}.")])


def team_match(rng):
    (a, b), d, ref = two_cities(rng), date(rng), full_name(rng)
    score = f"{rng.randint(0, 6)}-{rng.randint(0, 6)}"
    text = rng.choice([f"On {d}, {a} hosted {b}. The match ended {score} and was refereed by {ref}.",
                       f"Match report: {b} away at {a}, {d}, final score {score}, referee {ref}."])
    return ask(rng, text, [("Which team played at home?", a, f"The home team is {a}."),
                           ("What was the final score?", score, f"The score was {score}."),
                           ("Who refereed the match?", ref, f"The referee was {ref}."),
                           ("Which team was the visitor?", b, f"The visiting team is {b}.")])


def order_note(rng):
    num, who, qty, city = code(rng, 2, 5), full_name(rng), str(rng.randint(2, 60)), rng.choice(CITIES)
    item = rng.choice(("lamps", "chairs", "kettles", "jackets", "helmets", "clocks"))
    text = rng.choice([f"Order {num} from {who} asks for {qty} {item}, delivered to {city}.",
                       f"{who} placed order {num}: {qty} {item}, to be shipped to {city}."])
    return ask(rng, text, [("What is the order number?", num, f"The order number is {num}."),
                           ("How many items were ordered?", qty, f"The order asks for {qty} {item}."),
                           ("Where will the order be delivered?", city, f"It goes to {city}."),
                           ("Who placed the order?", who, f"The customer is {who}.")])


TEMPLATES = (parcel, flight, hotel_booking, staff_record, car_rental, concert, lab_sample, library_loan,
             team_match, order_note)
