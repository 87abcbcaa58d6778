"""Speculative decoding's verify step as decode rows (one per token of each sequence), for every
attention variant: GQA with Llama-3 rotary, Qwen3's q/k norms, Gemma 2's sliding windows and
soft-caps, gpt-oss's sinks (and windows), DeepSeek's latent attention.

Against an independent computation: a full prefill of each sequence's tokens and drafts gives
logits at every position, and the rows must give the same, through the raw forward (the
fallback above the largest verify bucket) and the padded verify buckets (``CPU_BUCKETS``: the
graphs' path without graphs). Then whole engines: greedy decoding with speculation emits plain
greedy decoding's tokens, through the verify buckets."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.engine.sequence import Sequence
from ingot.runner.batch import ScheduledBatch
from ingot.runner.graph_runner import DecodeGraphRunner
from ingot.runner.kv_pool import blocks_for
from ingot.runner.step_inputs import StepInputs, build_step_inputs
from tests.helpers import ingot_logits, write_tiny_checkpoint
from tests.models.gpt_oss_cases import write_gpt_oss

FAMILIES = ["llama", "qwen3", "gemma2", "gpt_oss", "deepseek_v2"]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "gpt_oss":
        return write_gpt_oss(path, seed=1)
    return write_tiny_checkpoint(path, request.param)


def _sequence(tokens: list[int], computed: int, first_block: int, block_size: int) -> Sequence:
    seq = Sequence("r", None, list(tokens), SamplingParams(), None)
    seq.block_ids.extend(range(first_block, first_block + blocks_for(len(tokens) + 8, block_size)))
    seq.num_computed_tokens = computed
    return seq


def verify_rows_case(checkpoint, device: str, **engine_args) -> tuple[Engine, StepInputs, torch.Tensor]:
    """An fp32 engine over ``checkpoint`` whose pool holds three sequences' K/V up to their last
    token (21 tokens with 4 drafts, 13 without, 10 with 2), the inputs of their verify step
    (5 + 1 + 3 rows), and the logits a full prefill of each sequence gives at those rows'
    positions (windows of 8 tokens reach past the drafts' start)."""
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device=device, show_progress=False,
                                 num_kv_blocks=64, max_num_seqs=8, **engine_args))
    runner, bs = engine.executor, engine.config.block_size
    gen = torch.Generator().manual_seed(0)
    full = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (21, 13, 10)]
    num_drafts = [4, 0, 2]
    references = [ingot_logits(engine, ids, prefill_len=len(ids)) for ids in full]  # blocks 1..2
    last = [len(ids) - 1 - k for ids, k in zip(full, num_drafts)]  # each sequence's last token
    seqs = [_sequence(ids[: p + 1], 0, 10 + 8 * i, bs) for i, (ids, p) in enumerate(zip(full, last))]
    runner.raw_logits(build_step_inputs(ScheduledBatch(seqs, True, last), bs, runner.device))
    for seq, p in zip(seqs, last):
        seq.num_computed_tokens = p
    drafts = [ids[p + 1 :] for ids, p in zip(full, last)]
    verify = ScheduledBatch(seqs, False, [1 + k for k in num_drafts], draft_tokens=drafts)
    expected = torch.cat([ref[p:] for ref, p in zip(references, last)])
    return engine, build_step_inputs(verify, bs, runner.device), expected


def poison_rows(runner, inputs: StepInputs) -> None:
    """NaN into every layer's cache at the verify rows' slots: a row that reads another row's
    K/V before the step has written it gives NaN logits."""
    slots = inputs.attn.slot_mapping
    for attn in runner.model.attention_layers():
        for cache in (attn.k_cache, attn.v_cache):
            if cache is not None:
                cache.view(-1, *cache.shape[2:])[slots] = float("nan")


def test_verify_rows_equal_the_prefill_of_the_drafts(checkpoint):
    """Each verify row's logits equal the full prefill's at its position, through the raw forward
    and the padded bucket path (9 rows in the bucket of 12)."""
    engine, inputs, expected = verify_rows_case(checkpoint, "cpu")
    runner = engine.executor
    poison_rows(runner, inputs)
    raw = runner.raw_logits(inputs)
    torch.testing.assert_close(raw, expected, rtol=1e-4, atol=1e-4)
    graphs = DecodeGraphRunner(runner.model, runner.config, runner.device, 8, runner.policy, store_first=True,
                               buckets=[4, 12])
    graphs.capture_all()  # on CPU: no graphs, the padded buffers only
    poison_rows(runner, inputs)
    padded = graphs.run(inputs)
    assert padded.shape == raw.shape
    torch.testing.assert_close(padded, expected, rtol=1e-4, atol=1e-4)


def test_greedy_with_speculation_through_verify_buckets_equals_plain_greedy(checkpoint, cpu_buckets):
    """Whole engines on the padded bucket path: greedy speculation emits plain greedy decoding's
    tokens, every verify step through the verify buckets."""
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "hello world hello world hello",
               "def f(x): return x"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", show_progress=False, max_num_seqs=4)
    with LLM(str(checkpoint), **common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(checkpoint), speculative_config=SPEC, **common) as llm:
        graphs = llm.engine.executor.verify_graphs
        assert graphs is not None and graphs.buckets == [2, 3, 4, 6, 8, 12, 16, 20]  # 4 sequences x 5 rows
        rows: list[int] = []
        run = graphs.run
        graphs.run = lambda inputs: rows.append(inputs.num_seqs) or run(inputs)
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        drafted = llm.engine.stats().spec_decode_num_draft_tokens
    assert spec == plain
    assert rows and sum(rows) - len(rows) > 0 and drafted > 0, "verify steps with drafts ran through the buckets"
