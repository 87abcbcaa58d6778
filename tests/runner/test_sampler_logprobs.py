"""Sampler: logprobs of the sampled token and the top-n, from the raw logits, against
torch.log_softmax."""

import pytest
import torch

from ingot.runner.sampler import Sampler, make_generator
from tests.runner.sampler_cases import CPU, RAW, row


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
