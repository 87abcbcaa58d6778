"""A draft model sits out the steps after which no sequence may speculate (above
disable_by_batch_size): no draft forward runs on them, each sequence's draft K/V trails its own
(``Sequence.draft_kv_len``) and is caught up when it speculates again. The target drafts for
itself, so every draft is kept by construction; the draft K/V no frontier vouches for is NaN
(a draft step reading it proposes garbage, which the target rejects), so a catch-up that
missed a token, or a frontier that claims one it lacks, shows as a rejected draft. Greedy
output is plain greedy decoding's, token for token."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.runner.batch import draft_kv_lag
from ingot.runner.kv_pool import DUMMY_BLOCK, blocks_for
from tests.engine.test_draft_model import all_kept, draft_spec, models  # noqa: F401 (a fixture)
from tests.engine.test_speculative import PROMPTS, run, same
from tests.helpers import write_tiny_checkpoint

THRESHOLD = 2


def spec_engine(models, draft: str = "target", **config) -> Engine:  # noqa: F811
    spec = draft_spec(models[draft], disable_by_batch_size=THRESHOLD)
    return Engine(EngineConfig(model=str(models["target"]), dtype="float32", device="cpu", show_progress=False,
                               speculative_config=spec, **config))


def plain_outputs(models, prompts, params) -> list[list[int]]:  # noqa: F811
    with LLM(str(models["target"]), dtype="float32", device="cpu", show_progress=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def poison_unwritten_draft_kv(engine: Engine) -> None:
    """NaN into the draft's K/V of every running sequence's positions past its frontier (up to
    its computed tokens), unless another running sequence's frontier covers the slot (a shared
    block) or the block manager marks the block as holding it."""
    draft, blocks = engine.executor.draft, engine.scheduler.blocks
    bs = blocks.block_size
    running = engine.scheduler.running

    def slot(seq, p: int) -> int:
        return seq.block_ids[p // bs] * bs + p % bs

    vouched = {slot(s, p) for s in running for p in range(s.draft_kv_len)}
    slots = [slot(s, p) for s in running for p in range(s.draft_kv_len, s.num_computed_tokens)
             if not blocks.draft_written[s.block_ids[p // bs]] and slot(s, p) not in vouched]
    for attn in draft.model.attention_layers():
        for cache in (attn.k_cache, attn.v_cache):
            cache.view(-1, *cache.shape[2:])[slots] = float("nan")


class Recorder:
    """Per launched step: running sequences, whether it verifies, the largest draft lag of its
    rows, and the draft forwards it ran."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.steps: list[tuple[int, bool, int, int]] = []
        self.calls = 0
        draft, runner = engine.executor.draft, engine.executor
        for name in ("fill_kv", "forward_logits"):
            real = getattr(draft, name)
            monkeypatch.setattr(draft, name, lambda inputs, real=real: self._count() or real(inputs))
        launch = runner.launch

        def recording(batch, *args):
            before = self.calls
            lag = max(draft_kv_lag(s) for s in batch.seqs)
            step = launch(batch, *args)
            self.steps.append((len(engine.scheduler.running), batch.draft_tokens is not None, lag, self.calls - before))
            return step

        monkeypatch.setattr(runner, "launch", recording)

    def _count(self) -> None:
        self.calls += 1


def drive(engine: Engine, waves: list[tuple[int, list[tuple[str, SamplingParams]]]]) -> list:
    """Add each wave's requests once the engine has run its number of steps; run to the end,
    poisoning the draft K/V no frontier vouches for after every step."""
    seqs, step = [], 0
    while waves or engine.has_unfinished():
        while waves and waves[0][0] <= step:
            seqs += [engine.add_request(p, params) for p, params in waves.pop(0)[1]]
        engine.step()
        assert all(s.draft_kv_len <= s.num_computed_tokens for s in engine.scheduler.running)
        poison_unwritten_draft_kv(engine)
        step += 1
    return seqs


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("draft", ["target", "other"])
def test_the_draft_sits_out_big_batches_and_catches_up(models, monkeypatch, draft):  # noqa: F811
    """Two long requests speculate; twice, short ones join (four, then three running: above
    disable_by_batch_size 2) and end. Steps above the threshold run no draft forward; after each
    wave the long ones speculate again, a dozen tokens behind, caught up first: with the target
    as its draft every draft kept. With another draft (most drafts rejected) no frontier ever
    passes the kept tokens."""
    waves = [(0, [(PROMPTS[0], greedy(120)), (PROMPTS[1], greedy(110))]),
             (3, [(PROMPTS[2], greedy(12)), (PROMPTS[3], greedy(14))]),
             (24, [(PROMPTS[4], greedy(16))])]
    prompts = [p for _, wave in waves for p, _ in wave]
    params = [q for _, wave in waves for _, q in wave]
    engine = spec_engine(models, draft, max_num_seqs=8)
    rec = Recorder(engine, monkeypatch)
    seqs = drive(engine, waves)
    assert [s.output_token_ids for s in seqs] == plain_outputs(models, prompts, params)
    above = [s for s in rec.steps if s[0] > THRESHOLD]
    assert len(above) >= 20 and not any(calls for *_, calls in above), "no draft forward above the threshold"
    assert sum(1 for _, verify, lag, _ in rec.steps if verify and lag > 8) >= 2, "speculation resumed after each wave"
    stats = engine.stats()
    if draft == "target":
        all_kept(stats)
    else:
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens / 2


def test_prefix_cache_hits_on_blocks_without_the_drafts_kv(models, monkeypatch):  # noqa: F811
    """A request ends while the draft sits out (its last blocks cached with the target's K/V
    alone); a request continuing its output hits those blocks: its draft frontier starts at the
    first block without the draft's K/V (NaN there), and when it speculates its catch-up writes
    them, after which a third request hitting them gets them all. Output is plain decoding's,
    every draft kept."""
    engine = spec_engine(models, max_num_seqs=8)
    blocks, bs = engine.scheduler.blocks, engine.config.block_size
    admitted: dict[int, tuple[int, int]] = {}
    admit = blocks.admit

    def recording(seq, hits, num_tokens):
        admit(seq, hits, num_tokens)
        admitted[seq.seq_id] = (len(hits) * bs, seq.draft_kv_len)

    monkeypatch.setattr(blocks, "admit", recording)
    first = engine.add_request(PROMPTS[0], greedy(40))
    for _ in range(3):
        engine.step()
    others = [engine.add_request(p, greedy(70)) for p in PROMPTS[1:3]]  # three run: the draft sits out
    while not first.finished:
        engine.step()
        poison_unwritten_draft_kv(engine)
    assert len(first.output_token_ids) == 40
    for seq in others:
        engine.abort(seq.request_id)
    follow = {"prompt_token_ids": first.prompt_token_ids + first.output_token_ids + [5, 6]}
    second = engine.add_request(follow, greedy(30))
    engine.step()
    cached, frontier = admitted[second.seq_id]
    assert cached >= bs * ((len(first.prompt_token_ids) + 40) // bs), "the continued prompt hit its blocks"
    assert 0 < frontier < cached - bs and frontier % bs == 0, "the frontier stops at a block without draft K/V"
    while engine.has_unfinished():
        engine.step()
        poison_unwritten_draft_kv(engine)
    third = engine.add_request(follow, greedy(30))
    engine.step()
    assert admitted[third.seq_id][1] == admitted[third.seq_id][0] >= cached, "the catch-up marked them"
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    all_kept(stats)
    expected = plain_outputs(models, [PROMPTS[0], follow, follow], [greedy(40), greedy(30), greedy(30)])
    assert [first.output_token_ids, second.output_token_ids, third.output_token_ids] == expected


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_with_the_batch_above_and_below_the_threshold(models, overlap):  # noqa: F811
    """Five sequences in a KV cache too small for them: preemptions and recomputation while
    the batch moves above and below disable_by_batch_size 2 (the sequences' frontiers reset
    with their blocks and restart from their prefix-cache hits)."""
    params = [greedy(m) for m in (48, 40, 30, 20, 10)]
    plain, _, _ = run(models["target"], None, PROMPTS, params, num_kv_blocks=14, overlap_scheduling=False)
    spec, _, stats = run(models["target"], draft_spec(models["target"], disable_by_batch_size=THRESHOLD), PROMPTS,
                         params, num_kv_blocks=14, overlap_scheduling=overlap)
    same(spec, plain)
    assert stats.num_preemptions > 0
    all_kept(stats)


def test_a_sliding_window_keeps_the_blocks_a_catch_up_reads(tmp_path, monkeypatch):
    """Every layer windowed (Mistral, 8 tokens, 4-token blocks: blocks before the window are
    handed back): a sequence whose draft sat out keeps the blocks its catch-up attends to (none
    of them is the dummy when it runs), so the draft, caught up in chunks of at most
    max_num_batched_tokens (6), proposes what it would have; every draft kept, output plain
    decoding's."""
    path = write_tiny_checkpoint(tmp_path / "mistral", "mistral", seed=4,
                                 overrides={"vocab_size": 300, "sliding_window": 8})
    common = dict(dtype="float32", device="cpu", show_progress=False, block_size=4, max_num_batched_tokens=6,
                  max_num_seqs=8)
    waves = [(0, [(PROMPTS[0], greedy(60)), (PROMPTS[1], greedy(50))]), (3, [(PROMPTS[2], greedy(14))])]
    prompts = [p for _, wave in waves for p, _ in wave]
    params = [q for _, wave in waves for _, q in wave]
    spec = draft_spec(path, disable_by_batch_size=THRESHOLD)
    engine = Engine(EngineConfig(model=str(path), speculative_config=spec, **common))
    assert engine.scheduler.blocks.window == 8
    chunks: list[int] = []
    fill = engine.executor.draft.fill_kv
    monkeypatch.setattr(engine.executor.draft, "fill_kv",
                        lambda inputs: inputs.attn.is_prefill and chunks.append(inputs.input_ids.numel()) or fill(inputs))
    catch_up, read = engine.executor._catch_up, []

    def checking(seqs, ends):
        for seq, end in zip(seqs, ends):
            if seq.draft_kv_len < end:
                read.extend(seq.block_ids[max(0, seq.draft_kv_len - 7) // 4: blocks_for(end, 4)])
        catch_up(seqs, ends)

    monkeypatch.setattr(engine.executor, "_catch_up", checking)
    seqs = drive(engine, waves)
    all_kept(engine.stats())
    assert max(chunks) == 6 and len(chunks) > 10
    assert read and DUMMY_BLOCK not in read, "a catch-up reads no block handed back"
    with LLM(str(path), **common) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [s.output_token_ids for s in seqs] == expected
