"""GSM-shaped word problems of task set v2 (issue 61): story frames composed with operation chains.

A template is a pair (frame, chain). A FRAME is a story (who, what, where) that knows how to tell
each of the four operations on its running quantity, two wordings of every sentence: how the
story starts ({x} the starting count), how the count grows by {x} ("+"), shrinks by {x} ("-"),
becomes {x} times as many ("*"), or is split into {x} equal parts of which one is kept ("/"),
and the question. A CHAIN is one to three of those operations in order. The question is the
frame's sentences for the chain, the solution one line per step with one equation "a op b = c"
each, the same lines for every frame ("Adding 5: 6 + 5 = 11 marbles."), so what a test frame
brings that training never showed is its story, not the form of the arithmetic.

Number ranges (`numbers`). SmolLM2-135M fine-tuned on the v1 set wrote wrong equations
("29 * 4 = 108") and solved 12 % of the GSM-shaped problems: products of two-digit numbers and
sums in the hundreds are beyond it. Here every step is what the model can learn in a short
fine-tune: a sum under 100 (an addend 2..30, the sum at most 99), a difference (2..30 taken
from at most 108, at least 2 left), a product of a one-digit multiplier 2..9 by a count 2..12
(the times table: at most 108), and an exact division by 2..9 with a quotient 2..12 (the table
read backwards). The start is 2..60; no number is 1 (no "1 ducks"). Each operand is drawn
among those that also let the NEXT step keep these ranges (a count of at most 12 before a
product, a multiple of some divisor before a division), so a draw is thrown away only in the
rare dead end (then the chain starts again).

What this module does not know: splits (data/tasks/v2/__init__.py), the reply's final line,
grading (data/tasks/v2/grade.py).
"""

from collections import namedtuple

from data.tasks.pools import cap, person

Frame = namedtuple("Frame", "unit start add sub mul div ask")  # unit: the noun of the solution lines

# placeholders: {n} a name, {p} {P} he/she, {s} {S} his/her, {o} him/her, {x} the step's number
FRAMES = {
    "marbles": Frame(
        "marbles",
        ("{n} has {x} marbles.", "There are {x} marbles in {n}'s bag."),
        ("{P} wins {x} more marbles at recess.", "A friend gives {o} {x} marbles."),
        ("{P} loses {x} marbles in the grass.", "{P} gives {x} marbles to {s} cousin."),
        ("{P} trades them for {x} times as many marbles.",
         "After a lucky game {p} has {x} times as many marbles as before."),
        ("{P} sorts them equally into {x} bags and keeps one bag.",
         "{P} splits them evenly among {x} jars and gives away all but one jar."),
        ("How many marbles does {n} have now?", "How many marbles does {n} end up with?")),
    "bakery": Frame(
        "muffins",
        ("{n} bakes {x} muffins in the morning.", "{n}'s bakery tray holds {x} muffins."),
        ("{P} bakes {x} more muffins.", "A helper brings {o} {x} extra muffins."),
        ("{P} sells {x} muffins to customers.", "{x} muffins are eaten at lunch."),
        ("By noon {p} has made {x} times as many muffins as that.",
         "A big order keeps {o} baking until {p} has {x} times as many."),
        ("{P} packs them equally into {x} boxes and keeps one box.",
         "The muffins are shared equally among {x} stalls, and {n} keeps one stall's share."),
        ("How many muffins does {n} have now?", "How many muffins are with {n} at the end?")),
    "library": Frame(
        "books",
        ("A library cart holds {x} books.", "{n} loads {x} books onto a library cart."),
        ("{n} adds {x} returned books to the cart.", "Readers drop {x} more books on the cart."),
        ("{n} shelves {x} of the books.", "{x} books are taken off the cart for repair."),
        ("A delivery leaves {x} times as many books on the cart.",
         "After the book sale the cart has {x} times as many books."),
        ("{n} divides the books equally into {x} piles and keeps one pile on the cart.",
         "The books are split evenly across {x} shelves, and the cart keeps one shelf's worth."),
        ("How many books are on the cart now?", "How many books does the cart hold at the end?")),
    "eggs": Frame(
        "eggs",
        ("{n} collects {x} eggs from the hens.", "There are {x} eggs in {n}'s basket."),
        ("The ducks add {x} more eggs.", "{P} finds {x} more eggs in the barn."),
        ("{P} drops and breaks {x} eggs.", "{P} uses {x} eggs for a cake."),
        ("By the end of the week {p} has {x} times as many eggs.",
         "Over the week the basket fills to {x} times as many eggs."),
        ("{P} puts them equally into {x} cartons and keeps one carton.",
         "{P} splits them equally among {x} families and keeps one family's share."),
        ("How many eggs does {n} have now?", "How many eggs are left for {n}?")),
    "seedlings": Frame(
        "seedlings",
        ("{n} grows {x} seedlings in pots.", "{n}'s windowsill has {x} seedlings."),
        ("{P} plants {x} more seedlings.", "A neighbor gives {o} {x} seedlings."),
        ("Snails eat {x} of the seedlings.", "{x} seedlings wilt in the heat."),
        ("By spring the seedlings have spread to {x} times as many.",
         "{P} takes cuttings until {p} has {x} times as many seedlings."),
        ("{P} splits them evenly into {x} trays and gives away all but one tray.",
         "{P} plants them equally in {x} beds and sells every bed but one."),
        ("How many seedlings does {n} have now?", "How many seedlings are left in {n}'s care?")),
    "savings": Frame(
        "dollars",
        ("{n} has ${x} in a piggy bank.", "{n} saves ${x} from a summer job."),
        ("{P} earns ${x} more mowing lawns.", "{S} grandmother gives {o} ${x}."),
        ("{P} spends ${x} on a book.", "{P} pays ${x} for a concert ticket."),
        ("An investment leaves {o} with {x} times as much money.",
         "A prize grows {s} savings to {x} times as much."),
        ("{P} splits the money equally into {x} envelopes and keeps one envelope.",
         "The money is divided equally into {x} parts, and {n} keeps one part."),
        ("How many dollars does {n} have now?", "How much money, in dollars, does {n} have at the end?")),
    "aquarium": Frame(
        "fish",
        ("{n}'s aquarium holds {x} fish.", "{n} keeps {x} fish in a big tank."),
        ("{n} buys {x} more fish.", "{x} new fish are added to the tank."),
        ("{x} fish are moved to a pond.", "{n} gives {x} fish to a friend."),
        ("The fish breed until there are {x} times as many.",
         "After the breeding season the tank has {x} times as many fish."),
        ("{n} splits the fish evenly into {x} tanks and sells all but one tank.",
         "The fish are shared equally among {x} tanks, and {n} keeps one of them."),
        ("How many fish does {n} keep now?", "How many fish are in {n}'s tank in the end?")),
    "orchard": Frame(
        "apples",
        ("{n} picks {x} apples in the orchard.", "A crate by {n}'s orchard gate has {x} apples."),
        ("{P} picks {x} more apples.", "{x} more apples fall into the crate."),
        ("{P} makes a pie with {x} of the apples.", "{x} apples turn out bruised and are thrown out."),
        ("By evening the harvest is {x} times as large.",
         "With the whole team, the harvest is {x} times as many apples."),
        ("The apples are packed equally into {x} baskets, and {n} takes one basket home.",
         "{P} divides the apples equally among {x} stands and keeps one stand's share."),
        ("How many apples does {n} have now?", "How many apples are left for {n} at the end?")),
    "pencils": Frame(
        "pencils",
        ("A teacher, {n}, has {x} pencils.", "{n}'s classroom box holds {x} pencils."),
        ("{n} buys {x} new pencils.", "Parents donate {x} pencils."),
        ("Students borrow {x} pencils and never return them.", "{x} pencils break during the test."),
        ("A school order brings {x} times as many pencils.", "The stock grows to {x} times as many pencils."),
        ("{n} hands them out equally to {x} tables and keeps one table's share.",
         "The pencils are divided evenly into {x} cups, and {n} keeps one cup."),
        ("How many pencils does {n} have now?", "How many pencils remain with {n}?")),
    "shirts": Frame(
        "shirts",
        ("{n}'s shop has {x} shirts in stock.", "{n}'s stall displays {x} shirts."),
        ("A delivery brings {x} more shirts.", "{n} unpacks {x} more shirts."),
        ("{x} shirts are sold on Monday.", "Customers buy {x} shirts."),
        ("A big order raises the stock to {x} times as many shirts.",
         "After restocking there are {x} times as many shirts."),
        ("The shirts are shared equally among {x} branches, and {n} keeps one share.",
         "{n} sends the shirts equally to {x} stores, keeping one store's share."),
        ("How many shirts does {n} have in stock now?", "How many shirts does {n}'s shop have at the end?")),
    "beads": Frame(
        "beads",
        ("{n} has {x} beads for necklaces.", "{n}'s craft box holds {x} beads."),
        ("{P} buys a pack of {x} beads.", "{x} more beads are found under the table."),
        ("{P} uses {x} beads on a bracelet.", "{x} beads roll away and are lost."),
        ("{P} orders more until {p} has {x} times as many beads.",
         "A gift leaves {o} with {x} times as many beads."),
        ("{P} splits the beads equally into {x} cups and keeps one cup.",
         "The beads are divided evenly among {x} friends, and {n} keeps one share."),
        ("How many beads does {n} have now?", "How many beads are left for {n}?")),
    "shells": Frame(
        "shells",
        ("{n} gathers {x} shells on the beach.", "{n}'s bucket has {x} seashells."),
        ("{P} finds {x} more shells.", "{S} sister adds {x} shells to the bucket."),
        ("{x} shells are cracked, so {p} throws them back.", "{P} gives {x} shells to a child."),
        ("After the whole day {p} has {x} times as many shells.",
         "The tide brings in enough for {o} to have {x} times as many."),
        ("{P} shares the shells equally among {x} buckets and keeps one bucket.",
         "The shells are split evenly into {x} bags, and {n} keeps one bag."),
        ("How many shells does {n} have now?", "How many shells does {n} take home?")),
    "stamps": Frame(
        "stamps",
        ("{n}'s album holds {x} stamps.", "{n} owns {x} stamps."),
        ("{P} buys {x} more stamps at a fair.", "A pen pal sends {o} {x} stamps."),
        ("{P} trades away {x} stamps.", "{x} stamps are damaged and removed."),
        ("{S} collection grows to {x} times as many stamps.",
         "An uncle's gift gives {o} {x} times as many stamps as before."),
        ("{P} divides the stamps equally into {x} albums and keeps one album.",
         "{P} splits them evenly among {x} cousins, keeping one share."),
        ("How many stamps does {n} have now?", "How many stamps are in {n}'s collection at the end?")),
    "cookies": Frame(
        "cookies",
        ("{n}'s jar holds {x} cookies.", "{n} bakes {x} cookies."),
        ("{n} adds {x} more cookies to the jar.", "Grandpa brings {x} cookies."),
        ("The kids eat {x} cookies.", "{x} cookies are given to the neighbors."),
        ("For a fair, {n} bakes until there are {x} times as many cookies.",
         "A second batch makes it {x} times as many cookies."),
        ("{n} wraps the cookies equally in {x} bags and keeps one bag.",
         "The cookies are split evenly onto {x} plates, and {n} takes one plate."),
        ("How many cookies does {n} have now?", "How many cookies are left for {n} in the end?")),
    "camp": Frame(
        "bottles",
        ("{n}'s camp has {x} water bottles.", "{n} packs {x} water bottles for a hike."),
        ("{x} more bottles arrive by truck.", "{n} fills {x} extra bottles at the tap."),
        ("The hikers drink {x} bottles.", "{x} bottles leak and are thrown away."),
        ("For the long trip the supply grows to {x} times as many bottles.",
         "Before the race, {n} stocks up to {x} times as many bottles."),
        ("The bottles are split equally among {x} tents, and {n}'s tent gets one share.",
         "{n} loads the bottles equally into {x} canoes and carries one canoe's load."),
        ("How many bottles does {n} have now?", "How many bottles are with {n} at the end?")),
    "cranes": Frame(
        "cranes",
        ("{n} folds {x} paper cranes.", "A string holds {x} paper cranes made by {n}."),
        ("{P} folds {x} more cranes.", "{S} class adds {x} cranes."),
        ("{P} gives {x} cranes to a hospital.", "{x} cranes get wet and are ruined."),
        ("By the festival {p} has folded {x} times as many cranes.",
         "With help from friends there are {x} times as many cranes."),
        ("{P} hangs them equally on {x} strings and keeps one string.",
         "The cranes are split evenly into {x} boxes, and {n} keeps one box."),
        ("How many cranes does {n} have now?", "How many paper cranes does {n} have in the end?")),
    "candles": Frame(
        "candles",
        ("{n} makes {x} candles.", "{n}'s workshop has {x} candles on the shelf."),
        ("{P} pours {x} more candles.", "A student brings {o} {x} candles."),
        ("{P} sells {x} candles at the market.", "{x} candles melt in the sun."),
        ("A busy week brings the count to {x} times as many candles.",
         "{P} pours wax until {p} has {x} times as many candles."),
        ("{P} packs the candles equally into {x} crates and keeps one crate.",
         "The candles are shared evenly among {x} shops, and {n} keeps one share."),
        ("How many candles does {n} have now?", "How many candles are in {n}'s workshop at the end?")),
    "ducks": Frame(
        "ducks",
        ("{n} counts {x} ducks on the pond.", "{n} sees {x} ducks on the village pond."),
        ("{x} more ducks land on the water.", "{n} sees {x} more ducks arrive."),
        ("{x} ducks fly away.", "{x} ducks waddle off into the reeds."),
        ("By summer the flock is {x} times as large.", "In spring there are {x} times as many ducks."),
        ("The ducks split into {x} equal groups, and one group stays on the pond.",
         "The flock divides evenly among {x} ponds, and one pond's share stays."),
        ("How many ducks does {n} count now?", "How many ducks are on the pond at the end?")),
}

OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
CHAINS = {"-".join(OPS[o] for o in c): c for c in (
    ("*",), ("/",), ("+", "-"), ("-", "+"), ("*", "+"), ("*", "-"), ("/", "+"), ("-", "/"), ("+", "*"),
    ("+", "-", "+"), ("*", "-", "+"), ("/", "+", "-"))}
STEP = {"+": "Adding {x}: {v} + {x} = {r} {u}.", "-": "Taking away {x}: {v} - {x} = {r} {u}.",
        "*": "{x} times as many: {v} * {x} = {r} {u}.",
        "/": "Splitting into {x} equal parts: {v} / {x} = {r} {u}."}  # the solution's line of a step


def apply(op, v, x):
    return {"+": v + x, "-": v - x, "*": v * x, "/": v // x}[op]


def operands(op, v):
    """The numbers a step `op` on the count v may use (module docstring: the ranges)."""
    if op == "+":
        return range(2, min(30, 99 - v) + 1)
    if op == "-":
        return range(2, min(30, v - 2) + 1)
    if op == "*":
        return range(2, 10) if 2 <= v <= 12 else range(0)
    return [d for d in range(2, 10) if v % d == 0 and 2 <= v // d <= 12]


def numbers(rng, chain):
    """(start, [the number of each step]) for the chain, every step within the ranges."""
    while True:
        start = v = rng.choice([s for s in range(2, 61) if operands(chain[0], s)])
        xs = []
        for i, op in enumerate(chain):
            nxt = chain[i + 1] if i + 1 < len(chain) else None
            ok = [x for x in operands(op, v) if nxt is None or operands(nxt, apply(op, v, x))]
            if not ok:
                break  # a dead end: draw again
            xs.append(rng.choice(ok))
            v = apply(op, v, xs[-1])
        else:
            return start, xs


def make(rng, frame_name, chain_name):
    """One problem of the template (frame, chain) -> (question, steps, answer)."""
    f, chain = FRAMES[frame_name], CHAINS[chain_name]
    p = person(rng)
    names = {"n": p.name, "p": p.he, "P": cap(p.he), "s": p.his, "S": cap(p.his), "o": p.him}
    start, xs = numbers(rng, chain)
    say = lambda options, x: rng.choice(options).format(x=x, **names)  # noqa: E731
    sentences = [say(f.start, start)]
    sentences += [say({"+": f.add, "-": f.sub, "*": f.mul, "/": f.div}[op], x) for op, x in zip(chain, xs)]
    sentences.append(say(f.ask, None))
    v, steps = start, [f"At first there are {start} {f.unit}."]
    for op, x in zip(chain, xs):
        r = apply(op, v, x)
        steps.append(STEP[op].format(x=x, v=v, r=r, u=f.unit))
        v = r
    return " ".join(s[:1].upper() + s[1:] for s in sentences), steps, v
