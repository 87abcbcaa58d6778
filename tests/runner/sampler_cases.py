"""Shared by the sampler tests: rows of SamplingParams, per-row Python references (argmax,
softmax, chi-square) and the probability and logit rows the tests draw from."""

import math

import torch

from ingot.runner.sampler import SamplingRow
from ingot.sampling_params import SamplingParams

CPU = torch.device("cpu")


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


# Vocabulary order deliberately scrambled, so the sort/unsort is exercised.
PROBS = [0.05, 0.30, 0.02, 0.40, 0.08, 0.15]  # ranks: 3 > 1 > 5 > 4 > 0 > 2

# the logits the penalty and logprobs tests start from
RAW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
