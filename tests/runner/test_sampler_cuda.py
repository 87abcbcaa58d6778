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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_token_rules_match_cpu_without_waiting_for_the_gpu():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 2
    rows = [row(temperature=0.0, allowed_token_ids=[4, 9, 250], logit_bias={9: 1.5, 3: -2.0}),
            row(output=[7, 8], temperature=0.0, bad_words=["x"]),
            row(temperature=0.0),
            row(output=[1], temperature=0.0, repetition_penalty=1.5, logit_bias={1: 3.0}, min_tokens=3, eos=(2,)),
            row(temperature=0.9, top_k=20, allowed_token_ids=list(range(0, 300, 3)), logprobs=2)]
    rows[1].params.set_bad_words_token_ids([[8, 5], [7, 8, 6], [11]])
    expected = Sampler(torch.device("cpu")).process_logits(logits, rows)
    on_gpu = logits.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host-device synchronisation raises
    try:
        got = Sampler(dev).process_logits(on_gpu, rows)
        sample = Sampler(dev, seed=1).sample(on_gpu, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got.cpu(), expected)
    out = sample.to_host()
    assert out.token_ids[:4] == expected[:4].argmax(dim=-1).tolist() and out.token_ids[4] % 3 == 0
