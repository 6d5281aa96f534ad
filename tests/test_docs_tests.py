"""docs/tests.md, the page of what each test proves and with which bound, is checked against the
test sources, so it cannot drift from them silently (issue 32):

  * every test it cites as `file.py::name` exists: the file is in tests/ and defines `name`
    (a parametrised id such as `[fsdp]` is dropped before the look-up);
  * every bound its tolerance table quotes (each `code` span of the bound column) is in a file the
    row names, as written there (runs of whitespace read as one space);
  * it lists every file of tests/, and every `atol=`, `rtol=`, `rel_tol=` and upper-case tolerance
    constant (`NAME = 1e-5`) of a test file is quoted in a row that names that file;
  * it cites no line numbers (`file.py:123`): they move with every edit above them.
"""

import ast
import functools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PAGE = TESTS.parent / "docs" / "tests.md"

CITATION = re.compile(r"(\w+\.py)::(\w+)(?:\[[^\]]*\])?")
FILE = re.compile(r"\b\w+\.py\b")
CODE = re.compile(r"`([^`]+)`")
KEYWORD_BOUND = re.compile(r"\b((?:atol|rtol|rel_tol)=(\d[\d.]*(?:e-?\d+)?))")
CONSTANT_BOUND = re.compile(r"^([A-Z][A-Z0-9_]* = \d[\d.]*e-\d+)\b", re.M)


def flat(text):
    """Runs of whitespace as one space: a quote may sit on one line where the code breaks it."""
    return re.sub(r"\s+", " ", text)


@functools.cache
def source(name):
    path = TESTS / name
    assert path.is_file(), f"docs/tests.md names {name}, which is not in tests/"
    return path.read_text()


@functools.cache
def defined(name):
    """The names of every function (tests, fixtures, helpers, nested ones) a file defines."""
    tree = ast.parse(source(name))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def cells(line):
    """A markdown table row's cells ('\\|' is a pipe inside a cell, not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def tolerance_rows(page):
    """(files the row names, quotes of its bound cell) for each row of the tolerance table."""
    table = page.split("## Tolerances", 1)[1]
    lines = [line for line in table.splitlines() if line.startswith("| test |") or line.startswith("| `")]
    header = cells(lines[0])
    assert header[0] == "test" and "bound" in header, header
    bound = header.index("bound")
    rows = []
    for line in lines[1:]:
        row = cells(line)
        assert len(row) == len(header), line
        rows.append((set(FILE.findall(line)), CODE.findall(row[bound])))
    return rows


def check_citations(page):
    cited = CITATION.findall(page)
    assert cited, "no `file.py::name` citation found"
    for name, test in cited:
        assert test in defined(name), f"docs/tests.md cites {name}::{test}, which {name} does not define"
    return cited


def check_bounds(rows):
    for files, quotes in rows:
        assert quotes, f"a row of the tolerance table quotes no bound: {sorted(files)}"
        for quote in quotes:
            assert any(flat(quote) in flat(source(f)) for f in files), \
                f"the bound `{quote}` is in none of {sorted(files)}"


def bounds_in_source(name):
    """Every nonzero atol / rtol / rel_tol keyword and upper-case tolerance constant of a file."""
    text = source(name)
    found = {m[0] for m in KEYWORD_BOUND.findall(text) if float(m[1]) != 0}
    return found | set(CONSTANT_BOUND.findall(text))


def check_every_bound_listed(rows):
    for path in sorted(TESTS.glob("*.py")):
        quoted = " ".join(flat(q) for files, quotes in rows if path.name in files for q in quotes)
        missing = sorted(b for b in bounds_in_source(path.name) if b not in quoted)
        assert not missing, f"{path.name}: bounds not in docs/tests.md's tolerance table: {missing}"


def test_cited_tests_exist_and_quoted_bounds_are_in_their_files():
    page = PAGE.read_text()
    assert len(check_citations(page)) > 50
    rows = tolerance_rows(page)
    assert len(rows) > 50
    check_bounds(rows)


def test_every_test_file_and_every_tolerance_is_on_the_page():
    page = PAGE.read_text()
    for path in sorted(TESTS.glob("*.py")):
        assert f"`{path.name}`" in page, f"docs/tests.md does not list {path.name}"
    check_every_bound_listed(tolerance_rows(page))


def test_no_line_numbers():
    cites = re.findall(r"\w+\.py:\d+", PAGE.read_text())
    assert not cites, f"docs/tests.md cites line numbers, which move: {cites}"


# ----------------------------------------------------------------------------- the spec's sections
SPEC = TESTS.parent / "docs" / "spec.md"
SECTION_REF = re.compile(r"§(\d+)(?:\.(\d+))?(?:\s*[-–]\s*§?(\d+)(?:\.(\d+))?)?")


def spec_sections():
    """docs/spec.md -> {N: the text of section §N} (its `## §N ...` headings)."""
    parts = re.split(r"^## §(\d+)\b", SPEC.read_text(), flags=re.M)
    return {int(n): text for n, text in zip(parts[1::2], parts[2::2])}


def cited_sections(text):
    """Every (section, item or None) a text cites: §5, §5.4, §3-§4, §5.2-3, §2–3, §5-6."""
    out = []
    for a, a_item, b, b_item in SECTION_REF.findall(text):
        if not b:
            out.append((int(a), int(a_item) if a_item else None))
        elif a_item and not b_item:  # §5.2-3: items 2..3 of §5
            out += [(int(a), i) for i in range(int(a_item), int(b) + 1)]
        else:  # §3-§4, §5-6, §5.1-§5.3: every section from a to b
            out += [(n, None) for n in range(int(a), int(b) + 1)]
    return out


def test_every_section_the_code_and_docs_cite_is_in_the_spec():
    """Every "§N" in the repository's code and pages names a section of docs/spec.md, and every
    "§N.M" an item M of that section's numbered list (e.g. §5.4: step 4 of §5). The shared
    design notes are not ours; results/ pages quote the paper's own sections too (§ only ours)."""
    sections = spec_sections()
    assert sorted(sections) == list(range(1, len(sections) + 1)), sorted(sections)
    root = TESTS.parent
    files = [p for p in root.rglob("*") if p.suffix in (".py", ".md") and p.is_file()
             and not {"out", "runs", ".git"} & set(p.relative_to(root).parts)]
    bad = []
    for path in files:
        for n, item in cited_sections(path.read_text()):
            if n not in sections:
                bad.append(f"{path.relative_to(root)}: §{n}")
            elif item is not None and not re.search(rf"^{item}\. ", sections[n], re.M):
                bad.append(f"{path.relative_to(root)}: §{n}.{item}")
    assert not bad, sorted(set(bad))
    assert cited_sections("§5.2-3 §3-§4 §8 §2–3") == [(5, 2), (5, 3), (3, None), (4, None), (8, None),
                                                       (2, None), (3, None)]


def test_results_readme_names_every_page():
    """results/README.md, the index of every results page, links each Markdown page under results/
    (a page written and never indexed is a result no reader finds; the proposal's DISCUSSION.md was)."""
    results = TESTS.parent / "results"
    index = (results / "README.md").read_text()
    linked = {(results / m).resolve() for m in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", index)}
    pages = {p.resolve() for p in results.rglob("*.md") if p.name != "README.md"}
    assert not pages - linked, sorted(str(p.relative_to(results)) for p in pages - linked)
