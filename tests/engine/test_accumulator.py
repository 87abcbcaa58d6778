"""Adding up the engine's compact outputs, one at a time and several at once (a lagging reader)."""

from __future__ import annotations

import asyncio

from ingot.engine.async_llm import RequestGroup
from ingot.engine.outputs import Accumulator
from ingot.outputs import CompletionOutput, Logprob, RequestOutput


def delta(rid: str, text: str, ids: list[int], *, index: int = 0, finished: bool = False, head: bool = False,
          logprobs: bool = False, reason=None) -> RequestOutput:
    lps = [{t: Logprob(-float(t), 1, str(t))} for t in ids] if logprobs else None
    c = CompletionOutput(index, text, list(ids), None, lps, reason, None, text, list(ids))
    return RequestOutput(rid, "p" if head else None, [1, 2] if head else [], [c], finished)


def test_one_at_a_time_keeps_each_step_delta():
    acc = Accumulator()
    a = acc.add(delta("a", "Hel", [5, 6], head=True))
    b = acc.add(delta("a", "lo", [7]))
    assert (a.outputs[0].text, a.outputs[0].delta) == ("Hel", "Hel")
    assert (b.outputs[0].text, b.outputs[0].delta, b.outputs[0].token_ids, b.outputs[0].delta_token_ids) == \
        ("Hello", "lo", [5, 6, 7], [7])
    assert b.prompt == "p" and b.prompt_token_ids == [1, 2]


def test_add_all_merges_what_piled_up_per_request():
    acc = Accumulator()
    acc.add(delta("a", "x", [1], head=True, logprobs=True))
    outs = acc.add_all([
        delta("a", "y", [2], logprobs=True),
        delta("b", "B", [9], head=True),
        delta("a", "z", [3], logprobs=True),
        delta("b", "!", [8], finished=True, reason="length"),
        delta("a", "w", [4], logprobs=True),
    ])
    assert [o.request_id for o in outs] == ["a", "b"]
    a, b = (o.outputs[0] for o in outs)
    assert (a.text, a.delta, a.token_ids, a.delta_token_ids) == ("xyzw", "yzw", [1, 2, 3, 4], [2, 3, 4])
    assert [list(p) for p in a.logprobs] == [[1], [2], [3], [4]]
    assert (b.text, b.delta, b.delta_token_ids, b.finish_reason) == ("B!", "B!", [9, 8], "length")
    assert outs[1].finished and not outs[0].finished
    # the next output of ``a`` starts where the merged one ended
    nxt = acc.add(delta("a", "v", [5]))
    assert (nxt.outputs[0].text, nxt.outputs[0].delta) == ("xyzwv", "v")


def test_add_all_keeps_samples_apart():
    acc = Accumulator()
    outs = acc.add_all([delta("r", "a", [1], index=0, head=True), delta("r", "b", [2], index=1),
                        delta("r", "c", [3], index=0), delta("r", "", [], index=1)])
    s0, s1 = outs[0].outputs
    assert (s0.index, s0.text, s0.delta, s0.delta_token_ids) == (0, "ac", "ac", [1, 3])
    assert (s1.index, s1.text, s1.delta, s1.delta_token_ids) == (1, "b", "b", [2])


class _NoBackend:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_lagging_group_reader_gets_one_output_per_request():
    async def main() -> list[tuple[str, str, bool]]:
        backend = _NoBackend()
        group = RequestGroup(backend, ["a", "b"])  # type: ignore[arg-type]
        for d in (delta("a", "1", [1], head=True), delta("b", "x", [7], head=True), delta("a", "2", [2]),
                  delta("a", "3", [3], finished=True)):
            group.queue.put_nowait(d)  # four steps' outputs before the reader runs
        seen = []
        async for out in group.outputs():
            seen.append((out.request_id, out.outputs[0].delta, out.finished))
            if len(seen) == 2:
                group.queue.put_nowait(delta("b", "y", [8], finished=True))
        assert backend.aborted == []  # nothing left unfinished to abort
        return seen

    assert asyncio.run(main()) == [("a", "123", True), ("b", "x", False), ("b", "y", True)]


def test_wire_merge_equals_adding_the_steps_one_by_one():
    from ingot.engine.wire import decode, encode, merge

    steps = [delta("r", "He", [5, 6], head=True, logprobs=True), delta("r", "l", [7], logprobs=True),
             delta("r", "", [], logprobs=True), delta("r", "lo", [8], finished=True, reason="stop", logprobs=True)]
    one_by_one = Accumulator()
    for d in steps:
        expected = one_by_one.add(d)
    merged = Accumulator().add(decode(merge([encode(d) for d in steps])))
    c, e = merged.outputs[0], expected.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, merged.finished) == ("Hello", [5, 6, 7, 8], "stop", True)
    assert (c.text, c.token_ids, c.logprobs, c.finish_reason) == (e.text, e.token_ids, e.logprobs, e.finish_reason)
    assert (merged.prompt, merged.prompt_token_ids) == ("p", [1, 2])
    assert c.delta == "Hello" and c.delta_token_ids == [5, 6, 7, 8]
    assert decode(merge([encode(steps[1])])) == decode(encode(steps[1]))
