"""Property tests of the block manager and scheduler together (hypothesis).

A program is a random sequence of arrivals (prompts built from a few shared
prefixes, some salted, some as n > 1 groups whose children wait for the first),
engine steps, aborts and preemptions (between steps, and after a step was
scheduled but before it ran) and prefix-cache resets (as they come: refused
while a block is held; or after running everything to completion), run on tiny
KV pools so that admission waits, eviction and preemption happen. After every step: reference counts equal the
number of holders, no block is both free and held, only computed blocks are
findable by hash. At the end: nothing leaks, every request not aborted has
finished, with the tokens it gets when run alone.

Two models: the fake model of fake_steps.py (reads the whole context back
through the block table every time it samples; many examples), and a tiny
random Llama checkpoint through the real Engine (greedy fp32; fewer examples).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ingot.engine.block_manager import BlockManager
from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Sequence, Status
from ingot.sampling_params import SamplingParams
from tests.engine.fake_steps import FakeKV, alone, check_all_free, check_invariants, finish_step, make_seq

BS = 4
BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
PREFIXES = [[], BASE[:3], BASE[:8], BASE[:13], BASE[:20]]  # 0, part of one, 2, 3 and 5 full blocks
MAX_SUFFIX, MAX_OUT = 6, 6
LONGEST = 20 + MAX_SUFFIX + MAX_OUT  # tokens of the longest request: 8 blocks

arrival = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.lists(st.integers(3, 40), max_size=MAX_SUFFIX),
    st.integers(1, MAX_OUT),  # max_tokens
    st.sampled_from([None, None, None, "tenant-b"]),  # cache_salt
    st.sampled_from([1, 1, 1, 2, 3]),  # n: same-prompt group size
)
arrive = st.tuples(st.just("arrive"), arrival)
operation = st.one_of(
    arrive,
    arrive,  # twice: as likely as a step
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.sampled_from(["abort", "preempt", "abort_scheduled", "preempt_scheduled"]), st.integers(0, 99)),
    st.tuples(st.just("reset"), st.booleans()),  # True: run every request to completion first
)
programs = st.lists(arrive, min_size=1, max_size=3).flatmap(
    lambda first: st.lists(operation, min_size=3, max_size=40).map(lambda rest: first + rest))


def count_evictions(bm: BlockManager) -> list[int]:
    """Count the blocks taken from the evictable pool (the instance's allocator, wrapped)."""
    count = [0]
    allocate = bm._allocate

    def counting() -> int:
        count[0] += not bm.free_blocks
        return allocate()

    bm._allocate = counting  # type: ignore[method-assign]
    return count


def record_events(sched: Scheduler, seqs: list[Sequence], num_aborted: int, evictions: int, children: list[Sequence]) -> None:
    """What an example exercised (``pytest --hypothesis-show-statistics``)."""
    event(f"requests: {min(len(seqs) // 5 * 5, 15)}+")
    event("prefix cache hit" if sched.stats.prefix_cache_hits else "no prefix cache hit")
    event("preempted" if sched.stats.num_preemptions else "no preemption")
    event("aborted" if num_aborted else "no abort")
    event("cached block evicted" if evictions else "no eviction")
    event("an n > 1 child reused its group's prompt" if any(c.num_cached_tokens for c in children) else "no child hit")


def check_reset(blocks: BlockManager, reset: bool, idle: bool) -> None:
    """A reset happens exactly when it may (``idle``), and then leaves no hash behind."""
    event("reset emptied the cache" if reset else "reset refused")
    assert reset == idle
    if reset:
        assert not blocks.cached and not blocks.evictable and not any(blocks.hash_of)
        assert blocks.num_free == blocks.num_blocks - 1


def prompt_of(a) -> list[int]:
    prefix_index, suffix, *_ = a
    return PREFIXES[prefix_index] + suffix or [5]


# ---------------------------------------------------------------- scheduler + block manager, fake model
class FakeEngine:
    """The step loop of the engine over FakeKV, with the program's operations."""

    def __init__(self, num_blocks: int, budget: int, max_num_seqs: int, caching: bool, wave: int = 0) -> None:
        self.sched = Scheduler(BlockManager(num_blocks, BS, caching), max_num_seqs, budget, wave)
        self.sched.WAVE_WAIT_PER_RUNNING = 1  # waves hold prompts even at these few running sequences
        self.kv = FakeKV(num_blocks, BS)
        self.evictions = count_evictions(self.sched.blocks)
        self.seqs: list[Sequence] = []
        self.aborted: set[int] = set()
        self.ids = itertools.count()
        self.children: list[Sequence] = []

    def arrive(self, a) -> None:
        _, _, max_tokens, salt, n = a
        first = None
        for _ in range(n):
            seq = make_seq(prompt_of(a), max_tokens, f"r{next(self.ids)}", salt=salt, wait_for=first)
            if first is not None:
                self.children.append(seq)
            first = first or seq
            self.sched.add(seq)
            self.seqs.append(seq)

    def step(self, victim: int | None = None, how: str = "") -> None:
        batch = self.sched.schedule()
        if batch is None:
            return
        skip = frozenset()
        if victim is not None:  # gone after scheduling, before the runner computed it
            seq = batch.seqs[victim % len(batch.seqs)]
            self.end(seq) if how == "abort" else self.sched.preempt(seq)
            skip = frozenset({id(seq)})
        finish_step(self.sched, batch, self.kv.run(batch, skip))
        check_invariants(self.sched, self.kv)

    def end(self, seq: Sequence) -> None:
        self.sched.finish(seq)
        self.aborted.add(id(seq))

    def apply(self, op) -> None:
        kind, arg = op
        live = [s for s in self.seqs if not s.finished]
        if kind == "arrive":
            self.arrive(arg)
        elif kind == "step":
            for _ in range(arg):
                self.step()
        elif kind == "abort" and live:
            self.end(live[arg % len(live)])
        elif kind == "preempt" and self.sched.running:
            self.sched.preempt(self.sched.running[arg % len(self.sched.running)])
        elif kind in ("abort_scheduled", "preempt_scheduled"):
            self.step(arg, kind.split("_")[0])
        elif kind == "reset":
            if arg:
                self.drain()
            bm = self.sched.blocks
            held = any(bm.ref_counts)
            check_reset(bm, bm.reset_cache(), not held)
        check_invariants(self.sched, self.kv)

    def drain(self, limit: int = 3000) -> None:
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.step()
        pytest.fail("requests did not finish")


@settings(max_examples=1000)
@given(
    program=programs,
    num_blocks=st.integers(LONGEST // BS + 1, 30),
    budget=st.sampled_from([3, 4, 7, 16, 64]),
    max_num_seqs=st.integers(1, 6),
    caching=st.sampled_from([True, True, True, False]),
    wave=st.sampled_from([0, 0, 0, 30]),  # prefill_wave_tokens
)
def test_random_programs_on_the_fake_model(program, num_blocks, budget, max_num_seqs, caching, wave):
    eng = FakeEngine(num_blocks, budget, max_num_seqs, caching, wave)
    for op in program:
        eng.apply(op)
    eng.drain()
    check_all_free(eng.sched)
    stats = eng.sched.stats
    assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
    record_events(eng.sched, eng.seqs, len(eng.aborted), eng.evictions[0], eng.children)
    for seq in eng.seqs:
        if id(seq) in eng.aborted:
            continue
        assert seq.status is Status.FINISHED
        assert seq.output_token_ids == alone(seq.prompt_token_ids, seq.params.max_tokens)
        assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < len(seq.prompt_token_ids)


# ---------------------------------------------------------------- the real engine on a tiny random checkpoint
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Engines over one tiny checkpoint: tiny pools with prefix caching, and a reference
    without it that runs each prompt alone."""
    from ingot import LLM
    from tests.helpers import write_tiny_checkpoint

    path = str(write_tiny_checkpoint(tmp_path_factory.mktemp("prop") / "llama", "llama"))
    common = dict(dtype="float32", device="cpu", show_progress=False, block_size=BS, max_model_len=LONGEST + 4)
    pools = {blocks: LLM(path, num_kv_blocks=blocks, max_num_seqs=4, max_num_batched_tokens=budget, **common).engine
             for blocks, budget in ((LONGEST // BS + 2, 7), (16, 16), (40, 64))}
    reference = LLM(path, enable_prefix_caching=False, **common).engine
    return pools, reference


class Reference:
    """Greedy tokens of a prompt run alone (memoized: the prompts repeat across examples)."""

    def __init__(self, engine) -> None:
        self.engine, self.memo, self.ids = engine, {}, itertools.count()

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self.memo:
            seq = self.engine.add_request(prompt, greedy(max_tokens), f"ref{next(self.ids)}", stream=False)
            while not seq.finished:
                self.engine.step()
            self.engine.requests.pop(seq.request_id, None)
            self.memo[key] = list(seq.output_token_ids)
        return self.memo[key]


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


_reference: dict[int, Reference] = {}
_ids = itertools.count()


@settings(max_examples=60)
@given(program=programs, pool=st.sampled_from([LONGEST // BS + 2, 16, 40]))
def test_random_programs_on_a_real_model_match_each_prompt_alone(engines, program, pool):
    pools, reference_engine = engines
    reference = _reference.setdefault(id(reference_engine), Reference(reference_engine))
    engine = pools[pool]
    sched = engine.scheduler
    evictions = count_evictions(sched.blocks)
    seqs: list[Sequence] = []
    children: list[Sequence] = []
    aborted: set[str] = set()
    for kind, arg in program:
        live = [s for s in seqs if not s.finished]
        if kind == "arrive":
            _, _, max_tokens, salt, n = arg
            if n > 1 and salt is None:  # the engine's own n > 1: one request, n samples
                rid = f"p{next(_ids)}"
                engine.add_request(prompt_of(arg), greedy(max_tokens, n), rid, stream=False)
                group = engine.requests[rid].seqs
                seqs += group
                children += group[1:]
                continue
            first = None  # n requests of one prompt, the later ones waiting for the first (wait_for)
            for _ in range(n):
                seq = engine.add_request(prompt_of(arg), greedy(max_tokens), f"p{next(_ids)}", stream=False)
                seq.cache_salt, seq.wait_for = salt, first  # set before the scheduler first looks at it
                if first is not None:
                    children.append(seq)
                first = first or seq
                seqs.append(seq)
        elif kind == "step":
            for _ in range(arg):
                engine.step()
                check_invariants(sched)
        elif kind in ("abort", "abort_scheduled") and live:
            engine.abort(live[arg % len(live)].request_id)
            aborted.add(live[arg % len(live)].request_id)
        elif kind in ("preempt", "preempt_scheduled") and sched.running:
            sched.preempt(sched.running[arg % len(sched.running)])
        elif kind == "reset":
            while arg and engine.has_unfinished():
                engine.step()
            idle = not engine.requests  # a step left in flight for ended requests is read back first
            check_reset(sched.blocks, engine.reset_prefix_cache(), idle)
        check_invariants(sched)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        check_invariants(sched)
    check_all_free(sched)
    record_events(sched, seqs, len(aborted), evictions[0], children)
    del sched.blocks._allocate  # the engine is reused by the next example
    for seq in seqs:
        engine.requests.pop(seq.request_id, None)
        if seq.request_id not in aborted:
            assert seq.finished and seq.finish_reason == "length"
            assert seq.output_token_ids == reference(seq.prompt_token_ids, seq.params.max_tokens), seq.request_id
