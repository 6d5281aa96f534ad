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

Splits are by a COARSE source key, not by prompt (`group_of`): every api item and
paragraph is assigned to "train", "heldout" or "human" by a seeded hash of its group: the
family of its module (math with cmath and statistics, gzip with bz2, lzma and zlib, ...),
the topic a paragraph comes from (its sibling paragraphs go with it), the table and
bucket of a fact (HTTP 4xx together). So a held-out prompt shares no function, module
family, topic or near-duplicate source with a training prompt, and the "human"
paragraphs (the NLL check's text) appear in no prompt at all. The "chat" split is
general chat prompts written here (facts, how-to, rewriting, lists), unlike every
source above: the evaluation's prompts far from the training data. Everything is a pure function of
(seed, sizes) on one Python version (the stdlib is the data: another version gives other
prompts; scripts/real_model/ records the version in its stage key).

What this module does not know: tokens and models. Lengths are bounded in words here;
the pipeline drops prompts that are too long in tokens.
"""

import errno
import hashlib
import http
import importlib
import inspect
import keyword
import mimetypes
import random
import re
import warnings

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
SPLITS = ("train", "heldout", "human")
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
    """Short questions about small real tables, [(key, text)] in a fixed order."""
    qs = [
        (f"http:{s.value}", f"What does the HTTP status code {s.value} ({s.phrase}) mean?")
        for s in http.HTTPStatus
    ]
    qs += [
        (f"errno:{n}", f"What does the error {n} mean when a program reports it?")
        for n in sorted(errno.errorcode.values())
    ]
    qs += [(f"kw:{k}", f"What is the `{k}` keyword used for in Python?") for k in keyword.kwlist]
    types = mimetypes.MimeTypes().types_map[True]
    qs += [(f"ext:{e}", f"What kind of file has the extension {e} ({types[e]})?") for e in sorted(types)]
    return qs


# ----------------------------------------------------------------------------- splits and prompts
def group_of(key):
    """The coarse source group of a key, the unit of the split: near-duplicates share one.
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


def split_of(key, seed, heldout_frac=0.1, human_frac=0.1):
    """The split of a source key: a seeded hash of its group (group_of), so it never depends
    on what else exists. human_frac = 0 for sources that are prompts only (not paragraphs):
    the same hash, so a group held out is held out for every kind of source."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{group_of(key)}".encode()).digest()[:8], "little") / 2**64
    return "heldout" if u < heldout_frac else "human" if u < heldout_frac + human_frac else "train"


def candidates(seed):
    """Every (source key, kind, prompt text) of every split -> {split: [dict, ...]} in a fixed
    order. The "human" split holds paragraphs only, as texts to score, never as prompts."""
    rng = random.Random(seed)
    out = {s: [] for s in SPLITS}
    api = api_items()
    for it in api:
        split = split_of(it["key"], seed, human_frac=0)  # human text is paragraphs only
        for kind, tpls in API_TEMPLATES.items():
            text = rng.choice(tpls).format(
                q=it["q"],
                sig=it["sig"],
                doc=it["doc"],
                sig_part=f" (signature `{it['sig']}`)" if it["sig"] else "",
            )
            if split != "human":
                out[split].append({"key": it["key"], "kind": kind, "text": text})
    for it in paragraph_items():
        split = split_of(it["key"], seed)
        if split == "human":  # the human-written text: scored, never prompted
            out["human"].append({"key": it["key"], "kind": "human", "text": it["p"], "about": it["about"]})
            continue
        kind = rng.choice(sorted(PARAGRAPH_TEMPLATES))
        out[split].append(
            {"key": it["key"], "kind": kind, "text": rng.choice(PARAGRAPH_TEMPLATES[kind]).format(p=it["p"])}
        )
    for key, text in fact_questions():
        out[split_of(key, seed, human_frac=0)].append({"key": key, "kind": "fact", "text": text})
    by_module = {}
    for it in api:
        by_module.setdefault(it["module"], []).append(it["q"])
    for mod in sorted(by_module):  # pairs of one module: keyed by both, split by the pair
        names = by_module[mod]
        for a, b in zip(names[::2], names[1::2]):
            key = f"pair:{a}|{b}"  # one module: the group, and so the split, of both functions
            out[split_of(key, seed, human_frac=0)].append(
                {"key": key, "kind": "compare", "text": f"What is the difference between `{a}` and `{b}`?"})
    return out


def build(seed, n_train, n_heldout, n_human, n_chat=0):
    """The prompts of a run -> {"train": [...], "heldout": [...], "human": [...], "chat": [...]},
    each item {"id", "key", "kind", "text"} (human items also "about"). A seeded shuffle of
    each split's candidates, then the first n; ids are "split-index". Raises if a split is
    too small."""
    pools = {**candidates(seed), "chat": [{"key": f"chat:{i}", "kind": "chat", "text": t}
                                          for i, t in enumerate(CHAT)]}
    sizes = {"train": n_train, "heldout": n_heldout, "human": n_human, "chat": n_chat}
    out = {}
    for split in SPLITS + ("chat",):
        pool = pools[split]
        random.Random(f"{seed}:{split}").shuffle(pool)
        if len(pool) < sizes[split]:
            raise ValueError(f"{split}: only {len(pool)} candidates for {sizes[split]} requested")
        out[split] = [{"id": f"{split}-{i}", **c} for i, c in enumerate(pool[: sizes[split]])]
    return out
