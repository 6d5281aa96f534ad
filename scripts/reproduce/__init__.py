"""Reproduce the paper in miniature, from scratch, on a CPU, at several seeds: one command
(docs/spec.md §4, §5, §7).

Trains every variant the paper compares on the default tiny setup (configs/default.json: the
model, data and schedule of `python train.py`, a tiny Qwen2 on the synthetic tasks of
data/synthetic.py), each at every training seed of --seeds (init and row order; the data set is
the same), evaluates each, runs the benchmarks and writes results/: RESULTS.md (tables shaped
like the paper's, with its numbers beside ours, every cell the mean and min–max over the seeds,
and the comparisons the seeds do and do not support), one JSON per variant and seed in runs/,
tau_sweep.png, mask.png. With A = ar_steps and M = mars_steps of the config (times --steps-scale):

  ar_stage      AR SFT, A steps: the start of every MARS run of its seed           (τ = 1)
  ar_sft        AR SFT for A + M steps: the paper's fair baseline                  (τ = 1)
  mars_bB       MARS, B = 4 (the default B), 8, 16: M steps from ar_stage          (τ sweep)
  noar_bB       the same without L_AR (w_ar = 0)                                   (τ sweep)
  noar_invt_b4  w/o L_AR as the authors released it: each row's L_mask x 1/t        (τ sweep)
  bidir_b4      Block-Diffusion style: bidirectional inside a block, B = 4         (τ sweep)

Each variant is scored on the test split (accuracy at each τ, and the reference replies' NLL in
one-token mode, `evaluate.py --nll`: a measure that does not saturate at 100 %) and on the hard
split at τ = 1 (problems longer than training shows). mars_b4 at seed 0 is what `python
train.py` does (its MARS stage starts from the AR stage's weights with a fresh optimizer either
way; tests/test_reproduce.py). Resumable: a variant whose checkpoint and results JSON exist is
skipped, a killed training run continues from its last checkpoint. Variants train --jobs at a
time (default: CPUs / --threads, at most 4), each with its output in <its out_dir>/output.txt;
a MARS variant waits for its seed's AR stage. Checkpoints go to
out/reproduce/<A>+<M>-<hash>/s<seed>/, the hash covering the config and the training, data and
tokenizer sources, so a changed setting or source never reuses stale weights.

The package: __main__.py (the options and the order of the stages), runs.py (the variants
and seeds, their commands and the checkpoint hash), training.py (running them, --jobs at a
time, and the benchmarks), report.py (RESULTS.md and tau_sweep.png from the saved records
alone, no model needed).

    python -m scripts.reproduce             # 10 variants x seeds 0, 1, 2 (A = 4000, M = 1000): 76 min
    python -m scripts.reproduce --seeds 0   # one seed, a third of the time
    python -m scripts.reproduce --quick     # A, M / 4, 100 test problems, seed 0
    python -m scripts.reproduce --quick --steps-scale 0.02 --limit 20 --results /tmp/r   # smoke test
    python -m scripts.reproduce --replot    # tau_sweep.png again from results/runs/*.json alone
"""
