"""Sampler: greedy, truncation (top-k, top-p, min-p), the sampled distribution and seeds,
checked against hand-computed values and per-row Python references. Penalties and min_tokens:
test_sampler_penalties.py; logprobs: test_sampler_logprobs.py; on CUDA: test_sampler_cuda.py."""

import math

import pytest
import torch

from ingot.runner.sampler import Sampler, SamplerOutput, make_generator
from tests.runner.sampler_cases import CPU, PROBS, chi_square, logits_of, py_argmax, py_softmax, row

DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


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


N_DRAWS = 4000


def draw_many(probs, n=N_DRAWS, seed=0, **kw):
    """Tokens sampled for ``n`` identical rows of logits log(probs)."""
    logits = torch.tensor([logits_of(probs)] * n)
    out = Sampler(CPU, seed=seed)(logits, [row(**kw)] * n)  # one row object, n rows
    return out.token_ids


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
