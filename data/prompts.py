"""Varied real prompts, and held-out human-written text, from this machine's Python (issue 15).

Self-distillation (scripts/real_model/) needs many prompts of many shapes, and an
honest quality check needs text that no model wrote. Both come from the Python
standard library, which every machine that runs this repository has:

  api items   public functions and classes of ~90 well-known modules, with their
              signature and docstring ("Explain what `json.dumps` does", "Give an
              example of using ...", "Here is the documentation of ...; explain it")
  paragraphs  prose paragraphs of the language reference (pydoc_data.topics) and of
              docstrings ("Summarise this paragraph", "List the key points", "Suggest
              a title")
  facts       small real tables: HTTP status codes, errno names, keywords, file
              extensions, pairs of functions of one module ("What is the difference")

Splits are by CLUSTER, not by prompt (issue 33). Every source has a coarse group
(`group_of`): the family of its module (math with cmath and statistics, gzip with bz2, lzma
and zlib, ...), the topic a paragraph comes from (its sibling paragraphs go with it), the
table and bucket of a fact (HTTP 4xx together). Groups are then joined into clusters
whenever two of their items carry near-duplicate text (word Jaccard >= 0.8 of the docstring,
paragraph or table entry a prompt carries: `near_duplicates`, `clusters`): the docstring
"Common base class for all non-exit exceptions." of a dozen modules' exceptions makes them
one cluster. A seeded hash of the cluster puts all of its prompts in "train", "val" or
"test", or its paragraphs in "human" (`split_of`; a cluster of more than BIG items is
train). So a test prompt shares no function, module family, topic or near-duplicate text
with a training or validation prompt, and the human paragraphs (the NLL check's text) come
from clusters with no prompt at all. Val, test and human are spread round-robin over their
clusters (`spread`), so no one cluster fills them; every item names its cluster ("group"):
the unit a bootstrap resamples. The "chat" split is general chat prompts written here
(facts, how-to, rewriting, lists), unlike every source above: the evaluation's prompts far
from the training data. Everything is a pure function of (seed, sizes) on one Python
version (the stdlib is the data: another version gives other prompts; scripts/real_model/
records the version in its stage key).

What this module does not know: tokens and models. Lengths are bounded in words here;
the pipeline drops prompts that are too long in tokens.
"""

import errno
import hashlib
import http
import importlib
import inspect
import itertools
import keyword
import math
import mimetypes
import random
import re
import warnings
from collections import Counter, defaultdict

MODULES = (
    "abc argparse array ast asyncio base64 binascii bisect builtins bz2 calendar cmath codecs colorsys "
    "collections concurrent.futures configparser contextlib copy csv dataclasses datetime decimal difflib "
    "dis email.utils enum filecmp fnmatch fractions functools gc getpass glob graphlib gzip hashlib heapq "
    "hmac html http.client imaplib importlib inspect io ipaddress itertools json keyword linecache locale "
    "logging lzma math mimetypes numbers operator os os.path pathlib pickle pkgutil platform pprint queue "
    "random re sched secrets selectors shlex shutil signal socket sqlite3 statistics string struct "
    "subprocess sys tarfile tempfile textwrap threading time timeit tokenize tomllib traceback types "
    "typing unicodedata unittest urllib.parse urllib.request uuid warnings weakref xml.etree.ElementTree "
    "zipfile zlib zoneinfo"
).split()
SPLITS = ("train", "val", "test", "human")
HELD_OUT = ("human", "test", "val")  # the held-out splits, by the share of clusters each gets
FRACTIONS = {"human": 0.2, "test": 0.2, "val": 0.2}  # of the clusters of at most BIG items
BIG = 60  # a larger cluster is train: held out, it would take many training rows and fill a split alone
NEAR_DUPLICATE = 0.8  # word Jaccard at or above which two prompts' contents are one text
PATCHED = {"inspect.getfile"}  # replaced by torch.package once torch is imported: never listed
# modules whose functions are near-duplicates of each other's: one group, one split
FAMILIES = {
    "compress": "bz2 gzip lzma zlib zipfile tarfile",
    "math": "math cmath statistics fractions decimal numbers random secrets",
    "time": "time datetime calendar zoneinfo sched timeit",
    "files": "os os.path pathlib shutil filecmp tempfile glob fnmatch",
    "text": "string textwrap re difflib unicodedata shlex",
    "net": "http.client urllib.parse urllib.request imaplib email.utils html mimetypes ipaddress socket "
           "selectors",
    "concurrency": "threading queue asyncio concurrent.futures subprocess signal",
    "encodings": "base64 binascii codecs hashlib hmac uuid struct array",
    "serialise": "json pickle csv configparser tomllib",
    "introspection": "inspect ast dis types typing abc tokenize keyword linecache traceback",
    "functional": "functools itertools operator collections heapq bisect graphlib copy contextlib",
}
FAMILY_OF = {m: fam for fam, mods in FAMILIES.items() for m in mods.split()}
CHAT = [  # general chat, unlike every source above (evaluation only, never trained on)
    "What is the capital of Australia?", "How many planets are in the solar system? Name them.",
    "Who wrote the novel Pride and Prejudice?", "Why do leaves change colour in autumn?",
    "What is the boiling point of water at sea level in Fahrenheit?", "How does a rainbow form?",
    "What causes the seasons on Earth?", "Explain what photosynthesis is in two sentences.",
    "How do I boil an egg so that the yolk stays soft?", "How can I improve my sleep?",
    "Give me three tips for a job interview.", "How do I change a flat bicycle tyre?",
    "What is a good way to learn a new language?", "How should I store fresh bread?",
    "How do I write a polite email asking for a deadline extension?", "How do I plant tomatoes?",
    "Rewrite this sentence to be more formal: we gotta finish this by friday.",
    "Rewrite in simpler words: The committee postponed the decision owing to insufficient data.",
    "Make this sentence shorter: In the event that it rains, the picnic will be moved indoors.",
    "Turn this into a question: The train leaves at seven.", "Correct the grammar: She don't like apples.",
    "Rewrite this more politely: Send me the report now.",
    "Say this in a positive way: The food was not bad.",
    "List five fruits that are high in vitamin C.", "List the days of the week in French.",
    "Name four musical instruments that use strings.", "List three renewable sources of energy.",
    "Give me a list of five things to pack for a beach trip.", "List the primary colours.",
    "Name three famous painters and one painting by each.", "List four ways to save water at home.",
    "Write a haiku about the sea.", "Suggest a name for a small coffee shop.",
    "Write a two-line birthday message for a friend.", "What is the difference between weather and climate?",
    "What is the difference between a virus and a bacterium?", "Why is the sea salty?",
    "How far is the Moon from the Earth?", "What does a thermometer measure?",
    "Give a short definition of democracy.",
]
MIN_WORDS, MAX_WORDS = 20, 80  # a paragraph to summarise or score: a few sentences, < ~120 tokens

API_TEMPLATES = {
    "explain": [
        "Explain what `{q}` does in Python.",
        "What is `{q}` used for?",
        "In a few sentences, what does `{q}` do?",
        "Describe the purpose of `{q}`{sig_part}.",
    ],
    "example": [
        "Give a short example of using `{q}`.",
        "Show how to call `{q}` in a small Python program.",
        "Write a Python snippet that uses `{q}` and explain the output.",
    ],
    "doc": [
        "Here is the documentation of `{q}{sig}`:\n\n{doc}\n\nExplain it in simple words.",
        "Read this docstring of `{q}` and say when you would use it:\n\n{doc}",
    ],
}
PARAGRAPH_TEMPLATES = {
    "summarise": [
        "Summarise this paragraph in one or two sentences:\n\n{p}",
        "Give a one-sentence summary of the following text.\n\n{p}",
    ],
    "keypoints": ["List the key points of this text:\n\n{p}", "What are the main ideas here?\n\n{p}"],
    "title": ["Suggest a short title for this paragraph:\n\n{p}"],
    "simplify": ["Explain this to a beginner programmer:\n\n{p}"],
}


# ----------------------------------------------------------------------------- sources
def words(text):
    return len(text.split())


def prose_paragraphs(text):
    """Blank-line separated paragraphs of prose, each reflowed onto one line. Code, tables,
    grammar rules and headings are dropped: a paragraph must read like sentences."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if not lines or any(ln.startswith((">>>", "...", "*", "-", "|", "=", "+")) for ln in lines):
            continue
        p = " ".join(lines)
        letters = sum(c.isalpha() or c.isspace() for c in p) / max(1, len(p))
        if MIN_WORDS <= words(p) <= MAX_WORDS and letters > 0.85 and p[-1] in ".:)" and "::=" not in p:
            out.append(p)
    return out


def api_items(modules=MODULES):
    """Public functions and classes defined in `modules`, sorted by qualified name:
    [{"key", "q" (qualified name), "sig", "doc" (first docstring paragraph), "module"}]."""
    items = {}
    for name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except ImportError:  # a module this build lacks (e.g. sqlite3 without libsqlite)
            continue
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not (
                inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)
            ):
                continue
            home = getattr(obj, "__module__", None) or ""
            if f"{name}.{attr}" in PATCHED:
                continue  # whether it is listed would depend on what was imported before
            if home.lstrip("_") != name.lstrip("_") and not (name == "os.path" and "path" in home):
                continue  # re-exported from elsewhere: ask about it once, where it lives
            doc = inspect.getdoc(obj) or ""
            paras = [p for p in re.split(r"\n\s*\n", doc) if p.strip()]
            first = " ".join(paras[0].split()) if paras else ""
            if words(first) < 6 or words(first) > MAX_WORDS:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = ""
            q = f"{name}.{attr}"
            items[q] = {
                "key": f"api:{q}",
                "q": q,
                "sig": sig if len(sig) <= 60 else "",
                "doc": first,
                "module": name,
            }
    return [items[k] for k in sorted(items)]


def paragraph_items(modules=MODULES):
    """Prose paragraphs of the language reference and of module docstrings, in a fixed order:
    [{"key", "p", "about"}]; "about" names where the paragraph comes from."""
    import pydoc_data.topics

    out, seen = [], set()
    sources = [
        (f"topic:{t}", f"the Python `{t}` topic", pydoc_data.topics.topics[t])
        for t in sorted(pydoc_data.topics.topics)
    ]
    for name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sources.append(
                    (
                        f"moddoc:{name}",
                        f"the `{name}` module",
                        inspect.getdoc(importlib.import_module(name)) or "",
                    )
                )
        except ImportError:
            continue
    for key, about, text in sources:
        for i, p in enumerate(prose_paragraphs(text)):
            if p not in seen:
                seen.add(p)
                out.append({"key": f"{key}#{i}", "p": p, "about": about})
    return out


def fact_questions():
    """Short questions about small real tables, [(key, text, content)] in a fixed order; content
    is the table's entry the question carries (what the near-duplicate test compares)."""
    qs = [(f"http:{s.value}", f"What does the HTTP status code {s.value} ({s.phrase}) mean?",
           f"{s.value} {s.phrase}") for s in http.HTTPStatus]
    qs += [(f"errno:{n}", f"What does the error {n} mean when a program reports it?", n)
           for n in sorted(errno.errorcode.values())]
    qs += [(f"kw:{k}", f"What is the `{k}` keyword used for in Python?", k) for k in keyword.kwlist]
    types = mimetypes.MimeTypes().types_map[True]
    qs += [(f"ext:{e}", f"What kind of file has the extension {e} ({types[e]})?", f"{e} {types[e]}")
           for e in sorted(types)]
    return qs


# ----------------------------------------------------------------------------- splits and prompts
def group_of(key):
    """The coarse source group of a key: near-duplicates by construction share one.
    api:M.f and moddoc:M -> M's family; topic:T#i -> topic:T; pair:a|b -> a's module family;
    http:404 -> http:4xx; errno:ENOENT -> errno:EN; ext:.png -> ext:p; kw:if -> kw."""
    kind, _, rest = key.partition(":")
    if kind in ("api", "pair", "moddoc"):
        name = rest.split("|")[0].split("#")[0]
        mod = name if kind == "moddoc" else max((m for m in FAMILY_OF if name.startswith(m + ".")), key=len,
                                                default=name.rsplit(".", 1)[0])
        return f"module:{FAMILY_OF.get(mod, mod)}"
    if kind == "topic":
        return f"topic:{rest.split('#')[0]}"
    return {"http": lambda: f"http:{rest[0]}xx", "errno": lambda: f"errno:{rest[:2]}",
            "ext": lambda: f"ext:{rest[1:2]}"}.get(kind, lambda: kind)()


def content_words(text):
    """The words the near-duplicate test compares: split on whitespace, names in backticks left
    out (two prompts of one template about two names are not one text twice)."""
    return frozenset(w for w in text.split() if "`" not in w)


def near_duplicates(texts, threshold=NEAR_DUPLICATE):
    """Every pair (i, j), i < j, of texts whose content_words have Jaccard >= threshold (an empty
    set has none). Prefix filtering: with each set's words ordered rarest first, two sets with
    J >= t share a word among either one's first n - ceil(t n) + 1 (their overlap is at least
    t |A u B| >= t n), so only pairs sharing such a word are compared, exactly."""
    sets = [content_words(t) for t in texts]
    freq = Counter(w for s in sets for w in s)
    index, pairs = defaultdict(list), set()
    for i, s in enumerate(sets):
        words_ = sorted(s, key=lambda w: (freq[w], w))
        prefix = words_[:len(words_) - math.ceil(threshold * len(words_)) + 1]
        for j in {j for w in prefix for j in index[w]}:
            inter = len(s & sets[j])
            if inter >= threshold * (len(s) + len(sets[j]) - inter):
                pairs.add((j, i))
        for w in prefix:
            index[w].append(i)
    return sorted(pairs)


def clusters(items, threshold=NEAR_DUPLICATE):
    """group -> its cluster: groups (group_of) joined whenever an item of one is a near-duplicate
    of an item of another (their "content": the docstring, paragraph or table entry a prompt
    carries), transitively (union-find). A cluster is named by its smallest group."""
    parent = {}

    def root(g):
        while parent.get(g, g) != g:
            g = parent[g]
        return g
    for i, j in near_duplicates([it["content"] for it in items], threshold):
        a, b = root(group_of(items[i]["key"])), root(group_of(items[j]["key"]))
        if a != b:
            parent[max(a, b)] = min(a, b)
    return {group_of(it["key"]): root(group_of(it["key"])) for it in items}


def split_of(cluster, size, seed, paragraphs=True):
    """The split of a cluster (all its prompts and paragraphs): a seeded hash of its name, so it
    never depends on what else exists. A cluster of more than BIG items is "train" (held out, it
    would take many training rows and fill a split alone); "human" only for a cluster with
    paragraphs (its text is what the NLL check scores)."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{cluster}".encode()).digest()[:8], "little") / 2**64
    if size > BIG:
        return "train"
    held = [s for s in HELD_OUT if paragraphs or s != "human"]
    edges = dict(zip(held, itertools.accumulate(FRACTIONS[s] for s in held)))
    return next((s for s in held if u < edges[s]), "train")


def sources(seed):
    """Every candidate of every split, before the split: [{"key", "kind", "text", "content"}]
    (paragraphs also "p" and "about": the human text), in a fixed order."""
    rng = random.Random(seed)
    out, api = [], api_items()
    for it in api:
        for kind, tpls in API_TEMPLATES.items():
            text = rng.choice(tpls).format(q=it["q"], sig=it["sig"], doc=it["doc"],
                                           sig_part=f" (signature `{it['sig']}`)" if it["sig"] else "")
            content = it["doc"] if kind == "doc" else ""  # the other templates carry the name only
            out.append({"key": it["key"], "kind": kind, "text": text, "content": content})
    for it in paragraph_items():
        kind = rng.choice(sorted(PARAGRAPH_TEMPLATES))
        text = rng.choice(PARAGRAPH_TEMPLATES[kind]).format(p=it["p"])
        out.append({"key": it["key"], "kind": kind, "text": text, "content": it["p"], "p": it["p"],
                    "about": it["about"]})
    out += [{"key": key, "kind": "fact", "text": text, "content": content}
            for key, text, content in fact_questions()]
    by_module = {}
    for it in api:
        by_module.setdefault(it["module"], []).append(it["q"])
    for mod in sorted(by_module):  # pairs of one module: keyed by both, split with their module
        names = by_module[mod]
        out += [{"key": f"pair:{a}|{b}", "kind": "compare", "content": "",
                 "text": f"What is the difference between `{a}` and `{b}`?"}
                for a, b in zip(names[::2], names[1::2])]
    return out


def candidates(seed):
    """{split: [item]} for "train", "val", "test" (prompts) and "human" (paragraphs, as the text
    they are: scored, never prompted; a human cluster's other prompts are used nowhere); each
    item {"key", "kind", "text", "group"} (group: its cluster), human items also "about"."""
    items = sources(seed)
    cluster = clusters(items)
    size = Counter(cluster[group_of(it["key"])] for it in items)
    with_paragraphs = {cluster[group_of(it["key"])] for it in items if "p" in it}
    out = {s: [] for s in SPLITS}
    for it in items:
        c = cluster[group_of(it["key"])]
        split = split_of(c, size[c], seed, c in with_paragraphs)
        if split == "human":
            if "p" in it:
                out["human"].append({"key": it["key"], "kind": "human", "text": it["p"], "about": it["about"],
                                     "group": c})
            continue
        out[split].append({"key": it["key"], "kind": it["kind"], "text": it["text"], "group": c})
    return out


def spread(pool, rng):
    """pool shuffled, then ordered round-robin over its groups (one item of each group, in a
    shuffled group order, then a second of each, ...): the first n items span as many groups
    as they can, so no one group fills a held-out set."""
    rng.shuffle(pool)
    rank, order = Counter(), {}
    for it in pool:
        order.setdefault(it["group"], len(order))
        it_rank = rank[it["group"]]
        rank[it["group"]] += 1
        it["_rr"] = (it_rank, order[it["group"]])
    pool.sort(key=lambda it: it.pop("_rr"))
    return pool


def build(seed, n_train, n_val, n_test, n_human, n_chat=0, prefer=()):
    """The prompts of a run -> {"train", "val", "test", "human", "chat": [...]}, each item
    {"id", "key", "kind", "text", "group"} (human items also "about"). Train: a seeded shuffle,
    the texts in `prefer` first (prompts whose replies exist already), then the first n_train;
    val, test and human: spread over their groups (spread); ids are "split-index". Raises
    if a split is too small."""
    chat = [{"key": f"chat:{i}", "kind": "chat", "text": t, "group": f"chat:{i}"} for i, t in enumerate(CHAT)]
    pools = {**candidates(seed), "chat": chat}
    sizes = {"train": n_train, "val": n_val, "test": n_test, "human": n_human, "chat": n_chat}
    prefer, out = set(prefer), {}
    for split in SPLITS + ("chat",):
        pool, rng = pools[split], random.Random(f"{seed}:{split}")
        if split in ("train", "chat"):
            rng.shuffle(pool)
            pool.sort(key=lambda it: it["text"] not in prefer)  # stable: the shuffle within each part
        else:
            pool = spread(pool, rng)
        if len(pool) < sizes[split]:
            raise ValueError(f"{split}: only {len(pool)} candidates for {sizes[split]} requested")
        out[split] = [{"id": f"{split}-{i}", **c} for i, c in enumerate(pool[: sizes[split]])]
    return out
