"""Proofs for generate.py: MARS τ-gated decoding (docs/spec.md §5) and its KV caches (§6).

Claims, each against an independent reference:
  * τ = 1 is greedy AR: equal to HF `generate(do_sample=False)` token for token, batch 1
    and a left-padded HF batch, for every cache mode and for our AR decoder.
  * the no-cache loop is §5 written out: a brute-force loop on the HF model
    (HF forward of prefix + B masks, the rule applied literally).
  * every cache mode, batched, gives exactly the tokens of the no-cache loop run on
    each prompt alone, for τ in {0.95, 0.7, 0.3} and B in {2, 4, 8}.
  * forward counts, the live τ knob, EOS handling, and the CLI's behaviour.

For τ < 1 the models are made peaked (initializer_range=0.6) so that masks are often
confident and several tokens are accepted per step; each test asserts that this
happened, so none can pass vacuously. Exact equality between cache modes at τ < 1 is
a float question (a p within ~1e-7 of τ could flip): every τ < 1 test runs §5 written
out on HF (`reference_mars`), which asserts that each probability compared with τ is at
least TAU_MARGIN away from it and each accepted argmax has a top-2 logit gap above
PEAKED_GAP, so a near-tie fails loudly instead of flaking. Every τ = 1 comparison with HF
greedy asserts the gap on HF's path (greedy_margin.assert_no_near_tie).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import first_mid_step_token, hf_greedy, make_hf_model
from greedy_margin import assert_no_near_tie, top2_gap

from decoding import Knob
from generate import accept, generate, generate_ar, mars_decode
from model import Qwen2

ROOT = Path(__file__).resolve().parent.parent
MASK = 255  # the last id of the tiny vocab plays <|mask|>; prompts never contain it
PAD = 0
PROMPTS = [[5, 17, 99, 3, 40], [8, 1, 2, 3, 4, 5, 6, 7, 200], [42, 7]]
N_NEW = 24
TAU_MARGIN = 1e-4  # |p - τ| of every comparison; fp32 paths (ours, HF, cached) differ by ~1e-6
# top-2 logit gap of every accepted candidate on the peaked models (initializer_range 0.6), whose
# larger logits put fp32 paths up to 4.2e-5 apart (measured, 3 seeds; 5.4e-6 on the others): 24x
PEAKED_GAP = 1e-3
CONFIGS = {
    "gqa-tied": {},
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa8x1-untied-3layers": dict(num_attention_heads=8, num_key_value_heads=1, num_hidden_layers=3,
                                  tie_word_embeddings=False),
}



def load_pair(path, seed=0, **cfg):
    """(HF reference model, our model) with the same random weights."""
    hf = make_hf_model(path, seed=seed, **cfg)
    return hf, Qwen2.from_pretrained(str(path)).eval()


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A model whose mask predictions are often confident (a larger init std)."""
    # seed 1: seed 0 met a top-2 gap of 6.6e-5 on an accepted argmax, within fp32 reach (PEAKED_GAP)
    return load_pair(tmp_path_factory.mktemp("peaked"), seed=1, initializer_range=0.6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_pair(tmp_path_factory.mktemp("tiny"), seed=1)


@torch.no_grad()
def reference_mars(hf, prompt, B, taus, max_new, eos_ids=(), mask=MASK):
    """§5 written out on the HF model, one prompt. taus[i] is step i's τ (the last one
    repeats). Each step: a plain causal HF forward of prefix + B masks; c_j = argmax at
    position len(prefix)-1+j; accept c_0, then c_j while softmax prob >= τ (τ >= 1: c_0
    only); stop after an EOS or max_new tokens. -> (generated ids, accepted per step)."""
    out, counts = [], []
    while True:
        tau = taus[min(len(counts), len(taus) - 1)]
        seq = prompt + out
        logits = hf(torch.tensor([seq + [mask] * B])).logits[0].float()  # (len(seq)+B, V)
        accepted = []
        for j in range(B):
            row = logits[len(seq) - 1 + j]
            c = int(row.argmax())
            if j > 0 and tau < 1:
                p = float(row.softmax(-1)[c])
                assert abs(p - tau) >= TAU_MARGIN, f"near-tie: p={p} at tau={tau} (step {len(counts)})"
            if j > 0 and (tau >= 1 or p < tau):
                break
            # an accepted candidate is an argmax: no near-tie another fp32 path could flip
            assert top2_gap(row) > PEAKED_GAP, f"near-tie: top-2 gap {top2_gap(row):.1e} (step {len(counts)})"
            accepted.append(c)
        n = 0
        for t in accepted:
            out.append(t)
            n += 1
            if t in eos_ids or len(out) == max_new:
                return out, counts + [n]
        counts.append(n)


def run_steps(model, prompts, **kw):
    """Collect a mars_decode run -> (ids per row, list of Steps)."""
    steps = list(mars_decode(model, prompts, mask_id=MASK, **kw))
    ids = [[t for s in steps for t in s.tokens[b]] for b in range(len(prompts))]
    return ids, steps


def decode_tau1(model, prompts, decoder):
    """decoder "ar" (our AR decoder) or a MARS cache mode at τ = 1 -> generated ids per prompt."""
    if decoder == "ar":
        return [g.ids for g in generate_ar(model, prompts, N_NEW)]
    return [g.ids for g in generate(model, prompts, block_size=4, tau=1.0, max_new_tokens=N_NEW,
                                    mask_id=MASK, cache=decoder, block_cache_size=5)]


# ---------------------------------------------------------------- τ = 1 is greedy AR
@pytest.mark.parametrize("name", CONFIGS)
def test_tau1_equals_hf_greedy(tmp_path, name):
    hf, model = load_pair(tmp_path, seed=2, **CONFIGS[name])
    alone = [hf_greedy(hf, [p], N_NEW)[0] for p in PROMPTS]
    assert_no_near_tie(hf, PROMPTS, alone)  # so a mismatch below is a bug, not fp32 rounding
    batch = hf_greedy(hf, PROMPTS, N_NEW)  # HF left-pads; we right-pad internally
    assert batch == alone
    for decoder in ("ar", "none", "window", "block"):
        for p, ref in zip(PROMPTS, alone):
            assert decode_tau1(model, [p], decoder) == [ref], (decoder, p)
        assert decode_tau1(model, PROMPTS, decoder) == batch, decoder


def test_tau1_eos_equals_hf(tiny):
    hf, model = tiny
    free = hf_greedy(hf, PROMPTS[:1], N_NEW)[0]
    eos = next(t for i, t in enumerate(free) if i >= 4 and t not in free[:i])  # first seen at i >= 4
    ref = hf_greedy(hf, PROMPTS, N_NEW, eos_id=eos)
    assert ref[0][-1] == eos and len(ref[0]) < N_NEW
    assert_no_near_tie(hf, PROMPTS, ref)
    assert [g.ids for g in generate_ar(model, PROMPTS, N_NEW, eos_ids=[eos])] == ref
    for cache in ("none", "window", "block"):
        got = generate(model, PROMPTS, block_size=4, tau=1.0, max_new_tokens=N_NEW, mask_id=MASK,
                       eos_ids=[eos], cache=cache, block_cache_size=5)
        assert [g.ids for g in got] == ref, cache


# ---------------------------------------------------------------- the rule (§5)
def test_accept_rule_written_out():
    probs = torch.tensor([[0.1, 0.9, 0.5, 0.99],   # c_1 passes, c_2 fails: stop (c_3 never counts)
                          [0.1, 0.2, 0.99, 0.99],  # c_1 fails first
                          [0.1, 0.8, 0.8, 0.8],    # p == τ passes (>=): all four
                          [0.1, 1.0, 1.0, 1.0]])   # fp32 p of exactly 1.0
    assert accept(probs, 0.8).tolist() == [2, 1, 4, 4]
    assert accept(probs, 1.0).tolist() == [1, 1, 1, 1]  # τ >= 1: c_0 only, even with p == 1.0
    assert accept(probs, 1.5).tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("tau,B", [(0.7, 4), (0.3, 8)])
def test_nocache_loop_equals_rule_written_out_on_hf(peaked, tau, B):
    hf, model = peaked
    for p in PROMPTS:
        ref, ref_counts = reference_mars(hf, p, B, [tau], N_NEW)
        ids, steps = run_steps(model, [p], block_size=B, tau=tau, max_new_tokens=N_NEW, cache="none")
        assert ids[0] == ref and [s.counts[0] for s in steps] == ref_counts
    assert max(ref_counts) > 1


# ---------------------------------------------------------------- caches and batches (§6)
@pytest.mark.parametrize("B", [2, 4, 8])
@pytest.mark.parametrize("tau", [0.95, 0.7, 0.3])
def test_every_cache_mode_batched_equals_nocache_loop_alone(peaked, tau, B):
    hf, model = peaked
    kw = dict(block_size=B, tau=tau, max_new_tokens=N_NEW)
    alone = [run_steps(model, [p], cache="none", **kw) for p in PROMPTS]
    ref = [ids[0] for ids, _ in alone]
    assert ref == [reference_mars(hf, p, B, [tau], N_NEW)[0] for p in PROMPTS]  # and no near-tie
    assert any(c > 1 for _, steps in alone for s in steps for c in s.counts), "no multi-token step"
    for _, steps in alone:  # one forward per step, never more than B tokens per forward
        assert steps[-1].forwards == len(steps) and max(s.counts[0] for s in steps) <= B
    for cache, bc in [("none", None), ("window", None), ("block", 3), ("block", 16)]:
        ids, steps = run_steps(model, PROMPTS, cache=cache, block_cache_size=bc, **kw)
        assert ids == ref, (cache, bc)
        assert all(c <= B for s in steps for c in s.counts)


def test_forward_counts_at_tau1(tiny):
    hf, model = tiny
    kw = dict(tau=1.0, max_new_tokens=N_NEW, mask_id=MASK)
    for cache in ("none", "window"):  # one token per forward, the first forward is the prefill
        got = generate(model, PROMPTS, block_size=4, cache=cache, **kw)
        assert [g.forwards for g in got] == [len(g.ids) for g in got] == [N_NEW] * 3
    assert [g.forwards for g in generate_ar(model, PROMPTS, N_NEW)] == [N_NEW] * 3
    # block: 1 prefill + N_NEW inner steps + an extension per block filled before the end
    for bc in (5, 8, 24):
        got = generate(model, PROMPTS, block_size=4, cache="block", block_cache_size=bc, **kw)
        assert [g.forwards for g in got] == [N_NEW + math.ceil(N_NEW / bc)] * 3
    # B = 1: a block's first token comes from the stored last logit, no inner forward
    got = generate(model, PROMPTS, block_size=1, cache="block", block_cache_size=5, **kw)
    assert [g.forwards for g in got] == [N_NEW] * 3
    ref = [hf_greedy(hf, [p], N_NEW)[0] for p in PROMPTS]
    assert_no_near_tie(hf, PROMPTS, ref)
    assert [g.ids for g in got] == [g.ids for g in generate_ar(model, PROMPTS, N_NEW)] == ref


def test_block_forward_count_below_tau1(peaked):
    """Block mode, batch 1: 1 prefill + 1 per step + 1 extension each time the block's
    filled slots reach B_cache (a step may run past the edge) before the end."""
    hf, model = peaked
    kw = dict(block_size=4, tau=0.3, max_new_tokens=N_NEW)
    for p in PROMPTS:
        _, ref_steps = run_steps(model, [p], cache="none", **kw)
        counts = [s.counts[0] for s in ref_steps]
        assert counts == reference_mars(hf, p, 4, [0.3], N_NEW)[1]  # and no near-tie
        extensions, filled = 0, 0
        for c in counts[:-1]:
            filled += c
            if filled >= 5:
                extensions, filled = extensions + 1, 0
        _, steps = run_steps(model, [p], cache="block", block_cache_size=5, **kw)
        assert [s.counts[0] for s in steps] == counts
        assert steps[-1].forwards == 1 + len(counts) + extensions
    assert max(counts) > 1


# ---------------------------------------------------------------- τ knob and EOS
@pytest.mark.parametrize("cache", ["none", "window", "block"])
def test_tau_knob_changes_acceptance_from_next_step(peaked, cache):
    hf, model = peaked
    p, B, k = PROMPTS[0], 4, 3
    knob, counts, ids = Knob(0.3), [], []
    for i, step in enumerate(mars_decode(model, [p], block_size=B, tau=knob, max_new_tokens=N_NEW,
                                        mask_id=MASK, cache=cache, block_cache_size=5)):
        counts.append(step.counts[0])
        ids += step.tokens[0]
        if i == k - 1:
            knob.tau = 1.0  # from step k on: AR
    assert max(counts[:k]) > 1 and set(counts[k:]) == {1}
    assert (ids, counts) == reference_mars(hf, p, B, [0.3] * k + [1.0], N_NEW)


@pytest.mark.parametrize("cache", ["none", "window", "block"])
def test_eos_mid_step_stops_and_drops_the_rest(peaked, cache):
    hf, model = peaked
    kw = dict(block_size=4, tau=0.3, max_new_tokens=N_NEW)
    (free,), steps = run_steps(model, PROMPTS[:1], cache="none", **kw)
    assert free == reference_mars(hf, PROMPTS[0], 4, [0.3], N_NEW)[0]  # and no near-tie
    eos, i = first_mid_step_token(steps)
    ids, steps = run_steps(model, PROMPTS[:1], cache=cache, eos_ids=[eos], block_cache_size=5, **kw)
    assert ids[0] == free[: i + 1]  # stops at the EOS, which is kept; what followed is dropped
    assert steps[-1].done == [True]
    # in a batch, the row that meets the EOS stops and the others go on as if alone
    alone = [run_steps(model, [p], cache="none", eos_ids=[eos], **kw)[0][0] for p in PROMPTS]
    assert run_steps(model, PROMPTS, cache=cache, eos_ids=[eos], block_cache_size=5, **kw)[0] == alone


# ---------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def cli_ckpt(tmp_path_factory):
    """A tokenizer-less checkpoint whose config.json names an EOS id that greedy decoding
    meets, plus the HF greedy output with that EOS."""
    path = tmp_path_factory.mktemp("cli")
    hf = make_hf_model(path, seed=3, max_position_embeddings=64)
    free = hf_greedy(hf, [PROMPTS[0]], 12)[0]
    assert_no_near_tie(hf, [PROMPTS[0]], [free])  # the CLI decodes in fp32 (--compile: packed) apart from HF
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    return str(path), hf_greedy(hf, [PROMPTS[0]], 12, eos_id=eos)[0]


BAD_INPUT = {  # CLI arguments overriding a valid call -> the message naming the problem
    "tau zero": (["--tau", "0"], "tau must be > 0"),
    "tau negative": (["--tau", "-0.5"], "tau must be > 0"),
    "block size zero": (["--block-size", "0"], "block-size must be >= 1"),
    "empty prompt": (["--prompt-ids", ""], "empty prompt"),
    "non-numeric ids": (["--prompt-ids", "1,x,3"], "comma-separated integers"),
    "prompt too long": (["--prompt-ids", ",".join(["5"] * 65)], "longer than the model's context"),
    "missing checkpoint": (["--ckpt", "/nonexistent/ckpt"], "checkpoint directory not found"),
    "no mask id": (["--mask-id", None], "--mask-id is required"),
    "text prompt, no tokenizer": (["--prompt-ids", None, "--prompt", "Hi"], "no tokenizer files"),
    "temperature negative": (["--temperature", "-1"], "error: --temperature must be >= 0, got -1"),
    "top-p zero": (["--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0"),
    "top-p above one": (["--top-p", "1.5"], "error: --top-p must be in (0, 1], got 1.5"),
    "top-k negative": (["--top-k", "-1"], "error: --top-k must be an integer >= 0 (0 = off), got -1"),
    "unknown metric": (["--accept-metric", "confidence"],
                       "error: --accept-metric must be one of probability, entropy, margin, "
                       "got 'confidence'"),
    "entropy tau negative": (["--accept-metric", "entropy", "--tau", "-1"],
                             "tau must be >= 0 for the entropy metric (0 = AR)"),
}


# BAD_INPUT's command lines in one interpreter (one Python + torch start-up, not 15), each ending
# as `python generate.py ARGS` ends: main's return code, SystemExit's (argparse's 2; a message is
# printed, 1), or an exception's traceback printed, 1
BAD_INPUT_RUNS = """
import contextlib, io, json, sys, traceback
import generate
out = {}
for name, args in json.loads(sys.argv[1]).items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            rc = generate.main(args)
        except SystemExit as e:
            rc = e.code
            if not (rc is None or isinstance(rc, int)):
                print(rc, file=sys.stderr)
                rc = 1
        except Exception:
            traceback.print_exc()
            rc = 1
    out[name] = [rc or 0, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cli_runs(cli_ckpt):
    """Every CLI case of this file, started at once: the two decodes as `python generate.py`, the
    bad inputs in one interpreter (BAD_INPUT_RUNS) -> {case: (returncode, stdout, stderr)}."""
    ckpt = cli_ckpt[0]
    cases = {"ok": ["--ckpt", ckpt, "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--mask-id",
                    str(MASK), "--tau", "1", "--block-size", "4", "--max-new-tokens", "12", "--json",
                    "--dtype", "float32"]}  # the reference is fp32, whatever `auto` picks on this CPU
    cases["compiled"] = cases["ok"] + ["--compile"]
    bad = {}
    for name, (override, _) in BAD_INPUT.items():
        args = {"--ckpt": ckpt, "--prompt-ids": "5,17,99", "--mask-id": str(MASK)}
        args.update(zip(override[::2], override[1::2]))
        bad[name] = [x for k, v in args.items() if v is not None for x in (k, v)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commands = {name: ["generate.py", *args] for name, args in cases.items()}
    commands["bad"] = ["-c", BAD_INPUT_RUNS, json.dumps(bad)]
    procs = {name: subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, command in commands.items()}
    outputs = {name: p.communicate(timeout=300) for name, p in procs.items()}
    runs = {name: (procs[name].returncode, *outputs[name]) for name in cases}
    rc, stdout, stderr = procs["bad"].returncode, *outputs["bad"]
    assert rc == 0, stderr
    return runs | {name: tuple(run) for name, run in json.loads(stdout).items()}


def test_cli_prompt_ids_json_without_tokenizer(cli_ckpt, cli_runs):
    rc, stdout, stderr = cli_runs["ok"]
    assert rc == 0, stderr
    assert stderr.splitlines()[0] == "[float32: the reference (--fast for the engine)]", stderr
    out = json.loads(stdout)
    ref = cli_ckpt[1]
    assert out["ids"] == ref and out["forwards"] == len(ref)  # stopped at config.json's EOS


def test_cli_compile_gives_the_same_reply(cli_ckpt, cli_runs):
    """generate.py --compile (the step compiled by inductor, the first reply paying the compile):
    HF's greedy reply and forward count, as without the flag (cli_ckpt's near-tie guard, 1e-4,
    is 5x the compiled step's bound, tests/test_compile.py's COMPILED_LOGITS_ATOL). --compile
    decodes through the engine (fast.make_fast), and says so."""
    rc, stdout, stderr = cli_runs["compiled"]
    assert rc == 0, stderr
    assert stderr.splitlines()[0] == "[float32: as set; the engine, compiled]", stderr
    out = json.loads(stdout)
    assert out["ids"] == cli_ckpt[1] and out["forwards"] == len(cli_ckpt[1])


@pytest.mark.parametrize("case", BAD_INPUT)
def test_cli_bad_input_is_a_clear_error(cli_runs, case):
    rc, _, stderr = cli_runs[case]
    assert rc == 2 and BAD_INPUT[case][1] in stderr, stderr
    assert "Traceback" not in stderr


def test_chat_keeps_the_conversation_and_reads_tau_per_reply(tmp_path):
    """`generate.py --chat` (chat.py): reply 1 at τ = 1 is §5 written out on HF for the templated
    user turn; `/tau 0.5` then applies to reply 2, which is §5 on HF for the whole conversation
    (reply 1 as the assistant turn); a bad `/tau` is a message and the session goes on."""
    from data.bpe import train_bpe
    from tokenizer import Tokenizer

    train_bpe(["hello world, tell me more about the blue sky"], 20).save(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    hf = make_hf_model(tmp_path, seed=5, vocab_size=tok.vocab_size, initializer_range=0.6)
    cfg_eos = json.loads((tmp_path / "config.json").read_text()).get("eos_token_id")
    eos = {tok.eos_id, tok.endoftext_id} | set([cfg_eos] if isinstance(cfg_eos, int) else cfg_eos or [])
    msgs = [{"role": "user", "content": "hello world"}]
    ids1, counts1 = reference_mars(hf, tok.encode_chat(msgs, add_generation_prompt=True), 4, [1.0], 10,
                                   eos, mask=tok.mask_id)
    text1 = tok.decode([t for t in ids1 if t not in eos])
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": "tell me more"}]
    ids2, counts2 = reference_mars(hf, tok.encode_chat(msgs, add_generation_prompt=True), 4, [0.5], 10,
                                   eos, mask=tok.mask_id)
    assert max(counts2) > 1  # τ = 0.5 did accept several tokens in a forward: the test can fail
    text2 = tok.decode([t for t in ids2 if t not in eos])
    stdin = "hello world\n/tau 0.5\n/tau abc\ntell me more\n/quit\n"
    p = subprocess.run([sys.executable, "generate.py", "--ckpt", str(tmp_path), "--chat", "--tau", "1",
                        "--block-size", "4", "--max-new-tokens", "10", "--dtype", "float32"], cwd=ROOT,
                       input=stdin, text=True, capture_output=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    n1, n2 = len(ids1), len(ids2)  # tokens generated, EOS included: the count generate.py prints
    assert f"> {text1}\n[{n1} tokens, {len(counts1)} forwards," in p.stdout, p.stdout
    assert "> tau = 0.5\n> error: /tau needs a number > 0" in p.stdout, p.stdout
    assert f"> {text2}\n[{n2} tokens, {len(counts2)} forwards," in p.stdout, p.stdout
