"""Shutting an LLM down releases its model and KV cache even while the LLM is still referenced
(after a ``with`` block the name stays bound), so a next engine in the process gets the memory."""

from __future__ import annotations

import gc
import weakref

import pytest

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("close") / "qwen2", "qwen2")


def test_a_closed_engine_holds_no_model_or_kv_cache(tiny):
    with LLM(str(tiny), dtype="float32", device="cpu", show_progress=False) as llm:
        out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        runner = llm.engine.executor
        model, kv = weakref.ref(runner.model), weakref.ref(runner.model.attention_layers()[0].k_cache)
        del runner
    gc.collect()
    assert len(out[0].outputs[0].token_ids) == 3
    assert model() is None and kv() is None, "the LLM (still bound) keeps the model or its KV cache alive"
    assert llm.get_tokenizer() is not None  # the tokenizer stays usable
    llm.shutdown()  # a second close is a no-op
    with LLM(str(tiny), dtype="float32", device="cpu", show_progress=False) as again:
        assert again.generate("hello", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids \
            == out[0].outputs[0].token_ids


@pytest.mark.cuda
def test_engines_one_after_another_each_get_their_budget(tiny):
    """On a GPU: each engine takes 30% of the device for its KV cache; the second starts after the
    first's with-block while the name ``llm`` still holds the first LLM."""
    import torch

    kw = dict(dtype="bfloat16", device="cuda", show_progress=False, gpu_memory_utilization=0.3, max_num_seqs=4)
    with LLM(str(tiny), **kw) as llm:
        first = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    free_after = torch.cuda.mem_get_info()[0]
    with LLM(str(tiny), **kw) as llm:
        second = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids
    assert free_after > 0.6 * torch.cuda.mem_get_info()[1]
