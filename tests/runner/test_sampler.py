"""Sampler: checked against hand-computed values and per-row Python references."""

import math
import random

import pytest
import torch

from ingot.runner.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from ingot.sampling_params import SamplingParams

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def row(prompt=(), output=(), generator=None, eos=(), **kw):
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), generator, tuple(eos))


def py_argmax(values):
    """Index of the first maximum (torch.argmax's tie rule)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def py_softmax(values):
    m = max(values)
    e = [math.exp(v - m) for v in values]
    s = sum(e)
    return [v / s for v in e]


def logits_of(probs):
    return [math.log(p) if p > 0 else -math.inf for p in probs]


def chi_square(counts, probs, n):
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


# -- greedy -------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(device, dtype):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 300, generator=g).to(dtype)
    logits[3, 17] = logits[3, 250] = 50.0  # tie: lowest index wins
    logits[5, :] = 0.0  # all tied -> 0
    rows = [row(temperature=0.0) for _ in range(9)]
    out = Sampler(device)(logits.to(device), rows)
    ref = [py_argmax(r) for r in logits.float().tolist()]
    assert out.token_ids == ref
    assert out.token_ids[3] == 17 and out.token_ids[5] == 0
    assert out.logprobs == [None] * 9
    assert all(type(t) is int for t in out.token_ids)


def test_greedy_rows_in_mixed_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 64, generator=g)
    rows = [row(temperature=0.0 if i % 2 == 0 else 1.0, top_k=5 if i == 2 else 0) for i in range(6)]
    out = Sampler(CPU, seed=3)(logits, rows)
    for i in (0, 2, 4):
        assert out.token_ids[i] == py_argmax(logits[i].tolist())


def test_top_k_one_equals_greedy():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 200, generator=g) * 3
    sampler = Sampler(CPU, seed=5)
    ref = [py_argmax(r) for r in logits.tolist()]
    for temperature in (0.3, 1.0, 5.0):
        for _ in range(3):
            out = sampler(logits, [row(temperature=temperature, top_k=1) for _ in range(64)])
            assert out.token_ids == ref


def test_empty_batch():
    out = Sampler(CPU)(torch.zeros(0, 10), [])
    assert out == SamplerOutput([], [])


# -- truncation never samples excluded tokens --------------------------------

N_DRAWS = 4000


def draw_many(probs, n=N_DRAWS, seed=0, **kw):
    """Tokens sampled for ``n`` identical rows of logits log(probs)."""
    logits = torch.tensor([logits_of(probs)] * n)
    out = Sampler(CPU, seed=seed)(logits, [row(**kw)] * n)  # one row object, n rows
    return out.token_ids


# Vocabulary order deliberately scrambled, so the sort/unsort is exercised.
PROBS = [0.05, 0.30, 0.02, 0.40, 0.08, 0.15]  # ranks: 3 > 1 > 5 > 4 > 0 > 2


@pytest.mark.parametrize("top_k, allowed", [
    (1, {3}), (2, {3, 1}), (3, {3, 1, 5}), (5, {3, 1, 5, 4, 0}), (6, set(range(6))), (100, set(range(6))),
])
def test_top_k_support(top_k, allowed):
    seen = set(draw_many(PROBS, top_k=top_k))
    assert seen == allowed  # never outside, and (with 4000 draws) every allowed token shows up


@pytest.mark.parametrize("top_p, allowed", [
    (0.1, {3}),            # 0.40 >= 0.1
    (0.39, {3}),
    (0.5, {3, 1}),         # 0.40 < 0.5 -> add 0.30
    (0.8, {3, 1, 5}),      # 0.70 < 0.8 -> add 0.15
    (0.9, {3, 1, 5, 4}),   # 0.85 < 0.9 -> add 0.08
    (0.96, {3, 1, 5, 4, 0}),
    (1.0, set(range(6))),
])
def test_top_p_support(top_p, allowed):
    seen = set(draw_many(PROBS, top_p=top_p))
    assert seen == allowed


@pytest.mark.parametrize("min_p, allowed", [
    (0.0, set(range(6))),
    (0.1, {3, 1, 5, 4, 0}),  # floor 0.04
    (0.15, {3, 1, 5, 4}),    # floor 0.06
    (0.3, {3, 1, 5}),        # floor 0.12
    (0.5, {3, 1}),           # floor 0.20
    (0.9, {3}),              # floor 0.36
    (1.0, {3}),
])
def test_min_p_support(min_p, allowed):
    seen = set(draw_many(PROBS, min_p=min_p))
    assert seen == allowed


def test_truncation_applies_after_temperature():
    # T=0.5 squares then renormalises the probabilities: 0.4^2 : 0.3^2 : 0.15^2 ...
    sq = [p * p for p in PROBS]
    sq = [p / sum(sq) for p in sq]  # 3: 0.5229, 1: 0.2941, 5: 0.0735 ...
    assert sq[3] + sq[1] > 0.8 > sq[3]
    seen = set(draw_many(PROBS, temperature=0.5, top_p=0.8))
    assert seen == {3, 1}


def test_mixed_truncations_in_one_batch():
    configs = [dict(top_k=2), dict(top_p=0.5), dict(min_p=0.3), dict(),
               dict(top_k=3, top_p=0.5), dict(top_k=4, min_p=0.5), dict(temperature=0.0, top_k=3)]
    allowed = [{3, 1}, {3, 1}, {3, 1, 5}, set(range(6)), {3, 1}, {3, 1}, {3}]
    reps = 800
    n = len(configs) * reps
    logits = torch.tensor([logits_of(PROBS)] * n)
    protos = [row(**c) for c in configs]
    rows = [protos[i % len(configs)] for i in range(n)]
    out = Sampler(CPU, seed=11)(logits, rows)
    seen = [set() for _ in configs]
    for i, t in enumerate(out.token_ids):
        seen[i % len(configs)].add(t)
    assert seen == allowed


def test_masked_logits_are_never_sampled():
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]] * 2000)
    assert set(Sampler(CPU)(logits, [row()] * 2000).token_ids) == {0, 2}


# -- distribution -------------------------------------------------------------

# chi-square critical value for 4 degrees of freedom at p = 1e-4 is ~23.5
CHI2_4DOF = 23.5


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_distribution(temperature, dtype):
    raw = [1.0, 0.5, 0.0, -1.0, 2.0]
    expected = py_softmax([v / temperature for v in raw])
    n = 20000
    logits = torch.tensor([raw] * n, dtype=dtype)  # all exactly representable in bf16
    out = Sampler(CPU, seed=123)(logits, [row(temperature=temperature)] * n)
    counts = [out.token_ids.count(i) for i in range(5)]
    assert chi_square(counts, expected, n) < CHI2_4DOF, (counts, expected)


def test_top_k_renormalised_distribution():
    # top_k=3 keeps {3, 1, 5}; they keep their relative odds 0.40 : 0.30 : 0.15
    n = 20000
    toks = draw_many(PROBS, n=n, seed=7, top_k=3)
    counts = [toks.count(t) for t in (3, 1, 5)]
    expected = [0.40 / 0.85, 0.30 / 0.85, 0.15 / 0.85]
    assert sum(counts) == n
    # 2 degrees of freedom, p = 1e-4: ~18.4
    assert chi_square(counts, expected, n) < 18.4, counts


def test_sequential_draws_follow_distribution():
    # Single row, many calls: the sampler's generator advances between calls.
    raw = [0.0, 1.0, 2.0]
    expected = py_softmax(raw)
    sampler = Sampler(CPU, seed=9)
    logits = torch.tensor([raw])
    toks = [sampler(logits, [row()]).token_ids[0] for _ in range(3000)]
    counts = [toks.count(i) for i in range(3)]
    assert chi_square(counts, expected, 3000) < 18.4, counts


# -- seeds ---------------------------------------------------------------------


def seeded_tokens(seed, logits_row, batch_builder, steps=12):
    """Tokens the seeded row gets at each step, inside the batch the builder makes."""
    gen = make_generator(seed, CPU)
    toks = []
    for step in range(steps):
        logits, rows, pos = batch_builder(step, logits_row, gen)
        toks.append(Sampler(CPU, seed=1000 + step)(logits, rows).token_ids[pos])
    return toks


def alone(step, logits_row, gen):
    return logits_row[None], [row(generator=gen, seed=42, top_p=0.95)], 0


def make_batch(position, size, other_seeded):
    def build(step, logits_row, gen):
        g = torch.Generator().manual_seed(500 + step)
        logits = torch.randn(size, logits_row.shape[0], generator=g) * 2
        logits[position] = logits_row
        rows = []
        for i in range(size):
            if i == position:
                rows.append(row(generator=gen, seed=42, top_p=0.95))
            elif other_seeded and i % 2 == 0:
                rows.append(row(generator=make_generator(i + step, CPU), seed=i + step,
                                temperature=0.8, top_k=20))
            elif i % 3 == 0:
                rows.append(row(temperature=0.0))
            else:
                rows.append(row(temperature=1.3, min_p=0.05, presence_penalty=0.5, output=[1, 2]))
        return logits, rows, position
    return build


def test_seeded_row_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(77)
    logits_row = torch.randn(500, generator=g)  # flat-ish: draws differ step to step
    ref = seeded_tokens(42, logits_row, alone)
    assert len(set(ref)) > 3
    for position, size, other_seeded in [(0, 4, False), (3, 4, True), (6, 7, True), (2, 9, False)]:
        assert seeded_tokens(42, logits_row, make_batch(position, size, other_seeded)) == ref
    # and a different seed gives a different stream
    assert seeded_tokens(43, logits_row, alone) != ref


def test_unseeded_reproducible_from_sampler_seed():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 400, generator=g)
    rows = [row() for _ in range(16)]
    a = [Sampler(CPU, seed=5)(logits, rows).token_ids for _ in range(2)]
    s = Sampler(CPU, seed=5)
    b = [s(logits, rows).token_ids, s(logits, rows).token_ids]
    assert a[0] == a[1] == b[0]
    assert b[1] != b[0]


def test_make_generator_accepts_any_int():
    for seed in (0, -1, 2**63, 2**64 + 5):
        gen = make_generator(seed, CPU)
        assert isinstance(gen, torch.Generator)
    a = torch.rand(4, generator=make_generator(-1, CPU))
    b = torch.rand(4, generator=make_generator(2**64 - 1, CPU))
    assert torch.equal(a, b)


# -- penalties -----------------------------------------------------------------

RAW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


@pytest.mark.parametrize("kw, prompt, output, expected", [
    # repetition 2 over prompt+output {0, 1, 3, 4}: positive / 2, negative * 2
    (dict(repetition_penalty=2.0), [0, 1], [3, 3, 4], [1.0, -2.0, 0.5, 1.5, -4.0, 1.0]),
    # repetition 0.5 (< 1) boosts instead
    (dict(repetition_penalty=0.5), [2], [1], [2.0, -0.5, 1.0, 3.0, -2.0, 1.0]),
    # presence 0.5 + frequency 0.25 over output counts {3: 2, 4: 1}; prompt ignored
    (dict(presence_penalty=0.5, frequency_penalty=0.25), [0, 1], [3, 3, 4],
     [2.0, -1.0, 0.5, 2.0, -2.75, 1.0]),
    # negative presence / frequency raise the logits
    (dict(presence_penalty=-1.0, frequency_penalty=-0.5), [], [5, 5, 5, 0],
     [3.5, -1.0, 0.5, 3.0, -2.0, 3.5]),
    # all three: repetition first, then the OpenAI penalties
    (dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), [0, 1], [3, 3, 4],
     [1.0, -2.0, 0.5, 0.5, -4.75, 1.0]),
    # no output yet: the OpenAI penalties do nothing
    (dict(presence_penalty=2.0, frequency_penalty=2.0), [0, 1, 2], [], RAW),
])
def test_penalties_hand_computed(kw, prompt, output, expected):
    logits = torch.tensor([RAW])
    rows = [row(prompt, output, temperature=0.0, **kw)]
    got = Sampler(CPU).process_logits(logits, rows)
    assert got.dtype == torch.float32
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert logits[0].tolist() == RAW  # input untouched
    # greedy picks the argmax of the penalised logits
    assert Sampler(CPU)(logits, rows).token_ids == [py_argmax(expected)]


def reference_penalties(logits, prompt, output, rep, pres, freq):
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        c = output.count(t)
        out[t] -= freq * c + pres
    return out


def test_penalties_random_batch_vs_python_loop():
    rnd = random.Random(0)
    V, B = 50, 10
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g) * 3
    rows, refs = [], []
    for i in range(B):
        prompt = [rnd.randrange(V) for _ in range(rnd.randrange(0, 30))]
        output = [rnd.randrange(V) for _ in range(rnd.randrange(0, 30))]
        rep = rnd.choice([1.0, 1.3, 0.7])
        pres = rnd.choice([0.0, 0.4, -1.5])
        freq = rnd.choice([0.0, 0.2, 2.0])
        rows.append(row(prompt, output, repetition_penalty=rep, presence_penalty=pres,
                        frequency_penalty=freq, temperature=0.0))
        refs.append(reference_penalties(logits[i].tolist(), prompt, output, rep, pres, freq))
    got = Sampler(CPU).process_logits(logits, rows)
    for i in range(B):
        assert got[i].tolist() == pytest.approx(refs[i], abs=1e-5)
    out = Sampler(CPU)(logits, rows)
    assert out.token_ids == [py_argmax(r) for r in refs]


def test_presence_penalty_flips_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert Sampler(CPU)(logits, [row(output=[0], temperature=0.0)]).token_ids == [0]
    assert Sampler(CPU)(logits, [row(output=[0], temperature=0.0, presence_penalty=0.2)]).token_ids == [1]


def test_penalties_only_touch_their_rows():
    logits = torch.tensor([RAW] * 3)
    rows = [row([0], [3], temperature=0.0), row([0], [3], temperature=0.0, repetition_penalty=3.0),
            row([0], [3], temperature=0.0)]
    got = Sampler(CPU).process_logits(logits, rows)
    assert got[0].tolist() == RAW and got[2].tolist() == RAW
    assert got[1].tolist() == pytest.approx([2 / 3, -1.0, 0.5, 1.0, -2.0, 1.0])


def test_penalty_changes_sampled_distribution():
    # token 0 seen 3 times, frequency 2 -> logit -6: practically never drawn
    n = 3000
    logits = torch.tensor([[1.0, 0.0, 0.0]] * n)
    rows = [row(output=[0, 0, 0], frequency_penalty=2.0)] * n
    toks = Sampler(CPU, seed=1)(logits, rows).token_ids
    expected = py_softmax([1.0 - 6.0, 0.0, 0.0])
    counts = [toks.count(i) for i in range(3)]
    assert chi_square(counts, expected, n) < 18.4, counts


# -- min_tokens ---------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_greedy():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 7.0]])  # eos=3, stop id 4
    def tok(n_out, **kw):
        rows = [row(output=[0] * n_out, eos=(3,), temperature=0.0, stop_token_ids=[4], **kw)]
        return Sampler(CPU)(logits, rows).token_ids[0]
    assert tok(0, min_tokens=3) == 5
    assert tok(2, min_tokens=3) == 5
    assert tok(3, min_tokens=3) == 3
    assert tok(0) == 3
    assert tok(1, min_tokens=3, ignore_eos=True) == 5  # min_tokens still applies


def test_min_tokens_masks_eos_when_sampling():
    n = 2000
    logits = torch.tensor([[0.0, 0.0, 6.0, 6.0]] * n)  # eos 2, 3 dominate
    rows = [row(output=[1], eos=(2, 3), min_tokens=4)] * n
    assert set(Sampler(CPU)(logits, rows).token_ids) == {0, 1}
    rows = [row(output=[1] * 4, eos=(2, 3), min_tokens=4)] * n
    assert 2 in set(Sampler(CPU)(logits, rows).token_ids)


def test_min_tokens_only_masks_its_row():
    logits = torch.tensor([[0.0, 5.0]] * 2)
    rows = [row(eos=(1,), min_tokens=2, temperature=0.0), row(eos=(1,), temperature=0.0)]
    got = Sampler(CPU).process_logits(logits, rows)
    assert got[0].tolist() == [0.0, -math.inf] and got[1].tolist() == [0.0, 5.0]
    assert Sampler(CPU)(logits, rows).token_ids == [0, 1]


# -- logprobs -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_raw_logits(dtype):
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(5, 120, generator=g) * 2).to(dtype)
    rows = [
        row(logprobs=None),
        row(logprobs=0, temperature=0.0),
        row(logprobs=3, temperature=0.5, repetition_penalty=1.5, prompt=[1, 2, 3]),
        row(logprobs=5, temperature=0.0, presence_penalty=2.0, output=list(range(0, 120, 2))),
        row(logprobs=20, top_k=4),
    ]
    out = Sampler(CPU, seed=2)(logits, rows)
    assert out.logprobs[0] is None
    ref_all = torch.log_softmax(logits.float(), dim=-1)
    for i in range(1, 5):
        n = rows[i].params.logprobs
        ref = ref_all[i].tolist()
        chosen = out.token_ids[i]
        top = sorted(range(120), key=lambda t: (-ref[t], t))[:n]
        entries = out.logprobs[i]
        assert entries[0][0] == chosen  # the sampled token first
        # then the top-n, best first (bf16 ties may come in any order)
        assert [v for _, v, _ in entries[1:]] == pytest.approx([ref[t] for t in top], abs=1e-5)
        assert len({t for t, _, _ in entries[1:]}) == n
        assert [r for _, _, r in entries[1:]] == list(range(1, n + 1))
        for t, v, rank in entries:
            assert v == pytest.approx(ref[t], abs=1e-5)
            assert type(t) is int and type(v) is float and type(rank) is int
        assert entries[0][2] == 1 + sum(ref[u] > ref[chosen] for u in range(120))
    # logprobs are the raw ones even though the penalty moved the choice in row 3
    assert out.token_ids[3] % 2 == 1
    assert out.logprobs[1] == [(out.token_ids[1], pytest.approx(max(ref_all[1].tolist()), abs=1e-5), 1)]


def test_logprobs_more_than_vocab():
    out = Sampler(CPU)(torch.tensor([RAW]), [row(logprobs=20, temperature=0.0)])
    ref = torch.log_softmax(torch.tensor(RAW), -1).tolist()
    assert out.token_ids == [3]
    assert out.logprobs[0] == [(3, pytest.approx(ref[3], abs=1e-6), 1)] + [
        (t, pytest.approx(ref[t], abs=1e-6), r) for r, t in enumerate((3, 0, 5, 2, 1, 4), start=1)]


def test_logprobs_do_not_change_tokens():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 80, generator=g)
    plain = [row(temperature=0.9, seed=i, generator=make_generator(i, CPU)) for i in range(6)]
    with_lp = [row(temperature=0.9, seed=i, generator=make_generator(i, CPU), logprobs=2)
               for i in range(6)]
    assert Sampler(CPU)(logits, plain).token_ids == Sampler(CPU)(logits, with_lp).token_ids


# -- device -------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_support_and_seeds():
    dev = torch.device("cuda")
    toks = Sampler(dev, seed=0)(torch.tensor([logits_of(PROBS)] * 4000, device=dev),
                                [row(top_p=0.8)] * 4000).token_ids
    assert set(toks) == {3, 1, 5}
    logits_row = torch.randn(300, generator=torch.Generator().manual_seed(1)).to(dev)
    def stream(batch):
        gen = make_generator(42, dev)
        out = []
        for step in range(8):
            logits = torch.randn(batch, 300, device=dev)
            logits[batch - 1] = logits_row
            rows = [row() for _ in range(batch - 1)] + [row(generator=gen, seed=42)]
            out.append(Sampler(dev, seed=step)(logits, rows).token_ids[-1])
        return out
    assert stream(1) == stream(5) == stream(33)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_penalties_masks_and_logprobs():
    dev = torch.device("cuda")
    logits = torch.tensor([RAW] * 3)
    rows = [row([0, 1], [3, 3, 4], temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                frequency_penalty=0.25, logprobs=2),
            row([], [0], eos=(3,), min_tokens=2, temperature=0.0, logprobs=0),
            row(output=[3], top_k=2, logprobs=1)]
    got = Sampler(dev).process_logits(logits.to(dev).half(), rows)
    assert got.device.type == "cuda"
    assert got[0].tolist() == pytest.approx([1.0, -2.0, 0.5, 0.5, -4.75, 1.0], abs=1e-6)
    assert got[1].tolist()[3] == -math.inf
    out = Sampler(dev)(logits.to(dev), rows)
    assert out.token_ids[:2] == [0, 0]
    assert out.token_ids[2] in (0, 3)
    ref = torch.log_softmax(torch.tensor(RAW), -1).tolist()
    ranked = sorted(range(len(ref)), key=lambda t: -ref[t])
    for i, entries in enumerate(out.logprobs):
        n = rows[i].params.logprobs
        # the sampled token first with its rank, then the n most likely tokens (raw logits)
        assert entries[0] == (out.token_ids[i], pytest.approx(ref[out.token_ids[i]], abs=1e-5), ranked.index(out.token_ids[i]) + 1)
        assert [t for t, _, _ in entries[1:]] == ranked[:n]
        for t, v, _ in entries:
            assert v == pytest.approx(ref[t], abs=1e-5)
