"""Sampler on CUDA (marked cuda): truncation support, seeded rows in any batch, penalties,
masks and logprobs, against the same references as on CPU."""

import math

import pytest
import torch

from ingot.runner.sampler import Sampler, make_generator
from tests.runner.sampler_cases import PROBS, RAW, logits_of, row


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
