"""Proofs for L_AR = KL(teacher || model) (mars.teacher_kl, train.make_teacher; issue 21,
beyond the paper's CE of docs/spec.md §4), each against an independent reference:
  * with the whole vocabulary kept (k = V), the L_AR of mars_loss and ar_loss on a batch,
    teacher arrays carried through a prepared file and train.make_teacher, equals the
    full-vocabulary KL(teacher || student) of two HF models, brute force per target (and
    the CE on each EOS pad), normalised per sequence (§4), in float64;
  * with k < V the per-target value equals the formula written out element by element;
  * its gradient in the logits equals autograd of that written-out formula, and the
    closed form q - t (t = p on the top k, r q / Q off it), in float64;
  * with ar_target = "tokens" (the default) nothing changes: no teacher, and the L_AR of
    mars_loss and ar_loss is the CE of §4 written out on HF, in float64.
"""

import numpy as np
import torch
from conftest import hf_float64, make_hf_model

from data.batches import make_batch, make_teacher
from data.prepare import load_npz, save_npz
from mars import IGNORE, ar_loss, mars_loss, teacher_kl
from model import Qwen2
from settings import Settings

V, B, MASK, EOS, PAD = 256, 4, 255, 3, 0
SPECIAL = {"mask": MASK, "eos": EOS, "pad": PAD}


def rows_file(path, hf_teacher, n=5, seed=0):
    """A prepared file of n random rows (ids < 250, loss on a tail) whose teacher is
    hf_teacher's full distribution (k = V, sorted, rest 0) at every loss token, float64."""
    rng = np.random.default_rng(seed)
    ids, loss, off, logp, tid = [], [], [0], [], []
    for _ in range(n):
        length = int(rng.integers(7, 19))  # most rows not a multiple of B: EOS pads
        prompt = int(rng.integers(2, length - 2))
        row = rng.integers(4, 250, length).tolist()
        ids += row
        loss += [0] * prompt + [1] * (length - prompt)
        off.append(len(ids))
        with torch.no_grad():
            lp = torch.log_softmax(hf_teacher(torch.tensor([row])).logits[0].double(), -1)  # (length, V)
        srt = lp[prompt - 1:length - 1].sort(-1, descending=True)  # output i-1 predicts token i
        logp.append(srt.values.numpy())
        tid.append(srt.indices.numpy().astype(np.int32))
    t = np.concatenate(logp)
    save_npz({"ids": np.array(ids, np.int32), "loss": np.array(loss, np.uint8), "offsets": np.array(off),
              "t_logp": t, "t_ids": np.concatenate(tid), "t_rest": np.zeros(len(t))}, str(path))
    return load_npz(str(path))


def brute_force_l_ar(hf_teacher, hf_student, ids, labels):
    """Per target: sum_v p_v (log p_v - log q_v) over all V (p the teacher's softmax at the
    row's own, unpadded prefix), -log q(EOS) at an EOS pad; per-sequence mean, batch mean."""
    per_row = []
    for r in range(ids.shape[0]):
        with torch.no_grad():
            logq = torch.log_softmax(hf_student(ids[r:r + 1]).logits[0].double(), -1)
            logp = torch.log_softmax(hf_teacher(ids[r:r + 1]).logits[0].double(), -1)
        terms = []
        for i in range(1, ids.shape[1]):
            if labels[r, i] == IGNORE:
                continue
            real = i < n_real[r]
            terms.append(float((logp[i - 1].exp() * (logp[i - 1] - logq[i - 1])).sum()) if real
                         else -float(logq[i - 1, EOS]))
        per_row.append(sum(terms) / len(terms))
    return sum(per_row) / len(per_row)


n_real = []  # each batch row's length before the EOS pads (set by the test)


def test_full_vocabulary_kl_equals_the_top_k_form_at_k_equal_v(tmp_path):
    hf_teacher = make_hf_model(tmp_path / "t", seed=0, vocab_size=V)
    hf_student = make_hf_model(tmp_path / "s", seed=1, vocab_size=V)
    with hf_float64(hf_teacher, hf_student):  # HF without its fp32 RMSNorm cast and softmax
        check_full_vocabulary_kl(tmp_path, hf_teacher, hf_student)


def check_full_vocabulary_kl(tmp_path, hf_teacher, hf_student):
    student = Qwen2.from_pretrained(str(tmp_path / "s"), torch.float64)
    d = rows_file(tmp_path / "train.npz", hf_teacher)
    S = Settings(block_size=B, ar_target="teacher")
    rows = torch.arange(len(d["offsets"]) - 1)
    x, y, _ = make_batch(d, rows, S, SPECIAL, "cpu")
    teacher = make_teacher(d, rows, S, SPECIAL, "cpu")
    assert teacher["logp"].shape == (int((y[:, 1:] != IGNORE).sum()), V)  # one per target
    n_real[:] = np.diff(d["offsets"]).tolist()
    assert any(n % B for n in n_real)  # some rows have EOS pads: their one-hot teacher is checked
    want = brute_force_l_ar(hf_teacher, hf_student, x, y)
    with torch.no_grad():
        _, _, l_ar = mars_loss(student, x, y, MASK, B, ar_teacher=teacher)
        plain = ar_loss(student, x, y, ar_teacher=teacher)
    # float64 end to end on both sides (hf_float64): rounding ~1e-16, so 1e-12 holds anywhere
    assert abs(l_ar.item() - want) < 1e-12 * want and abs(plain.item() - l_ar.item()) < 1e-12 * want
    assert want > 0.5  # two random models: far apart, so the check is not 0 = 0


def written_out(logits, t_logp, t_ids, t_rest):
    """The top-k + rest formula element by element: sum_{i in S} p_i (log p_i - log q_i)
    + r (log r - log sum_{j not in S} q_j), q = softmax(logits)."""
    out = []
    for n in range(logits.shape[0]):
        q = torch.exp(logits[n]) / torch.exp(logits[n]).sum()
        top = set(t_ids[n].tolist())
        kl = sum(torch.exp(t_logp[n, i]) * (t_logp[n, i] - torch.log(q[t_ids[n, i]]))
                 for i in range(t_ids.shape[1]))
        rest_q = sum(q[j] for j in range(logits.shape[1]) if j not in top)
        out.append(kl + t_rest[n] * (torch.log(t_rest[n]) - torch.log(rest_q)))
    return torch.stack(out)


def random_teacher(n, k, seed):
    """A teacher distribution's top k (its k largest of V) and rest mass, float64."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(2 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    top = logp.topk(k, -1)
    return top.values, top.indices, 1 - top.values.exp().sum(-1)


def test_top_k_form_and_its_gradient_equal_the_written_out_formula():
    n, k = 6, 32
    t_logp, t_ids, t_rest = random_teacher(n, k, 0)
    assert (t_rest > 1e-3).all()  # the rest term is really exercised
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5
    a = logits.clone().requires_grad_()
    got = teacher_kl(a, t_logp, t_ids, t_rest)
    b = logits.clone().requires_grad_()
    want = written_out(b, t_logp, t_ids, t_rest)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    got.sum().backward()
    want.sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-13)
    # the closed form: q - t, t = p on the top k, r q / Q off it
    q = torch.softmax(logits, -1)
    t = (q * (t_rest / (1 - q.gather(1, t_ids).sum(1)))[:, None]).scatter(1, t_ids, t_logp.exp())
    assert torch.allclose(a.grad, q - t, rtol=0, atol=1e-13)


def test_the_top_k_form_is_below_the_full_kl_and_at_k_equal_v_is_it():
    g = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(2 * torch.randn(4, V, generator=g, dtype=torch.float64), -1)
    logits = torch.randn(4, V, generator=g, dtype=torch.float64)
    full = (logp.exp() * (logp - torch.log_softmax(logits, -1))).sum(-1)
    values = {}
    for k in (8, 64, V):
        top = logp.topk(k, -1)
        values[k] = teacher_kl(logits, top.values, top.indices, (1 - top.values.exp().sum(-1)).clamp_min(0))
    assert torch.allclose(values[V], full, rtol=1e-12, atol=0)
    assert (values[8] <= values[64] + 1e-12).all() and (values[64] <= full + 1e-12).all()  # coarser: less


def brute_force_ce(hf, ids, labels):
    """§4's L_AR written out: per target i, -log softmax(HF output i-1)[labels[i]] (EOS pads
    included), mean per sequence, then over the batch."""
    per_row = []
    for r in range(ids.shape[0]):
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[r:r + 1]).logits[0].double(), -1)
        terms = [-float(logp[i - 1, labels[r, i]]) for i in range(1, ids.shape[1]) if labels[r, i] != IGNORE]
        per_row.append(sum(terms) / len(terms))
    return sum(per_row) / len(per_row)


def test_tokens_target_makes_no_teacher_and_keeps_the_ce(tmp_path):
    """The default (ar_target = "tokens", the paper's): no teacher arrays, and the L_AR of
    mars_loss and ar_loss called without ar_teacher is the CE of §4 written out on HF, float64."""
    hf = make_hf_model(tmp_path / "t", seed=0, vocab_size=V)
    with hf_float64(hf):
        d = rows_file(tmp_path / "train.npz", hf, n=3)
        S = Settings(block_size=B)
        rows = torch.arange(3)
        assert S.ar_target == "tokens" and make_teacher(d, rows, S, SPECIAL, "cpu") is None
        student = Qwen2.from_pretrained(str(tmp_path / "t"), torch.float64)
        x, y, _ = make_batch(d, rows, S, SPECIAL, "cpu")
        want = brute_force_ce(hf, x, y)
    with torch.no_grad():
        l_ar, plain = mars_loss(student, x, y, MASK, B)[2].item(), ar_loss(student, x, y).item()
    # float64 end to end on both sides (hf_float64): rounding ~1e-16, so 1e-12 holds anywhere
    assert abs(l_ar - want) < 1e-12 * want and abs(plain - want) < 1e-12 * want
    # the CE is not the teacher's KL on the same rows (a default that used one would fail above)
    teacher = make_teacher(d, rows, Settings(block_size=B, ar_target="teacher"), SPECIAL, "cpu")
    with torch.no_grad():
        assert abs(ar_loss(student, x, y, ar_teacher=teacher).item() - want) > 1.0


def test_replies_stage_teacher_is_the_top_k_of_the_models_distribution(tmp_path):
    """scripts/real_model/replies.teacher_topk against HF's float64 softmax of the same weights: the k
    largest log-probabilities (float16) at their ids, and the rest's mass, before each target."""
    from scripts.real_model.replies import teacher_topk

    hf = make_hf_model(tmp_path / "m", seed=3, vocab_size=V).double()
    ours = Qwen2.from_pretrained(str(tmp_path / "m"))  # float32, as the replies stage runs
    prompt, targets, k = [5, 9, 11, 40, 7], [100, 3, 77, 12], 16
    logp, ids, rest = teacher_topk(ours, prompt, targets, k)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + targets])).logits[0].double(), -1)
    ref = ref[len(prompt) - 1:-1]  # (4, V): the output before each target
    top = ref.topk(k, -1)
    assert logp.shape == ids.shape == (len(targets), k) and logp.dtype == np.float16 and ids.dtype == np.int32
    assert (ids == top.indices.numpy()).all()  # the same tokens (margins checked below)
    gaps = top.values[:, :-1] - top.values[:, 1:]
    # no near-tie the fp32 model could order otherwise (measured gaps >= 1.2e-4, ~100x fp32's 1e-6)
    assert gaps.min() > 1e-4 and (top.values[:, -1] - ref.topk(k + 1, -1).values[:, -1]).min() > 1e-4
    # float16 storage rounds by half an ulp, at most 2^-9 ~ 1.95e-3 for |log p| < 8 (measured 1.85e-3);
    # the bound is one ulp of [4, 8)
    assert top.values.min() > -8
    assert np.abs(logp.astype(np.float64) - top.values.numpy()).max() < 2**-8
    want_rest = 1 - top.values.exp().sum(-1).numpy()  # float64; ours float32 (measured 3.1e-7 relative)
    assert np.allclose(rest, want_rest, rtol=1e-5, atol=0)
