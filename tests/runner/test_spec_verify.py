"""Verification of drafts: greedy keeps the argmax run; rejection sampling against a point-mass
draft keeps the target distribution (chi-square over many draws); seeded rows repeat."""

from __future__ import annotations

import pytest
import torch

from ingot.runner.sampler import Sampler, SamplingRow, TokenMask
from ingot.runner.spec_verify import verify_drafts
from ingot.sampling_params import SamplingParams

CHI2_99_9 = {5: 20.52, 6: 22.46}  # the chi-square distribution's 99.9% quantiles by degrees of freedom


def row(params: SamplingParams, gen=None) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=[1], output_token_ids=[], generator=gen)


def test_greedy_keeps_the_argmax_run_and_adds_the_correction():
    logits = torch.full((7, 5), -1.0)
    for pos, tok in enumerate([3, 1, 4, 0, 2, 2, 4]):
        logits[pos, tok] = 1.0
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0, logprobs=1))]
    # row 0 drafts [3, 1, 2] against argmaxes 3, 1, 4, 0: keeps 2, corrects to 4
    # row 1 drafts [2, 4] against argmaxes 2, 2, 4: keeps 1, corrects to 2
    out = verify_drafts(Sampler(torch.device("cpu")), logits, rows, [[3, 1, 2], [2, 4]]).to_host()
    assert out.tokens == [[3, 1, 4], [2, 2]] and out.num_accepted == [2, 1]
    assert out.logprobs[0] is None and [e[0][0] for e in out.logprobs[1]] == [2, 2]


def test_all_drafts_accepted_adds_the_bonus_token_and_a_mask_applies_to_draftless_rows():
    logits = torch.zeros(4, 6)
    logits[0, 5] = logits[1, 2] = logits[2, 0] = 3.0
    logits[3, 1] = 3.0  # row 1's one position (logits row 3): its grammar allows only token 4
    mask = TokenMask([3], torch.tensor([[1 << 4]], dtype=torch.int32))
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0))]
    out = verify_drafts(Sampler(torch.device("cpu")), logits, rows, [[5, 2], []], mask).to_host()
    assert out.tokens == [[5, 2, 0], [4]] and out.num_accepted == [2, 0]


def test_a_mask_on_draft_positions_rejects_what_it_refuses():
    """A grammar row with drafts: each logits row masked as the grammar allows there; the
    second draft (token 2, the argmax) is refused by its position's mask, so the row keeps one
    draft and emits the mask's best token instead."""
    logits = torch.zeros(3, 6)
    logits[0, 5] = logits[1, 2] = logits[2, 0] = 3.0
    logits[1, 3] = 1.0
    mask = TokenMask([0, 1, 2], torch.tensor([[1 << 5], [(1 << 3) | (1 << 4)], [-1]], dtype=torch.int32))
    out = verify_drafts(Sampler(torch.device("cpu")), logits, [row(SamplingParams(temperature=0.0))], [[5, 2]],
                        mask).to_host()
    assert out.tokens == [[5, 3]] and out.num_accepted == [1]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_distribution():
    """Rows with a one-token draft x: the first emitted token is distributed as p_0 (x kept with
    p_0(x), else the residual), and after an accepted x the bonus token as p_1."""
    torch.manual_seed(0)
    vocab, rows_n = 6, 30000
    base = torch.tensor([[0.5, 1.5, -0.3, 0.9, 0.0, 1.1], [1.0, -1.0, 0.4, 0.2, 2.0, 0.0]])
    params = SamplingParams(temperature=0.7, top_k=5)
    sampler = Sampler(torch.device("cpu"), seed=3)
    rows = [row(params) for _ in range(rows_n)]
    draft = 3  # not the most likely token: rejected often
    out = verify_drafts(sampler, base.repeat(rows_n, 1), rows, [[draft]] * rows_n).to_host()
    p = Sampler.probs(base, [row(params)] * 2, [0, 1])
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=vocab).double()
    assert chi_square(first, p[0].double()) < CHI2_99_9[5]  # top-k leaves 5 tokens: 4 degrees, bound at 5
    bonus = torch.bincount(torch.tensor([t[1] for t in out.tokens if len(t) == 2]), minlength=vocab).double()
    assert chi_square(bonus, p[1].double()) < CHI2_99_9[5]
    accepted = sum(out.num_accepted) / rows_n
    assert abs(accepted - float(p[0, draft])) < 4 * (float(p[0, draft]) * (1 - float(p[0, draft])) / rows_n) ** 0.5


def test_seeded_rows_repeat_whatever_the_batch():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)

    def seeded() -> torch.Generator:
        return torch.Generator().manual_seed(7)

    alone = verify_drafts(Sampler(torch.device("cpu")), logits.clone(), [row(params, seeded())], [[2, 5]]).to_host()
    other = row(SamplingParams(temperature=1.0))
    mixed = verify_drafts(Sampler(torch.device("cpu"), seed=9), torch.cat([logits[:1], logits]),
                          [other, row(params, seeded())], [[], [2, 5]]).to_host()
    assert mixed.tokens[1] == alone.tokens[0]


def _first_tokens_and_acceptance(params: SamplingParams, draft_probs_of_draws: bool, vocab: int = 6, n: int = 30000):
    """``n`` one-draft rows over one position's logits: drafts drawn from ``q`` (with
    ``draft_probs``) or all the token 3 (a point mass). The emitted first tokens' counts, the
    acceptance rate, the target's p and the draft's q."""
    torch.manual_seed(0)
    base = torch.tensor([[0.5, 1.5, -0.3, 0.9, 0.0, 1.1], [1.0, -1.0, 0.4, 0.2, 2.0, 0.0]])
    p = Sampler.probs(base, [row(params)] * 2, [0, 1])[0].double()
    p = p / p.sum()
    if draft_probs_of_draws:
        q = torch.tensor([0.05, 0.1, 0.3, 0.25, 0.2, 0.1])
        drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(4)).tolist()
        probs = torch.stack([q, torch.zeros(vocab)]).repeat(n, 1)  # each row: its draft's position, its last
    else:
        q = torch.zeros(vocab)
        q[3] = 1.0
        drafts, probs = [3] * n, None
    out = verify_drafts(Sampler(torch.device("cpu"), seed=3), base.repeat(n, 1), [row(params) for _ in range(n)],
                        [[d] for d in drafts], draft_probs=probs).to_host()
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=vocab).double()
    return first, sum(out.num_accepted) / n, p, q.double()


@pytest.mark.parametrize("draft_probs_of_draws", [True, False])
def test_drafts_drawn_from_a_draft_distribution_keep_the_target_distribution(draft_probs_of_draws):
    """Drafts x ~ q kept with probability min(1, p(x) / q(x)), else the residual max(p - q, 0):
    the first emitted token is distributed as p, and a draft is kept with probability
    sum(min(p, q)) (a point mass on x: p(x)). With min-p the target's p is renormalised."""
    params = SamplingParams(temperature=0.9, min_p=0.2)
    first, accepted, p, q = _first_tokens_and_acceptance(params, draft_probs_of_draws)
    assert chi_square(first, p) < CHI2_99_9[5]
    expected = float(torch.minimum(p, q).sum())
    assert abs(accepted - expected) < 4 * (expected * (1 - expected) / 30000) ** 0.5
