"""SamplingParams: validation, normalisation, greedy."""

import math

import pytest

from ingot.sampling_params import SamplingError, SamplingParams


def test_defaults():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.seed is None
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.logprobs is None
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.greedy


def test_sampling_error_is_value_error():
    assert issubclass(SamplingError, ValueError)


@pytest.mark.parametrize("stop, expected", [
    (None, []),
    ("###", ["###"]),
    (["a", "bc"], ["a", "bc"]),
    (("x", "y"), ["x", "y"]),
    ([], []),
])
def test_stop_normalised(stop, expected):
    p = SamplingParams(stop=stop)
    assert p.stop == expected
    assert isinstance(p.stop, list)


@pytest.mark.parametrize("ids, expected", [
    (None, []),
    ([2, 5], [2, 5]),
    ((7,), [7]),
    ([], []),
])
def test_stop_token_ids_normalised(ids, expected):
    p = SamplingParams(stop_token_ids=ids)
    assert p.stop_token_ids == expected
    assert isinstance(p.stop_token_ids, list)


@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True), (0, True), (5e-6, True), (1e-4, False), (0.7, False), (2.0, False),
])
def test_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=3), dict(top_p=1.0), dict(top_p=1e-3),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=50),
    dict(min_p=0.0), dict(min_p=1.0), dict(seed=0), dict(seed=-5), dict(seed=2**63),
    dict(repetition_penalty=1e-3), dict(repetition_penalty=5.0),
    dict(presence_penalty=-2.0), dict(presence_penalty=2), dict(frequency_penalty=-2),
    dict(frequency_penalty=2.0), dict(max_tokens=1), dict(max_tokens=None),
    dict(min_tokens=0), dict(min_tokens=16), dict(min_tokens=100, max_tokens=None),
    dict(logprobs=0), dict(logprobs=20), dict(ignore_eos=True),
    dict(skip_special_tokens=False), dict(include_stop_str_in_output=True),
])
def test_valid_boundaries_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


def test_numbers_are_coerced():
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float)


INVALID = [
    ("n", 0), ("n", 1.0), ("n", "1"), ("n", 129), ("best_of", 3), ("best_of", 0), ("prompt_logprobs", 21),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", None),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", "0.9"), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 1.5), ("top_k", "10"), ("top_k", None), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", "x"),
    ("seed", 1.5), ("seed", "42"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", "2"),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", None),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.01), ("frequency_penalty", [1]),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", "16"),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", None),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", [1.5]),
    ("stop_token_ids", "2"),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", "5"),
    ("skip_special_tokens", 0), ("include_stop_str_in_output", "no"),
    ("logit_bias", {"5": 1.0}), ("logit_bias", {1.5: 1.0}), ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: math.inf}), ("logit_bias", {5: "big"}), ("logit_bias", [5]),
    ("allowed_token_ids", []), ("allowed_token_ids", [1, "2"]), ("allowed_token_ids", 5),
    ("allowed_token_ids", [True]),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", ["ok", "  "]), ("bad_words", [5]),
]


@pytest.mark.parametrize("field, value", INVALID)
def test_invalid_raises_naming_field(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(SamplingError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


@pytest.mark.parametrize("field, value, range_text", [
    ("top_p", 0.0, "(0, 1]"),
    ("min_p", 2.0, "[0, 1]"),
    ("presence_penalty", 3.0, "[-2, 2]"),
    ("frequency_penalty", -3.0, "[-2, 2]"),
    ("logprobs", 21, "[0, 20]"),
    ("temperature", -1.0, ">= 0"),
    ("repetition_penalty", 0.0, "> 0"),
    ("max_tokens", 0, ">= 1"),
])
def test_message_names_range(field, value, range_text):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    assert range_text in str(info.value)


def test_token_rules_normalised():
    p = SamplingParams(logit_bias={5: 1, 7: -100}, allowed_token_ids=(3, 4), bad_words=("a", " b c"))
    assert p.logit_bias == {5: 1.0, 7: -100.0} and isinstance(p.logit_bias[5], float)
    assert p.allowed_token_ids == [3, 4] and p.bad_words == ["a", " b c"]
    assert p.bad_words_token_ids is None and p.has_token_rules  # tokenized when the request is processed
    assert not SamplingParams(bad_words=["a"]).has_token_rules and not SamplingParams().has_token_rules
    p = SamplingParams(bad_words=["a"])
    p.set_bad_words_token_ids([[12]])
    assert p.has_token_rules and p == SamplingParams(bad_words=["a"])  # the ids are derived: not compared
