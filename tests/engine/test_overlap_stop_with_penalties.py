"""Overlap scheduling with a request whose sampling reads the output so far (penalties): the
step in flight is read back before the next one is scheduled, so a sequence it stops is not
scheduled again (its blocks are already freed)."""

from __future__ import annotations

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint


def test_a_stop_read_back_for_penalties_does_not_break_the_next_step(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "llama", "llama"))
    prompts = ["hello world", "The quick brown fox"]
    with LLM(path, dtype="float32", device="cpu", show_progress=False) as llm:
        ids = llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
        stop = ids[5]  # the second request stops on its sixth token, while the first still decodes
        outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2, ignore_eos=True),
                                      SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])])
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 20
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].token_ids == ids[: ids.index(stop) + 1]
