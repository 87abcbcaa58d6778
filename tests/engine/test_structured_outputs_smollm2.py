"""Structured outputs on the real default model (SmolLM2-135M-Instruct, its 49,152-token
vocabulary): a JSON schema with a nested object, a bounded array, an enum, patterns,
required fields and bounded numbers, validated with jsonschema over greedy and seeded
random sampling, n > 1, with free and without free whitespace; any JSON object; a
choice; overlap scheduling on and off agree. Kept small: this model decodes at a few
steps per second on a CPU."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ingot import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "height": {"type": "number", "minimum": 1.2, "maximum": 2.2},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "minItems": 1, "maxItems": 2},
        "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    },
    "required": ["name", "age", "height", "role", "tags", "home"],
}
CITIES = ["Paris", "London", "Berlin"]


def chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False)


def requests(llm: LLM) -> tuple[list[str], list[SamplingParams]]:
    compact = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=compact),
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=CITIES)),
        SamplingParams(temperature=0.0, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
        SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=PERSON)),
        SamplingParams(temperature=0.8, seed=0, n=2, max_tokens=100, structured_outputs=compact),
        SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.1, seed=7, max_tokens=100, structured_outputs=compact),
    ]
    person = chat(llm, "Describe a person as JSON.")
    prompts = [person, chat(llm, "What is the capital of France?"),
               chat(llm, "Reply with a JSON object whose one key, answer, is the capital of France."), person, person, person]
    return prompts, params


@pytest.fixture(scope="module")
def path(smollm2_gguf) -> str:
    return str(smollm2_gguf)


def generate(path: str, overlap: bool, first: int | None = None):
    with LLM(path, dtype="float32", device="cpu", show_progress=False, max_model_len=512, max_num_seqs=8,
             overlap_scheduling=overlap) as llm:
        prompts, params = requests(llm)
        return llm.generate(prompts[:first], params[:first], use_tqdm=False)


def test_schemas_json_object_and_choice(path):
    outs = generate(path, overlap=True)
    person = [c for i in (0, 3, 4, 5) for c in outs[i].outputs]
    assert len(person) == 5
    for c in person:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert "\n" in outs[3].outputs[0].text and "\n" not in outs[0].outputs[0].text  # free whitespace, or none
    assert len({c.text for c in person}) == 5
    assert outs[1].outputs[0].text in CITIES
    assert isinstance(json.loads(outs[2].outputs[0].text), dict)
    serial = generate(path, overlap=False, first=3)
    assert [o.outputs[0].token_ids for o in serial] == [o.outputs[0].token_ids for o in outs[:3]]
