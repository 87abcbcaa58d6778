"""Sampler: logit_bias, allowed_token_ids and bad_words against hand-computed logits, alone,
together, beside a grammar's mask and min_tokens, in mixed batches and in draft verification;
logprobs stay those of the raw logits."""

import math

import pytest
import torch

from ingot.runner.sampler import NO_TOKEN, Sampler, SamplingRow, TokenMask
from ingot.runner.spec_verify import verify_drafts
from ingot.sampling_params import SamplingParams
from tests.runner.sampler_cases import CPU, RAW, py_argmax, row

NEG = -math.inf


def rule_row(output=(), bad=None, eos=(), **kw) -> SamplingRow:
    """A row whose bad words are already token ids (what InputProcessor makes of ``bad_words``)."""
    r = row([], output, eos=eos, **kw)
    r.params.set_bad_words_token_ids(bad)
    return r


@pytest.mark.parametrize("kw, output, expected", [
    # RAW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]: token 3 is the argmax
    (dict(logit_bias={1: 4.5}), [], [2.0, 3.5, 0.5, 3.0, -2.0, 1.0]),
    (dict(logit_bias={3: -1.5, 5: 0.25}), [], [2.0, -1.0, 0.5, 1.5, -2.0, 1.25]),
    (dict(logit_bias={3: -100.0}), [], [2.0, -1.0, 0.5, -97.0, -2.0, 1.0]),
    (dict(allowed_token_ids=[1, 4]), [], [NEG, -1.0, NEG, NEG, -2.0, NEG]),
    # allowed first, then the bias (a bias on a token outside the list leaves it out)
    (dict(allowed_token_ids=[1, 4], logit_bias={4: 5.0, 0: 9.0}), [], [NEG, -1.0, NEG, NEG, 3.0, NEG]),
    # the bias comes before the repetition penalty: (2 + 2) / 2 for token 0 (in the output)
    (dict(logit_bias={0: 2.0}, repetition_penalty=2.0), [0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]),
    (dict(logit_bias={0: 2.0}, presence_penalty=1.0), [0, 0], [3.0, -1.0, 0.5, 3.0, -2.0, 1.0]),
])
def test_bias_and_allowed_hand_computed(kw, output, expected):
    logits = torch.tensor([RAW])
    rows = [rule_row(output, temperature=0.0, **kw)]
    got = Sampler(CPU).process_logits(logits, rows)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert logits[0].tolist() == RAW  # the raw logits untouched
    assert Sampler(CPU)(logits, rows).token_ids == [py_argmax(expected)]


@pytest.mark.parametrize("output, bad, banned", [
    ([], [[3]], {3}),  # one token: banned from the first step
    ([1, 2], [[3], [4]], {3, 4}),
    ([5, 2], [[5, 2, 3]], {3}),  # the output ends with the word's first two tokens
    ([2, 5], [[5, 2, 3]], set()),  # in the other order: no
    ([2], [[5, 2, 3]], set()),  # shorter than the prefix
    ([5, 2, 0], [[5, 2, 3]], set()),  # the prefix, but not at the end
    ([0, 1], [[1, 0], [0, 1, 5], [2, 1, 4]], {0, 5}),
])
def test_bad_words_ban_after_their_prefix(output, bad, banned):
    got = Sampler(CPU).process_logits(torch.tensor([RAW]), [rule_row(output, bad, temperature=0.0)])
    assert got[0].tolist() == [NEG if t in banned else v for t, v in enumerate(RAW)]


def test_a_large_negative_bias_removes_a_token_from_sampling():
    logits = torch.tensor([RAW] * 3000)
    out = Sampler(CPU, seed=3)(logits, [rule_row(logit_bias={3: -100.0, 0: -100.0})] * 3000).token_ids
    assert set(out) == {1, 2, 4, 5}


def bitmask(allowed, vocab=len(RAW)) -> list:
    word = sum(1 << t for t in allowed if t < vocab)
    return [word - (1 << 32) if word >= 1 << 31 else word]  # one int32 word


@pytest.mark.parametrize("seeded", [False, True])
def test_allowed_restricts_sampling_and_intersects_a_grammar_mask_and_min_tokens(seeded):
    n = 600
    gens = [torch.Generator().manual_seed(i) if seeded else None for i in range(3)]
    kinds = [
        # grammar {0, 1, 2, 3} and allowed {1, 2, 3, 5}: {1, 2, 3}
        dict(allowed_token_ids=[1, 2, 3, 5]),
        # allowed {1, 2, 3, 5}, EOS 3 masked below min_tokens: {1, 2, 5}
        dict(allowed_token_ids=[1, 2, 3, 5], min_tokens=4, eos=(3,)),
        # all three (the engine folds min_tokens into a grammar row's mask): {1, 2}
        dict(allowed_token_ids=[1, 2, 3, 5], min_tokens=4, eos=(3,)),
    ]
    rows, masked, words = [], [], []
    for i in range(n):
        k = i % 3
        rows.append(rule_row(temperature=1.0, seed=k if seeded else None, **kinds[k]))
        rows[-1].generator = gens[k]
        if k != 1:
            masked.append(i)
            words.append(bitmask({0, 1, 2, 3} if k == 0 else {0, 1, 2}))
    logits = torch.tensor([[0.0] * len(RAW)] * n)  # uniform: any allowed token is likely
    out = Sampler(CPU, seed=1)(logits, rows, TokenMask(masked, torch.tensor(words, dtype=torch.int32))).token_ids
    assert set(out[0::3]) == {1, 2, 3} and set(out[1::3]) == {1, 2, 5} and set(out[2::3]) == {1, 2}
    # greedy takes the best token left of RAW: 3 (3.0); 5 (1.0) without 3; 2 (0.5) of {1, 2}
    greedy = [rule_row(temperature=0.0, **kinds[k]) for k in range(3)]
    mask = TokenMask([0, 2], torch.tensor([bitmask({0, 1, 2, 3}), bitmask({0, 1, 2})], dtype=torch.int32))
    assert Sampler(CPU)(torch.tensor([RAW] * 3), greedy, mask).token_ids == [3, 5, 2]


def test_rows_without_rules_are_unaffected_in_the_same_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 2
    plain = [row(temperature=0.0), row(temperature=0.8, seed=7, generator=torch.Generator().manual_seed(7))]
    ruled = [rule_row(temperature=0.0, allowed_token_ids=[4]), rule_row([9], [[9, 1], [2]], temperature=0.0),
             rule_row(temperature=0.7, logit_bias={3: 50.0}), rule_row(temperature=0.0, logit_bias={11: 30.0})]
    alone = Sampler(CPU, seed=2)(logits[:2].clone(), plain).token_ids
    mixed = Sampler(CPU, seed=2)(logits, plain + ruled).token_ids
    assert mixed[:2] == alone
    assert mixed[0] == int(logits[0].argmax())
    processed = Sampler(CPU).process_logits(logits, plain + ruled)
    assert torch.equal(processed[:2], logits[:2])
    assert mixed[2:] == [4, py_argmax([v if t not in (1, 2) else NEG for t, v in enumerate(logits[3].tolist())]), 3, 11]


def test_rows_without_rules_keep_the_greedy_fast_path(monkeypatch):
    def no_processing(*args):
        raise AssertionError("the fast path processes nothing")

    monkeypatch.setattr(Sampler, "_process", no_processing)
    params = SamplingParams(temperature=0.0, bad_words=["x"])  # not tokenized: no rule to apply
    assert not params.has_token_rules
    rows = [row(temperature=0.0), SamplingRow(params, [], [], None)]
    assert Sampler(CPU)(torch.tensor([RAW, RAW]), rows).token_ids == [3, 3]
    with pytest.raises(AssertionError):
        Sampler(CPU)(torch.tensor([RAW]), [rule_row(temperature=0.0, logit_bias={0: 1.0})])


def test_logprobs_are_those_of_the_raw_logits():
    raw = torch.log_softmax(torch.tensor(RAW), dim=-1).tolist()
    rows = [rule_row([2], [[2, 3]], temperature=0.0, logprobs=2, allowed_token_ids=[1, 3, 4], logit_bias={1: 0.5})]
    out = Sampler(CPU)(torch.tensor([RAW]), rows)
    # allowed {1, 3, 4}, 3 banned after 2, 1 biased to -0.5: token 1 over 4 (-2.0)
    assert out.token_ids == [1]
    (tok, lp, rank), *top = out.logprobs[0]
    assert (tok, rank) == (1, 5) and lp == pytest.approx(raw[1], abs=1e-6)
    assert [(t, r) for t, _, r in top] == [(3, 1), (0, 2)]
    assert [v for _, v, _ in top] == pytest.approx([raw[3], raw[0]], abs=1e-6)


def test_verification_sees_each_drafts_prefix():
    """A row with the bad word [1, 2, 3] drafts [1, 2, 3] where every position's argmax is its
    draft: positions 0 and 1 are kept, position 2 (after 1, 2) refuses 3 and emits its next best."""
    logits = torch.zeros(4, 6)
    for pos, tok in enumerate([1, 2, 3, 5]):
        logits[pos, tok] = 3.0
    logits[2, 4] = 2.0
    bad = [rule_row([0], [[1, 2, 3]], temperature=0.0)]
    out = verify_drafts(Sampler(CPU), logits.clone(), bad, [[1, 2, 3]]).to_host()
    assert out.tokens == [[1, 2, 4]] and out.num_accepted == [2]
    # the row without drafts before them, at every position: all three kept, then the bonus
    plain = verify_drafts(Sampler(CPU), logits.clone(), [rule_row([0], [[0, 2]], temperature=0.0)], [[1, 2, 3]])
    assert plain.to_host().tokens == [[1, 2, 3, 5]]
    assert bad[0].output_token_ids == [0]  # the row itself unchanged


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_row_whose_rules_leave_no_token_fails_alone(logprobs):
    """allowed {1, 4} with 1 and 4 bad words: that row fails (the host sees -1 and the error);
    the device keeps a token a queued step can read; the other rows sample as before."""
    rows = [rule_row([], [[1], [4]], temperature=0.0, allowed_token_ids=[1, 4], logprobs=logprobs),
            rule_row([], None, temperature=0.0, logit_bias={1: 9.0}), row([], [], temperature=0.0)]
    sample = Sampler(CPU).sample(torch.tensor([RAW] * 3), rows)
    assert 0 <= int(sample.tokens[0]) < len(RAW)
    out = sample.to_host()
    assert out.token_ids == [-1, 1, 3]
    assert out.errors[0] == NO_TOKEN and out.errors[1:] == [None, None]


def test_min_tokens_with_only_eos_allowed_fails_the_row():
    r = rule_row([], None, eos=(2,), temperature=1.0, seed=1, allowed_token_ids=[2], min_tokens=3)
    out = Sampler(CPU)(torch.tensor([RAW]), [r])
    assert out.token_ids == [-1] and out.errors == [NO_TOKEN]


def test_verification_fails_a_row_at_a_position_with_no_token():
    """Position 1 of the row follows draft 1, after which the bad words [1, 3] and [1, 1] ban both
    allowed tokens: its first draft is kept, then the row fails; the other row is verified as usual."""
    logits = torch.zeros(5, 6)
    logits[:, 3] = 3.0
    dead = rule_row([], [[1, 3], [1, 1]], temperature=0.0, allowed_token_ids=[1, 3])
    logits[0, 1] = 4.0
    out = verify_drafts(Sampler(CPU), logits, [dead, row([], [], temperature=0.0)], [[1, 3], [3]]).to_host()
    assert out.tokens == [[1, -1], [3, 3]] and out.num_accepted == [1, 1]
    assert out.errors == [NO_TOKEN, None]
