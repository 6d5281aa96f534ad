"""The guided trace docs/tour.md: one tiny batch through mars.py and one decoding step through
generate.py and exact.py, with shapes, each stage linked to its function and docs/spec.md section.

The page is generated so that it stays true: every tensor on it comes from calling the
repository's own functions on a tiny seeded random model (model.Qwen2, model.init_weights,
float64 so that no printed digit depends on the machine's rounding). The tour computes no rule
itself. Where an intermediate (the per-target CE, a decoding step's KV cache and drafts) is not
returned by a public function, it calls the smaller functions the real code calls, in the same
order, says so on the page, and checks that the result equals the public function's.
Every number printed is checked to be far from a rounding boundary, every argmax far from a
tie and τ far from every probability it is compared with, so another machine prints the same
page (tests/test_tour.py checks the committed page is what this script gives today).

The package: __main__.py (the command line), page.py (the page's header and its sections in
order), batch.py (section 1, the training batch), step.py (sections 2-4, the decoding steps
and whole runs), toy.py (the tiny model, its vocabulary and the shared settings), markup.py
(numbers safe to print, tables, links and pictures).

    python -m scripts.tour            # (re)writes docs/tour.md
    python -m scripts.tour --out -    # prints the page instead
"""
