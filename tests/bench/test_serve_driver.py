"""`ingot bench serve`'s driver on a fake engine and clock: requests added at their arrival
times, and each turn of a conversation sent after the previous one finished."""

from __future__ import annotations

import pytest

from ingot.bench.serve import run_workload
from ingot.engine.stats import EngineStats


class _FakeSeq:
    def __init__(self, rid, n):
        self.request_id, self.n = rid, n
        self.output_token_ids, self.token_times = [], []
        self.num_cached_tokens = 0
        self.metrics = None  # (it stands for its own RequestOutput too: no speculation counts)

    @property
    def finished(self):
        return len(self.output_token_ids) >= self.n


class _FakeEngine:
    """Every step takes 0.25 s of fake time and gives every live sequence one token."""

    max_model_len = 1000

    def __init__(self, clock):
        self.clock = clock
        self.requests = {}
        self.stats = EngineStats
        self.added_at = {}

    def add_request(self, prompt, params, request_id):
        seq = _FakeSeq(request_id, params.max_tokens)
        self.requests[request_id] = seq
        self.added_at[request_id] = self.clock.t
        return seq

    def has_unfinished(self):
        return any(not s.finished for s in self.requests.values())

    def step(self):
        self.clock.t += 0.25
        live = [s for s in self.requests.values() if not s.finished]
        for s in live:
            s.output_token_ids.append(0)
            s.token_times.append(self.clock.t)
        return live

    def abort(self, rid):
        pass


class _Clock:
    def __init__(self):
        self.t = 64.0  # fake times are binary fractions: exact sums
        self.slept = []

    def __call__(self):
        return self.t

    def sleep(self, dt):
        self.slept.append(dt)
        self.t += dt


def test_driver_adds_requests_at_their_arrival_times():
    from ingot.bench.workload import Request

    reqs = [Request([11], 3, 0.0), Request([12], 2, 0.125), Request([13], 2, 2.0)]
    clock = _Clock()
    eng = _FakeEngine(clock)
    m = run_workload(eng, reqs, clock=clock, sleep=clock.sleep)
    # r0 added at once; r1 (due at +0.125) waits for the step in flight (added at +0.25); r2 after an idle sleep
    assert eng.added_at == {"serve-0": 64.0, "serve-1": 64.25, "serve-2": 66.0}
    assert clock.slept == [1.25]  # r0 and r1 both end at +0.75: idle until +2.0
    assert m.output_tokens == 7 and m.duration_s == 2.5
    # TTFT counts from the scheduled arrival: r1 was due at +0.125, first token at +0.5
    assert [r["ttft_ms"] for r in m.requests] == pytest.approx([250, 375, 250])
    assert eng.requests == {}  # the driver cleans up after itself


def test_driver_sends_each_turn_after_the_previous_one_finished():
    from ingot.bench.workload import Request, Turn

    reqs = [Request([11], 2, 0.0, (Turn([12, 13], 1), Turn([14], 2))), Request([15], 3, 0.0)]
    clock = _Clock()
    eng = _FakeEngine(clock)
    prompts = {}
    add = eng.add_request

    def recording(prompt, params, request_id):
        prompts[request_id] = list(prompt)
        return add(prompt, params, request_id)

    eng.add_request = recording
    m = run_workload(eng, reqs, clock=clock, sleep=clock.sleep)
    # conversation 0: turn 0 ends at +0.5, turn 1 (one token) at +0.75, turn 2 at +1.25; request 1 ends at +0.75
    assert eng.added_at == {"serve-0": 64.0, "serve-1": 64.0, "serve-0.1": 64.5, "serve-0.2": 64.75}
    assert prompts["serve-0.1"] == [11, 0, 0, 12, 13] and prompts["serve-0.2"] == [11, 0, 0, 12, 13, 0, 14]
    assert m.num_requests == 4 and m.output_tokens == 8 and m.duration_s == 1.25
    assert [r["input_len"] for r in m.requests] == [1, 1, 5, 7]
    assert [r["ttft_ms"] for r in m.requests] == pytest.approx([250, 250, 250, 250]), "a turn's TTFT counts from when it was sent"
    assert eng.requests == {}
