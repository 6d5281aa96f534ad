"""The real-model experiment: MARS on SmolLM2-135M-Instruct against AR SFT on the same rows,
end to end and resumable (issues 15, 21, 33), run as `python -m scripts.real_model`.

    __main__.py    the CLI and the order of the stages (what each stage is: its docstring)
    run.py         a run's config, directory and stages.json; stage keys; shared helpers
    stages.py      each stage's key, outputs and the function that makes them
    replies.py     the base's replies, its top-k teacher arrays, train.npz / val.npz
    committed.py   rows kept in git: --export-rows, and their import by a later run
    training.py    train.py in a subprocess, checkpoints filed as snapshots
    evaluation.py  quality: teacher-forced agreement / KL / NLL, greedy replies, τ sweep, curve,
                   the cluster bootstrap
    reliability.py why the τ rule accepts what it does: each mask position's candidates and
                   confidences against greedy AR, binned; the lossless τ of a sweep
    speed.py       the lossless decoders: tokens per forward and the wall clock (paired ratios)
    page.py        which page a results.json gets (round 2's or round 3's), written with its
                   figures and summary.json: the results stage and --report call it
    round3.py      round 3's page: the comparison arms, reliability, paired speed, targets
    report.py      round 2's page from results.json alone, and the cells round3.py shares
    protocol.py    the task protocol (issue 54, "protocol": "tasks"): the task set, AR SFT, MARS from
                   its weights, AR SFT continued; the stages' recorded settings checked
    ceiling.py     the τ rule's ceiling: what a perfect mask could accept on given replies (issue 54)
    task_eval.py   the task protocol's evaluation on test, in resumable pieces: accuracy, the τ sweep,
                   exact mode, the wall clock, the ceiling; round 3's ceiling; results.json's numbers
    task_page.py   the task protocol's page (RESULTS.md, tau_sweep.png) from results.json alone
    task_pilot.py  the task protocol's pilot on validation: lr and stage 1's steps chosen by its rule
    task_speed.py  the task model timed as a user runs it: the reference, the engine, its loops, HF
    clustered.py   a paired two-stage bootstrap: templates, then problems within them (issue 61)
    task2.py       issue 61's protocol ("protocol": "tasks2"): task set v2, each arm's lr and steps
                   chosen on validation, two seeds
    task2_decode.py  its decoding: every decode on the engine in batches, as resumable pieces, and
                   the engine checked against the reference decoders
    task2_page.py  its results.json (clustered intervals) and RESULTS.md from results.json alone

Imports run down: __main__ -> protocol -> (task_eval -> stages, task_page -> report), __main__ ->
task2_page -> (task2 -> (stages, task2_decode), task2_decode, clustered); stages ->
(replies, committed, training, evaluation, speed, page -> round3 -> report) -> reliability,
ceiling, run -> the core (root modules, data/, util/, scripts/common.py); never another script's
package. Nothing is imported here: each user imports the module it needs.
"""
