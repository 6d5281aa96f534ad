"""Proofs that the decoders sample what they claim (issue 13; docs/spec.md §5, sampling.py).

On a tiny random HF Qwen2 with an 8-token vocabulary (tests/sampling_reference.py), the
exact AR distribution of all 8^3 three-token continuations of a prompt is enumerated, at
temperature 1 and at temperature 0.7 with top-p 0.9. Claims, each able to fail:
  * our AR sampler (generate.generate_ar) with one Generator IS Hugging Face
    generate(do_sample=True) under the same seed, token for token (20,000 rows), and its
    counts pass the chi-square test against the exact distribution;
  * exact mode with drafts (K = 2 and 4) passes the same test at fewer forwards than
    tokens; the same test REJECTS exact mode with a deliberately wrong rule (accept every
    draft), and rejects τ-gated MARS sampling at τ = 0.1 (several tokens per forward that
    are not AR);
  * τ = 1 with sampling is the AR sampler token for token, in every cache mode, with the
    default per-row generators (ragged rows: EOS ends rows at different steps);
  * a row decoded in a batch equals the row decoded alone with its own seed (seed + b),
    for the AR sampler, the τ loop (every cache) and exact mode;
  * the command line and the chat sample: --temperature is the API's output, /temperature
    and friends change the settings, bad values are messages.
Temperature 0 is the default everywhere: tests/test_generate.py and tests/test_exact.py
prove it is still HF greedy.

The chi-square test is run at a fixed seed, so it is deterministic: not flaky. Every
reference asserts its top-p margin (no continuation within 1e-4 of the top-p edge), so
float rounding cannot move a token across the cut; the τ comparisons assert theirs.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from sampling_reference import (
    ar_distribution,
    chi_square,
    critical_value,
    hf_next_logits,
    histogram,
    tiny_hf_model,
    top_p_margin,
)
from transformers import GenerationConfig

import exact
import generate as generate_module
from exact import exact_steps, generate_exact
from generate import generate, generate_ar
from model import Qwen2
from sampling import Sampling, categorical

ROOT = Path(__file__).resolve().parent.parent
PROMPT, MASK, V, L, N = [1, 2, 3], 7, 8, 3, 20_000  # id 7 plays <|mask|> (and stays a token too)
SETTINGS = {"T=1": Sampling(temperature=1.0), "T=0.7,top-p=0.9": Sampling(temperature=0.7, top_p=0.9)}
RAGGED = [[1, 2, 3], [4, 1], [2, 2, 5, 1, 0, 3], [5], [3, 0, 4, 4]]  # no 6: the EOS of the ragged tests
EOS = 6
TAU_MARGIN = 1e-4



@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF tiny vocab-8 model, our Qwen2 with the same weights, its checkpoint path)."""
    path = tmp_path_factory.mktemp("v8")
    hf = tiny_hf_model(path)
    return hf, Qwen2.from_pretrained(str(path)).eval(), str(path)


@pytest.fixture(scope="module")
def reference(pair):
    """{setting: the exact distribution (8, 8, 8) of the first three sampled tokens}."""
    out = {}
    for name, s in SETTINGS.items():
        probs, margin = ar_distribution(hf_next_logits(pair[0]), PROMPT, L, V, s)
        assert margin > TAU_MARGIN, (name, margin)  # no continuation at the top-p edge
        out[name] = probs
    return out


def chi2(seqs, probs):
    """-> (statistic, critical value at 0.999) of the first L tokens of each row."""
    stat, df = chi_square(histogram(torch.tensor([r[:L] for r in seqs]), V), probs)
    assert df > 100  # a real distribution to test (hundreds of cells)
    return stat, critical_value(df)


# ---------------------------------------------------------------- the AR sampler
@pytest.mark.parametrize("name", SETTINGS)
def test_ar_sampler_is_hf_generate_and_passes_chi_square(pair, reference, name):
    hf, model, _ = pair
    s = SETTINGS[name]
    got = generate_ar(model, [PROMPT] * N, L, sampling=s, generators=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    gc = GenerationConfig(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0, max_new_tokens=L,
                          min_new_tokens=L, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT] * N), generation_config=gc)[:, len(PROMPT):]
    assert [g.ids for g in got] == ref.tolist()  # the same draws from the same stream
    stat, crit = chi2([g.ids for g in got], reference[name])
    assert stat < crit, (stat, crit)
    print(f"AR sampler {name}: chi2 {stat:.1f} < {crit:.1f}")


# ---------------------------------------------------------------- exact mode: AR in distribution
def accept_every_draft(p, q, d, n, gens):
    """A deliberately WRONG rule: keep every draft, then sample after the last one."""
    return n, categorical(p[torch.arange(len(n)), n], gens)


def exact_samples(model, s, K, chunk=1000):
    """N rows of exact mode (B = 4, K drafts), one Generator seeded 0, in batches of `chunk`
    rows (small batches run faster here), each run until every row has L tokens.
    max_new_tokens = K + 2, so the first step verifies all K drafts (a smaller budget would
    cut them) and the first L tokens come from every path: rejections, accepted drafts,
    bonus tokens. -> (ids per row, tokens, forwards, both summed over all rows)."""
    gen, out, forwards = torch.Generator().manual_seed(0), [], 0
    for _ in range(N // chunk):
        ids = [[] for _ in range(chunk)]
        for step in exact_steps(model, [PROMPT] * chunk, block_size=4, drafts=K, max_new_tokens=K + 2,
                                mask_id=MASK, sampling=s, generators=gen):
            ids = [r + t for r, t in zip(ids, step.tokens)]
            if min(map(len, ids)) >= L:
                break
        out, forwards = out + ids, forwards + step.forwards * chunk
    return out, sum(map(len, out)), forwards


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("name", SETTINGS)
def test_exact_mode_samples_the_ar_distribution(pair, reference, name, K):
    ids, tokens, forwards = exact_samples(pair[1], SETTINGS[name], K)
    stat, crit = chi2(ids, reference[name])
    assert stat < crit, (stat, crit)
    assert forwards < tokens  # drafts were accepted: fewer forwards than tokens
    print(f"exact {name} K={K}: chi2 {stat:.1f} < {crit:.1f}; {tokens / forwards:.3f} tokens/forward")


@pytest.mark.parametrize("name", SETTINGS)
def test_the_same_test_rejects_a_wrong_acceptance_rule(pair, reference, name, monkeypatch):
    monkeypatch.setattr(exact, "speculative_accept", accept_every_draft)
    ids, _, _ = exact_samples(pair[1], SETTINGS[name], 2)
    stat, crit = chi2(ids, reference[name])
    assert stat > 2 * crit, (stat, crit)  # rejected, widely (inf: mass on cells of probability 0)
    print(f"wrong rule {name}: chi2 {stat:.1f} > 2 x {crit:.1f}")


def test_the_same_test_rejects_tau_gated_sampling_at_low_tau(pair, reference):
    """τ-gated MARS at τ < 1 is not AR sampling: its c_j are drawn from mask distributions
    that never saw c_{j-1}. The test sees it (the τ loop is not exact; exact mode is)."""
    s = SETTINGS["T=1"]
    got = generate(pair[1], [PROMPT] * N, block_size=4, tau=0.1, max_new_tokens=L, mask_id=MASK, sampling=s,
                   generators=torch.Generator().manual_seed(0))
    assert sum(g.forwards for g in got) < L * N  # it did accept several tokens per forward
    stat, crit = chi2([g.ids for g in got], reference["T=1"])
    assert stat > 2 * crit, (stat, crit)
    print(f"MARS tau=0.1 T=1: chi2 {stat:.1f} > 2 x {crit:.1f}")


# ---------------------------------------------------------------- τ = 1 is the AR sampler
def ragged_prompts(n):
    return [RAGGED[i % len(RAGGED)] + [i % 6] for i in range(n)]


def check_top_p_margin(monkeypatch):
    """Spy on generate.pick (every draw of the AR sampler and of the τ loop: generate.candidates):
    record each call's top-p margin (sampling_reference.top_p_margin; inf when top-p is off)."""
    real, margins = generate_module.pick, [math.inf]

    def spy(logits, s, gens=None, *pick_args):
        if logits.numel():
            margins.append(top_p_margin(logits, s))
        return real(logits, s, gens, *pick_args)
    monkeypatch.setattr(generate_module, "pick", spy)
    return margins


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("cache", ["window", "none", "block"])
def test_tau1_sampling_is_the_ar_sampler_token_for_token(pair, name, cache, monkeypatch):
    """Default per-row generators (row b seeded seed + b) on both sides: at τ = 1 the MARS
    loop draws c_0 alone from row b's stream, exactly as the AR sampler draws its token."""
    model, s, prompts = pair[1], dataclasses.replace(SETTINGS[name], seed=3), ragged_prompts(64)
    margins = check_top_p_margin(monkeypatch)
    ar = [g.ids for g in generate_ar(model, prompts, 12, eos_ids=[EOS], sampling=s)]
    got = generate(model, prompts, block_size=4, tau=1.0, max_new_tokens=12, mask_id=MASK, eos_ids=[EOS],
                   cache=cache, block_cache_size=5, sampling=s)
    assert [g.ids for g in got] == ar
    assert len(set(map(len, ar))) > 3 and len(set(map(tuple, ar))) > 50  # ragged, and really sampled
    # no draw sat at the top-p edge (the two paths' logits may differ in the last bits)
    assert len(margins) > 12 and min(margins) > TAU_MARGIN


# ---------------------------------------------------------------- a row in a batch = the row alone
def check_tau_margin(monkeypatch):
    """Spy on generate.accept: every confidence compared with τ is >= TAU_MARGIN away."""
    real, gaps = generate_module.accept, []

    def spy(conf, tau, metric="probability"):
        if tau < 1 and conf.shape[1] > 1:
            gaps.append(float((conf[:, 1:] - tau).abs().min()))
        return real(conf, tau, metric)
    monkeypatch.setattr(generate_module, "accept", spy)
    return gaps


@pytest.mark.parametrize("decoder", ["ar", "window", "none", "block", "exact2", "exact4"])
def test_a_row_in_a_batch_equals_the_row_alone(pair, decoder, monkeypatch):
    """Per-row generators: row b of a ragged batch (seed s) equals the row decoded alone with
    seed s + b. Each kernel draws from row b's stream in an order that depends on row b only;
    the logits alone and batched may differ in the last bit, which could change a draw only at
    a near-tie of the multinomial (about 1e-7 per draw) or of τ (asserted away)."""
    model, prompts = pair[1], ragged_prompts(6)
    s = Sampling(temperature=0.8, seed=11)  # no top-p: τ is the only threshold (its margin asserted)
    gaps = check_tau_margin(monkeypatch)

    def run(ps, seed):
        kw = dict(max_new_tokens=10, eos_ids=[EOS], sampling=dataclasses.replace(s, seed=seed))
        if decoder == "ar":
            return generate_ar(model, ps, **kw)
        if decoder.startswith("exact"):
            return generate_exact(model, ps, block_size=4, drafts=int(decoder[-1]), mask_id=MASK, **kw)
        return generate(model, ps, block_size=4, tau=0.2, mask_id=MASK, cache=decoder, block_cache_size=5,
                        **kw)
    batch = run(prompts, s.seed)
    for b, p in enumerate(prompts):
        assert run([p], s.seed + b)[0].ids == batch[b].ids, b
    assert len(set(len(g.ids) for g in batch)) > 1  # ragged: rows finished at different steps
    if decoder != "ar":
        assert any(len(g.ids) > g.forwards for g in batch)  # several tokens in some forward
    if decoder in ("window", "none", "block"):
        assert min(gaps) >= TAU_MARGIN, min(gaps)


# ---------------------------------------------------------------- command line and chat
def cli(args, stdin=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the references here are fp32: pin the dtype `auto` would pick by the CPU (util/precision.py)
    return subprocess.run([sys.executable, "generate.py", *args, "--dtype", "float32"], cwd=ROOT, env=env,
                          text=True, input=stdin, capture_output=True, timeout=300)


def test_cli_temperature_is_the_api_output(pair):
    model, path = pair[1], pair[2]
    s = Sampling(temperature=0.7, top_k=5, top_p=0.9, seed=4)
    p = cli(["--ckpt", path, "--prompt-ids", "1,2,3", "--mask-id", str(MASK), "--block-size", "4",
             "--max-new-tokens", "12", "--json", "--exact", "--drafts", "2", "--temperature", "0.7",
             "--top-k", "5", "--top-p", "0.9", "--seed", "4"])
    assert p.returncode == 0, p.stderr
    ref = generate_exact(model, [PROMPT], block_size=4, drafts=2, max_new_tokens=12, mask_id=MASK, sampling=s)
    assert json.loads(p.stdout)["ids"] == ref[0].ids
    greedy = generate_exact(model, [PROMPT], block_size=4, drafts=2, max_new_tokens=12, mask_id=MASK)
    assert ref[0].ids != greedy[0].ids  # it did sample


def test_chat_sampling_commands(tmp_path):
    """/temperature, /top-p, /top-k, /seed, /accept-metric change the settings; bad values are
    messages and the session goes on; a reply at temperature 0.7 from seed 3 is the AR sampler's."""
    from data.bpe import train_bpe
    from tokenizer import Tokenizer

    train_bpe(["hello world, tell me more about the blue sky"], 20).save(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    make_hf_model(tmp_path, seed=5, vocab_size=tok.vocab_size, initializer_range=0.05)
    model = Qwen2.from_pretrained(str(tmp_path)).eval()
    eos = {tok.eos_id, tok.endoftext_id}
    ids = tok.encode_chat([{"role": "user", "content": "hello world"}], add_generation_prompt=True)
    s = Sampling(temperature=0.7, top_p=0.9, seed=3)
    ref = [t for t in generate_ar(model, [ids], 10, eos_ids=eos, sampling=s)[0].ids if t not in eos]
    text = tok.decode(ref)
    assert ref != [t for t in generate_ar(model, [ids], 10, eos_ids=eos)[0].ids if t not in eos]  # sampled
    stdin = ("/temperature -1\n/temperature x\n/top-p 0\n/top-k 2.5\n/accept-metric foo\n/seed\n"
             "/temperature 0.7\n/top-p 0.9\n/seed 3\nhello world\n/quit\n")
    p = cli(["--ckpt", str(tmp_path), "--chat", "--tau", "1", "--block-size", "4", "--max-new-tokens", "10"],
            stdin)
    assert p.returncode == 0, p.stderr
    for msg in ["error: /temperature must be >= 0, got -1", "error: /temperature needs a number, got 'x'",
                "error: /top-p must be in (0, 1], got 0.0", "error: /top-k needs an integer, got '2.5'",
                "error: /accept-metric must be one of probability, entropy, margin",
                "error: /seed needs a value", "temperature = 0.7", "top-p = 0.9", "seed = 3",
                f"> {text}\n[{len(ref)} tokens"]:
        assert msg in p.stdout, (msg, p.stdout)
