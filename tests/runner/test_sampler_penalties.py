"""Sampler: repetition, presence and frequency penalties and min_tokens, against
hand-computed logits and a per-row Python loop."""

import math
import random

import pytest
import torch

from ingot.runner.sampler import Sampler
from tests.runner.sampler_cases import CPU, RAW, chi_square, py_argmax, py_softmax, row


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
