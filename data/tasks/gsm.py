"""GSM8K-shaped word problems: the templates of the "gsm" family of the task set (issue 54).

Each template is a function rng -> (question, steps, answer): a few sentences that tell two to
four steps of arithmetic, the worked solution as sentences in words and numbers, one
equation "a op b = c" per step (ops + - * /, read with Python's precedence), and the final
number. Every quantity is a whole number > 0 and every division is exact, so the numbers are
what GSM8K's are. Each template has two wordings of its question; the reply's last line,
"The answer is N.", is added by data/tasks/__init__.py.

What this module does not know: splits (a template's split is data/tasks/__init__.py's), the
reply's final line, grading (data/tasks/grade.py).
"""

import math

from data.tasks.pools import FRUITS, GOODS, PLANTS, SNACKS, TOYS, cap, person


def shop_change(rng):
    p, (a, b) = person(rng), rng.sample(GOODS, 2)
    na, pa, nb, pb = rng.randint(2, 6), rng.randint(2, 9), rng.randint(2, 6), rng.randint(1, 5)
    bill = next(x for x in (20, 50, 100) if x > na * pa + nb * pb)
    q = rng.choice([f"{p.name} buys {na} {a} at ${pa} each and {nb} {b} at ${pb} each. {cap(p.he)} pays "
                    f"with a ${bill} bill. How much change does {p.he} get back?",
                    f"At the store, {a} cost ${pa} each and {b} cost ${pb} each. {p.name} takes {na} {a} "
                    f"and {nb} {b} and hands the cashier ${bill}. How many dollars of change are due?"])
    cost = na * pa + nb * pb
    return q, [f"The {a} cost {na} * {pa} = {na * pa} dollars.",
               f"The {b} cost {nb} * {pb} = {nb * pb} dollars.",
               f"Together they cost {na * pa} + {nb * pb} = {cost} dollars.",
               f"The change is {bill} - {cost} = {bill - cost} dollars."], bill - cost


def weekly_savings(rng):
    p, weekly, weeks = person(rng), rng.randint(3, 25), rng.randint(3, 12)
    spent = rng.randint(1, weekly * weeks - 1)
    q = rng.choice([f"{p.name} puts ${weekly} into a jar every week for {weeks} weeks. Then {p.he} spends "
                    f"${spent} on a gift. How much money is left in the jar?",
                    f"For {weeks} weeks, {p.name} saves ${weekly} a week. After buying a gift for ${spent}, "
                    f"how many dollars does {p.he} still have saved?"])
    saved = weekly * weeks
    return q, [f"{p.name} saves {weekly} * {weeks} = {saved} dollars.",
               f"After the gift, {saved} - {spent} = {saved - spent} dollars are left."], saved - spent


def share_with_friends(rng):
    p, toy = person(rng), rng.choice(TOYS)
    friends, each, found = rng.randint(2, 6), rng.randint(2, 8), rng.randint(1, 20)
    start = friends * each + rng.randint(1, 30)
    q = rng.choice([f"{p.name} has {start} {toy}. {cap(p.he)} gives {each} {toy} to each of {friends} "
                    f"friends, and later finds {found} more. How many {toy} does {p.he} have now?",
                    f"There are {start} {toy} in {p.name}'s box. Each of {p.his} {friends} friends gets "
                    f"{each} of them, then {p.name} adds {found} new ones. How many {toy} are in the box?"])
    given = friends * each
    return q, [f"{cap(p.he)} gives away {friends} * {each} = {given} {toy}.",
               f"That leaves {start} - {given} = {start - given} {toy}.",
               f"With the new ones, {start - given} + {found} = {start - given + found} {toy}."], \
        start - given + found


def bakery_boxes(rng):
    p, snack = person(rng), rng.choice(SNACKS)
    per_box, boxes, price = rng.choice([4, 6, 8, 10, 12]), rng.randint(3, 15), rng.randint(3, 12)
    baked = per_box * boxes
    q = rng.choice([f"{p.name} bakes {baked} {snack} and packs them in boxes of {per_box}. {cap(p.he)} sells "
                    f"every box for ${price}. How much money does {p.he} make?",
                    f"A batch of {baked} {snack} is split into boxes holding {per_box} each, and each box "
                    f"sells for ${price}. If {p.name} sells all the boxes, what is the total in dollars?"])
    return q, [f"The {snack} fill {baked} / {per_box} = {boxes} boxes.",
               f"The boxes bring in {boxes} * {price} = {boxes * price} dollars."], boxes * price


def road_trip(rng):
    p, speed, hours, walk = person(rng), rng.choice([40, 45, 50, 55, 60, 65, 70, 80]), rng.randint(2, 6), \
        rng.randint(2, 15)
    q = rng.choice([f"{p.name} drives at {speed} km per hour for {hours} hours, then walks {walk} km to a "
                    f"lake. How many kilometers does {p.he} travel in all?",
                    f"On a trip, {p.name} spends {hours} hours in a car going {speed} km each hour and "
                    f"covers the last {walk} km on foot. What is the whole distance in km?"])
    return q, [f"The drive covers {speed} * {hours} = {speed * hours} km.",
               f"With the walk, {speed * hours} + {walk} = {speed * hours + walk} km."], speed * hours + walk


def garden_rows(rng):
    p, plant = person(rng), rng.choice(PLANTS)
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    lost = rng.randint(1, rows * per_row // 2)
    q = rng.choice([f"{p.name} plants {rows} rows of {plant} with {per_row} in each row. Rabbits ruin "
                    f"{lost} of them. How many {plant} are left?",
                    f"A garden has {rows} rows, each with {per_row} {plant}. After a storm, {lost} {plant} "
                    f"are lost. How many does {p.name}'s garden still have?"])
    total = rows * per_row
    return q, [f"The garden has {rows} * {per_row} = {total} {plant}.",
               f"After the loss, {total} - {lost} = {total - lost} remain."], total - lost


def reading_plan(rng):
    p, per_day, days = person(rng), rng.randint(5, 40), rng.randint(3, 14)
    pages = per_day * days + rng.randint(10, 200)
    q = rng.choice([f"{p.name}'s book has {pages} pages. {cap(p.he)} reads {per_day} pages a day for {days} "
                    f"days. How many pages are still unread?",
                    f"A novel is {pages} pages long. If {p.name} gets through {per_day} pages every day, how "
                    f"many pages remain after {days} days?"])
    read = per_day * days
    return q, [f"{cap(p.he)} reads {per_day} * {days} = {read} pages.",
               f"Unread: {pages} - {read} = {pages - read} pages."], pages - read


def twice_as_old(rng):
    a = person(rng)
    b = person(rng, not_=(a.name,))
    age, more = rng.randint(4, 30), rng.randint(1, 9)
    q = rng.choice([f"{a.name} is {age} years old. {b.name} is {more} years older than twice {a.name}'s age. "
                    f"What is the sum of their ages?",
                    f"{b.name}'s age is {more} more than double the age of {a.name}, who is {age}. How old "
                    f"are {a.name} and {b.name} together?"])
    other = 2 * age + more
    return q, [f"Twice {a.name}'s age is 2 * {age} = {2 * age}.",
               f"So {b.name} is {2 * age} + {more} = {other}.",
               f"Together they are {age} + {other} = {age + other} years old."], age + other


def museum_tickets(rng):
    p, adult, child = person(rng), rng.randint(8, 25), rng.randint(3, 12)
    na, nc = rng.randint(1, 4), rng.randint(1, 6)
    q = rng.choice([f"Museum tickets cost ${adult} for adults and ${child} for children. {p.name} buys "
                    f"tickets for {na} adults and {nc} children. What is the total cost?",
                    f"{p.name} takes {na} adults and {nc} kids to a show. An adult seat is ${adult} and a "
                    f"kid's seat is ${child}. How many dollars are spent on seats?"])
    return q, [f"The adult tickets cost {na} * {adult} = {na * adult} dollars.",
               f"The child tickets cost {nc} * {child} = {nc * child} dollars.",
               f"In total, {na * adult} + {nc * child} = {na * adult + nc * child} dollars."], \
        na * adult + nc * child


def half_then_third(rng):
    p, fruit, k = person(rng), rng.choice(FRUITS), rng.randint(2, 15)
    start = 6 * k
    q = rng.choice([f"{p.name} picks {start} {fruit}. {cap(p.he)} eats half of them, then gives a third of "
                    f"what is left to a neighbor. How many {fruit} does {p.he} keep?",
                    f"From a basket of {start} {fruit}, half are used for jam. Of the rest, one third go to "
                    f"{p.name}'s neighbor. How many {fruit} stay in the basket?"])
    half, third = start // 2, start // 6
    return q, [f"Half of them is {start} / 2 = {half}.", f"A third of the rest is {half} / 3 = {third}.",
               f"{cap(p.he)} keeps {half} - {third} = {half - third} {fruit}."], half - third


def overtime_pay(rng):
    p, wage, hours, extra = person(rng), rng.randint(10, 30), rng.randint(20, 40), rng.randint(2, 10)
    bonus = wage + rng.choice([5, 10, 15])
    q = rng.choice([f"{p.name} earns ${wage} an hour for the first {hours} hours of a week and ${bonus} an "
                    f"hour for every hour after that. This week {p.he} works {hours + extra} hours. How "
                    f"much does {p.he} earn?",
                    f"A job pays ${wage} per hour up to {hours} hours and ${bonus} per hour beyond. What "
                    f"does {p.name} make in a week of {hours + extra} hours?"])
    base, over = wage * hours, bonus * extra
    return q, [f"The regular hours pay {wage} * {hours} = {base} dollars.",
               f"The extra hours are {hours + extra} - {hours} = {extra}.",
               f"They pay {bonus} * {extra} = {over} dollars.",
               f"In all, {base} + {over} = {base + over} dollars."], base + over


def fill_tank(rng):
    p, rate, minutes, have = person(rng), rng.randint(2, 12), rng.randint(3, 20), rng.randint(5, 60)
    size = have + rate * minutes
    q = rng.choice([f"A tank holds {size} liters and already has {have} liters in it. {p.name} fills it "
                    f"with a hose that adds {rate} liters a minute. How many minutes until it is full?",
                    f"{p.name}'s pool needs {size} liters to be full and holds {have} liters now. Water "
                    f"flows in at {rate} liters per minute. How long, in minutes, does filling it take?"])
    return q, [f"It still needs {size} - {have} = {size - have} liters.",
               f"At {rate} liters a minute that takes {size - have} / {rate} = {minutes} minutes."], minutes


def pizza_party(rng):
    p, pizzas, slices = person(rng), rng.randint(2, 8), rng.choice([6, 8, 10, 12])
    guests = rng.randint(3, 11)
    each = rng.randint(1, (pizzas * slices - 1) // guests)  # some slices are left
    q = rng.choice([f"{p.name} orders {pizzas} pizzas cut into {slices} slices each. {guests} guests eat "
                    f"{each} slices each. How many slices are left over?",
                    f"At {p.name}'s party there are {pizzas} pizzas of {slices} slices. If each of the "
                    f"{guests} guests has {each} slices, how many slices remain?"])
    total, eaten = pizzas * slices, guests * each
    return q, [f"There are {pizzas} * {slices} = {total} slices.",
               f"The guests eat {guests} * {each} = {eaten}.",
               f"Left over: {total} - {eaten} = {total - eaten} slices."], total - eaten


def stamp_packs(rng):
    p, toy, have, packs, per = person(rng), rng.choice(TOYS), rng.randint(10, 80), rng.randint(2, 6), \
        rng.randint(5, 12)
    gone = rng.randint(1, have + packs * per - 1)
    q = rng.choice([f"{p.name} collects {toy} and has {have}. {cap(p.he)} buys {packs} packs with {per} "
                    f"{toy} in each, then trades away {gone}. How many {toy} does {p.he} own now?",
                    f"{p.name} owned {have} {toy} before getting {packs} new packs of {per}. After trading "
                    f"{gone} of them, how many are in {p.his} collection?"])
    new = packs * per
    return q, [f"The packs hold {packs} * {per} = {new} {toy}.",
               f"So {p.he} has {have} + {new} = {have + new}.",
               f"After the trade, {have + new} - {gone} = {have + new - gone} {toy}."], have + new - gone


def laps_per_week(rng):
    p, lap = person(rng), rng.choice([200, 250, 300, 400, 500])
    laps, days = rng.randint(2, 10), rng.randint(2, 7)
    q = rng.choice([f"{p.name} runs {laps} laps of a {lap} meter track on each of {days} days. How many "
                    f"meters does {p.he} run in total?",
                    f"One lap of the park is {lap} meters. {p.name} does {laps} laps a day, {days} days this "
                    f"week. What distance in meters is that?"])
    daily = lap * laps
    return q, [f"Each day {p.he} runs {laps} * {lap} = {daily} meters.",
               f"Over {days} days that is {daily} * {days} = {daily * days} meters."], daily * days


def sale_discount(rng):
    p, item = person(rng), rng.choice(GOODS)
    pct, price = rng.choice([10, 20, 25, 50]), 20 * rng.randint(2, 15)
    q = rng.choice([f"A set of {item} costs ${price}. It is on sale for {pct}% off. How much does {p.name} "
                    f"pay for it?",
                    f"{p.name} finds {item} priced at ${price} with a {pct} percent discount. What is the "
                    f"price after the discount, in dollars?"])
    off = price * pct // 100
    return q, [f"The discount is {price} * {pct} / 100 = {off} dollars.",
               f"The price is {price} - {off} = {price - off} dollars."], price - off


def egg_cartons(rng):
    p, hens, per_hen = person(rng), rng.randint(2, 9), rng.randint(1, 4)
    daily = hens * per_hen
    days = 6 // math.gcd(daily, 6) * rng.randint(1, 3)  # so the eggs fill whole cartons of 6
    q = rng.choice([f"{p.name} has {hens} hens that each lay {per_hen} eggs a day. {cap(p.he)} packs the "
                    f"eggs in cartons of 6. How many cartons does {p.he} fill in {days} days?",
                    f"Each of {p.name}'s {hens} hens lays {per_hen} eggs daily. How many cartons of six eggs "
                    f"come from {days} days of laying?"])
    return q, [f"The hens lay {hens} * {per_hen} = {daily} eggs a day.",
               f"In {days} days that is {daily} * {days} = {daily * days} eggs.",
               f"They fill {daily * days} / 6 = {daily * days // 6} cartons."], daily * days // 6


def split_bill(rng):
    p, friends, share = person(rng), rng.randint(2, 6), rng.randint(8, 30)
    tip = rng.randint(1, 5) * (friends + 1)
    food = share * (friends + 1) - tip
    q = rng.choice([f"{p.name} and {friends} friends eat out. The food costs ${food} and they leave a ${tip} "
                    f"tip. They split the whole bill evenly. How much does each person pay?",
                    f"A dinner for {p.name} and {friends} friends comes to ${food}, plus a tip of ${tip}. If "
                    f"everyone pays the same share, what is one share in dollars?"])
    people, total = friends + 1, food + tip
    return q, [f"There are {friends} + 1 = {people} people.",
               f"The bill is {food} + {tip} = {total} dollars.",
               f"Each pays {total} / {people} = {share} dollars."], share


def stairs_climb(rng):
    p, steps, floor, trips = person(rng), rng.randint(10, 24), rng.randint(2, 9), rng.randint(1, 3)
    q = rng.choice([f"Each floor of {p.name}'s building has {steps} steps. {cap(p.he)} walks up to floor "
                    f"{floor} and back down, {trips} times a day. How many steps is that a day?",
                    f"{p.name} lives on floor {floor}, and every floor is {steps} stairs. Going up and down "
                    f"counts as one round, and {p.he} makes {trips} rounds daily. How many stairs daily?"])
    up = steps * floor
    return q, [f"One way is {steps} * {floor} = {up} steps.", f"Up and down is {up} * 2 = {2 * up} steps.",
               f"For {trips} rounds, {2 * up} * {trips} = {2 * up * trips} steps."], 2 * up * trips


def library_shelves(rng):
    p, shelves, per = person(rng), rng.randint(3, 10), rng.randint(12, 40)
    out = rng.randint(5, shelves * per // 2)
    back = rng.randint(1, out)
    q = rng.choice([f"A library has {shelves} shelves with {per} books on each. On Monday {out} books are "
                    f"borrowed and {back} are returned. How many books are on the shelves now?",
                    f"{p.name} counts {per} books on every one of {shelves} shelves. Then readers take {out} "
                    f"books out and bring {back} back. How many books are on the shelves?"])
    total = shelves * per
    return q, [f"At first there are {shelves} * {per} = {total} books.",
               f"After the loans, {total} - {out} = {total - out}.",
               f"With the returns, {total - out} + {back} = {total - out + back} books."], total - out + back


def bus_stops(rng):
    start, off1, on1 = rng.randint(15, 50), rng.randint(1, 10), rng.randint(1, 15)
    off2 = rng.randint(1, start - off1 + on1 - 1)
    q = rng.choice([f"A bus leaves with {start} passengers. At the first stop {off1} get off and {on1} get "
                    f"on. At the second stop {off2} get off. How many passengers are on the bus now?",
                    f"There are {start} people on a bus. {off1} people step off and {on1} people board at "
                    f"one stop, and {off2} step off at the next. How many riders remain?"])
    a = start - off1
    return q, [f"After the first {off1} leave, {start} - {off1} = {a}.", f"Then {a} + {on1} = {a + on1}.",
               f"At the second stop, {a + on1} - {off2} = {a + on1 - off2} passengers."], a + on1 - off2


def farm_legs(rng):
    p, hens, cows = person(rng), rng.randint(2, 30), rng.randint(1, 20)
    q = rng.choice([f"{p.name}'s farm has {hens} chickens and {cows} cows. How many legs do the animals have "
                    f"in total?",
                    f"On a farm live {cows} cows and {hens} chickens. Counting every animal's legs, how many "
                    f"legs are there?"])
    return q, [f"The chickens have {hens} * 2 = {2 * hens} legs.",
               f"The cows have {cows} * 4 = {4 * cows} legs.",
               f"Altogether, {2 * hens} + {4 * cows} = {2 * hens + 4 * cows} legs."], 2 * hens + 4 * cows


def candy_colors(rng):
    p, red, times, fewer = person(rng), rng.randint(3, 20), rng.randint(2, 4), rng.randint(1, 5)
    q = rng.choice([f"A jar has {red} red candies. There are {times} times as many blue candies as red ones, "
                    f"and {fewer} fewer green candies than blue ones. How many candies are in the jar?",
                    f"{p.name} sorts candies: {red} are red, the blue ones number {times} times the red, and "
                    f"the green ones are {fewer} less than the blue. What is the total count of candies?"])
    blue = red * times
    green = blue - fewer
    return q, [f"Blue: {red} * {times} = {blue}.", f"Green: {blue} - {fewer} = {green}.",
               f"Total: {red} + {blue} + {green} = {red + blue + green} candies."], red + blue + green


def water_glasses(rng):
    p, glasses = person(rng), rng.randint(4, 10)
    ml, days = rng.choice([200, 250, 300, 350]), rng.randint(2, 7)
    q = rng.choice([f"{p.name} drinks {glasses} glasses of water a day, and each glass holds {ml} mL. How "
                    f"many milliliters does {p.he} drink in {days} days?",
                    f"Every day {p.name} fills a {ml} mL cup {glasses} times and drinks it. What is {p.his} "
                    f"water intake over {days} days, in mL?"])
    daily = glasses * ml
    return q, [f"Each day is {glasses} * {ml} = {daily} mL.",
               f"Over {days} days, {daily} * {days} = {daily * days} mL."], daily * days


def class_markers(rng):
    p, size, groups, each = person(rng), rng.choice([3, 4, 5, 6]), rng.randint(3, 8), rng.randint(2, 6)
    pupils = size * groups
    q = rng.choice([f"{p.name}'s class of {pupils} students works in groups of {size}. Each group gets "
                    f"{each} boxes of markers. How many boxes are handed out?",
                    f"A teacher, {p.name}, splits {pupils} pupils into teams of {size} and gives every team "
                    f"{each} marker boxes. How many marker boxes does the teacher need?"])
    return q, [f"There are {pupils} / {size} = {groups} groups.",
               f"They need {groups} * {each} = {groups * each} boxes."], groups * each


TEMPLATES = (shop_change, weekly_savings, share_with_friends, bakery_boxes, road_trip, garden_rows,
             reading_plan, twice_as_old, museum_tickets, half_then_third, overtime_pay, fill_tank,
             pizza_party, stamp_packs, laps_per_week, sale_discount, egg_cartons, split_bill, stairs_climb,
             library_shelves, bus_stops, farm_legs, candy_colors, water_glasses, class_markers)
