"""The GPU soak's comparison (tests/serve/soak.py close_to), on hand-made answers."""

from __future__ import annotations

from tests.serve.soak import Answer, close_to

TOP = [{"a": -0.1, "b": -0.2}, {"c": -0.3, "d": -0.31}, {"e": -0.5, "f": -1.0}]


def test_equal_answers_pass():
    assert close_to(Answer("ace", ["a", "c", "e"], TOP), ["a", "c", "e"], TOP) is None


def test_a_tie_may_flip_then_the_rest_is_not_compared():
    mine = Answer("adx", ["a", "d", "x"], [TOP[0], {"d": -0.30, "c": -0.31}, {"x": -0.2}])
    assert close_to(mine, ["a", "c", "e"], TOP) is None


def test_a_token_outside_the_other_top_fails():
    mine = Answer("azx", ["a", "z", "x"], [TOP[0], {"z": -0.1, "c": -0.3}, {"x": -0.2}])
    assert "token 1" in close_to(mine, ["a", "c", "e"], TOP)


def test_a_shorter_answer_fails():
    assert close_to(Answer("ac", ["a", "c"], TOP[:2]), ["a", "c", "e"], TOP) == "2 tokens against 3"
