"""Speculative decoding with structured outputs: a grammar row proposes drafts like any other,
its verify step masks each position with the tokens the grammar allows after the drafts
before it (the matcher walked through them and rolled back), and the matcher then accepts
the tokens kept. Greedy output equals plain greedy decoding under the same grammar, token
for token, and drafts are kept; every output matches its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ingot import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers import write_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REGEX = r"(hello world ){2,5}(bye|done)"
SCHEMA = {"type": "array", "items": {"enum": ["the quick brown fox", "jumps over", "the lazy dog"]},
          "minItems": 4, "maxItems": 8}
PROMPTS = ["hello world hello world hello world hello", '["the quick brown fox", "jumps over", "the lazy dog", ']


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("specgrammar") / "qwen2", "qwen2")


def params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # an unconstrained row in the same steps
    ]


def run(path, spec, ahead=False):
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False, speculative_config=spec) as llm:
        llm.engine.grammars.ahead = ahead  # a step's grammar work in the ahead thread, as on CUDA
        outs = llm.generate([p for p in PROMPTS for _ in range(3)], params() * len(PROMPTS), use_tqdm=False)
        sched = llm.engine.scheduler
        assert sched.blocks.num_free == sched.blocks.num_blocks - 1, "every block came back"
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], outs


@pytest.mark.parametrize("ahead", [False, True], ids=["loop", "ahead"])
def test_grammar_rows_speculate_and_equal_plain_greedy(tiny, ahead):
    plain, _ = run(tiny, None)
    spec, outs = run(tiny, SPEC, ahead)
    assert spec == plain
    for k, (_, text, reason) in enumerate(spec):
        kind = k % 3
        if kind == 0:
            assert re.fullmatch(REGEX, text) and reason == "stop", text
        elif kind == 1:
            jsonschema.validate(json.loads(text), SCHEMA)
            assert reason == "stop"
    kept = [o.metrics.spec_num_accepted_tokens for k, o in enumerate(outs) if k % 3 != 2]
    assert sum(kept) > 10, f"grammar rows kept drafts: {kept}"


def test_a_draft_the_grammar_refuses_is_never_kept(tiny):
    """Drafts from the prompt that break the grammar ("hello" where only "bye" / "done" may come
    next, after five repeats) are rejected at their position by the mask, not kept."""
    regex = r"(hello world ){1}done"
    p = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex))
    with LLM(str(tiny), dtype="float32", device="cpu", show_progress=False, speculative_config=SPEC) as llm:
        out = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0]
    assert out.outputs[0].text == "hello world done"
    assert out.metrics.spec_num_draft_tokens > out.metrics.spec_num_accepted_tokens
