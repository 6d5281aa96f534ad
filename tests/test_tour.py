"""docs/tour.md, the guided trace, is what `python -m scripts.tour` writes today (issue 24).

The page's tensors are computed by the repository's own functions (scripts/tour/ checks
each intermediate it rebuilds against the public function that hides it: mars.mars_loss,
generate.mars_decode with the window cache and with none, exact.exact_steps, and exact mode
against plain AR), so re-rendering it is the proof that the trace still describes the code.
It must also not depend on the machine: float64, and no printed digit near a rounding boundary.
"""

import os
import re

import pytest
import torch

from scripts.tour.__main__ import main
from scripts.tour.markup import num
from scripts.tour.page import render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "tour.md")


@pytest.fixture(scope="module")
def page():
    with open(PAGE) as f:
        return f.read()


def test_the_committed_page_is_what_the_script_gives_today(page):
    assert render() == page, "docs/tour.md is stale: run `python -m scripts.tour` and commit it"


def test_the_page_does_not_depend_on_the_thread_count(page):
    """CPU kernels may split sums by thread; float64 and the margins keep every printed digit."""
    n = torch.get_num_threads()
    torch.set_num_threads(2 if n == 1 else 1)
    try:
        assert render() == page
    finally:
        torch.set_num_threads(n)


def test_main_writes_the_page_or_prints_it(tmp_path, capsys, page):
    out = tmp_path / "tour.md"
    main(["--out", str(out)])
    assert out.read_text() == page and not os.path.exists(f"{out}.tmp")
    capsys.readouterr()
    main(["--out", "-"])
    assert capsys.readouterr().out == page
    with pytest.raises(SystemExit):  # a device or a folder is not replaced by a file
        main(["--out", str(tmp_path)])


def test_every_link_into_the_repository_resolves(page):
    links = re.findall(r"\]\(([^)#\s]+)\)", page)
    assert len(links) > 20
    for target in links:
        assert os.path.exists(os.path.join(ROOT, "docs", target)), target


def test_a_digit_another_machine_could_round_the_other_way_is_refused():
    """The rule written out: x is printed with 3 decimals only if it is >= 1e-6 from the
    nearest (k + 0.5) / 1000."""
    assert num(0.1234) == "0.123" and num(0.1236) == "0.124"
    for x in (0.0005, 0.1235, 0.1235 + 5e-7, 0.1235 - 5e-7):
        with pytest.raises(AssertionError):
            num(x)
    assert num(0.1235 + 2e-6) == "0.124"
