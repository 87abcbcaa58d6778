"""`ingot bench serve`'s workload: lengths and rates parsed, requests drawn deterministically
in range, Poisson arrivals, shared prefixes, multi-turn conversations, and the context check."""

from __future__ import annotations

import math

import pytest

from ingot.bench.workload import Workload, WorkloadError, make_requests, parse_range, parse_rate


def test_parse_range_and_rate():
    assert parse_range("64-1024") == (64, 1024)
    assert parse_range("32") == (32, 32)
    for bad in ("0-4", "9-3", "a-b", "1-2-3", ""):
        with pytest.raises(ValueError):
            parse_range(bad)
    assert math.isinf(parse_rate("inf")) and parse_rate("2.5") == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_workload_deterministic_and_in_range():
    w = Workload(50, (3, 9), (2, 5), seed=7)
    a, b = make_requests(w, 384), make_requests(w, 384)
    assert a == b
    assert make_requests(Workload(50, (3, 9), (2, 5), seed=8), 384) != a
    assert all(3 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert all(10 <= t < 384 - 10 for r in a for t in r.prompt_token_ids)
    assert {len(r.prompt_token_ids) for r in a} == set(range(3, 10))  # uniform: every length shows up
    assert all(r.arrival_s == 0.0 for r in a)


def test_poisson_arrivals():
    inf = make_requests(Workload(2000, (1, 4), (1, 4), seed=1), 100)
    timed = make_requests(Workload(2000, (1, 4), (1, 4), request_rate=10.0, seed=1), 100)
    assert [(r.prompt_token_ids, r.output_len) for r in timed] == [(r.prompt_token_ids, r.output_len) for r in inf]
    arrivals = [r.arrival_s for r in timed]
    assert arrivals[0] == 0.0 and all(x < y for x, y in zip(arrivals, arrivals[1:]))
    assert arrivals[-1] / (len(arrivals) - 1) == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    assert make_requests(Workload(2000, (1, 4), (1, 4), request_rate=10.0, seed=1), 100) == timed


def test_workload_validation():
    with pytest.raises(WorkloadError):
        Workload(0, (1, 2), (1, 2))
    with pytest.raises(WorkloadError):
        Workload(1, (3, 2), (1, 2))
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), request_rate=0.0)
    with pytest.raises(WorkloadError):
        make_requests(Workload(1, (1, 2), (1, 2)), vocab_size=20)


def test_shared_prefix_workload():
    plain = make_requests(Workload(20, (3, 9), (2, 5), seed=4), 384)
    shared = make_requests(Workload(20, (3, 9), (2, 5), seed=4, shared_prefix_len=12), 384)
    prefix = shared[0].prompt_token_ids[:12]
    assert len(prefix) == 12 and all(10 <= t < 374 for t in prefix)
    for p, s in zip(plain, shared):
        assert s.prompt_token_ids == prefix + p.prompt_token_ids, "prefix, then the same suffix as without one"
        assert s.output_len == p.output_len and s.next_turns == ()
    assert make_requests(Workload(20, (3, 9), (2, 5), seed=5, shared_prefix_len=12), 384)[0].prompt_token_ids[:12] != prefix
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), shared_prefix_len=-1)


def test_multi_turn_workload():
    w = Workload(30, (3, 9), (2, 5), seed=1, shared_prefix_len=4, kind="multi-turn", turns=(2, 4))
    convs = make_requests(w, 384)
    assert len(convs) == 30 and make_requests(w, 384) == convs
    assert {1 + len(c.next_turns) for c in convs} == {2, 3, 4}
    prefix = convs[0].prompt_token_ids[:4]
    for c in convs:
        assert c.prompt_token_ids[:4] == prefix and 3 <= len(c.prompt_token_ids) - 4 <= 9
        assert all(3 <= len(t.user_token_ids) <= 9 and 2 <= t.output_len <= 5 for t in c.next_turns)
        assert c.max_len == len(c.prompt_token_ids) + c.output_len + sum(len(t.user_token_ids) + t.output_len for t in c.next_turns)
    c = convs[0]
    nxt = c.follow_up([100, 101], 2.5)
    assert nxt.prompt_token_ids == c.prompt_token_ids + [100, 101] + c.next_turns[0].user_token_ids
    assert nxt.output_len == c.next_turns[0].output_len and nxt.arrival_s == 2.5 and nxt.next_turns == c.next_turns[1:]
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), turns=(2, 3))  # turns need the multi-turn workload
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), kind="chat")


def test_check_fits_counts_every_turn():
    from ingot.bench.workload import Request, Turn, check_fits

    conv = Request([1] * 10, 5, 0.0, (Turn([2] * 10, 5),))
    check_fits([conv], 30)
    with pytest.raises(WorkloadError, match="30 tokens"):
        check_fits([conv], 29)
