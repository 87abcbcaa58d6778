"""The tool-call and reasoning parsers on text: whole replies, and the same replies streamed
a few characters at a time (the deltas must add up to the whole reply's message)."""

from __future__ import annotations

import json

import pytest

from ingot.serve.reasoning import ReasoningParser
from ingot.serve.tool_parsers import HermesParser, NamedParser, RequiredParser, get_parser, value_end
from ingot.serve.tools import ChoiceStream

WEATHER = {"city": "Paris", "unit": "celsius"}


def streamed(stream: ChoiceStream, text: str, step: int = 3) -> dict:
    """The message the deltas of ``text`` (sent ``step`` characters at a time) add up to."""
    content, reasoning, calls = "", "", {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for k, end in enumerate(cuts):
        delta = stream.delta(text[:end], final=k == len(cuts) - 1)
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a call's first delta: id, type, name
                assert call["index"] == len(calls) and call["type"] == "function"
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


def whole(stream: ChoiceStream, text: str) -> dict:
    m = stream.message(text)
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in m.get("tool_calls", [])]
    return {"content": m["content"], "reasoning": m.get("reasoning_content"), "calls": calls}


def same(stream_a: ChoiceStream, stream_b: ChoiceStream, text: str) -> dict:
    """The whole message, after checking that streaming ``text`` gives the same calls."""
    w = whole(stream_a, text)
    for step in (1, 4, 17):
        s = streamed(ChoiceStream(stream_b.reasoning, stream_b.tools, parallel=stream_b.parallel), text, step)
        assert [c["name"] for c in s["calls"]] == [c["name"] for c in w["calls"]]
        assert [json.loads(c["arguments"]) for c in s["calls"]] == [c["arguments"] for c in w["calls"]]
        assert (s["reasoning"] or None) == w["reasoning"] or (s["reasoning"] == "" and w["reasoning"] == "")
        if not w["calls"]:
            assert s["content"] == (w["content"] or "")
    return w


def tools(parser) -> tuple[ChoiceStream, ChoiceStream]:
    return ChoiceStream(tools=parser), ChoiceStream(tools=parser)


@pytest.mark.parametrize("text", [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    '<tool_call>{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',  # no closing tag
])
def test_hermes_finds_the_call(text):
    w = same(*tools(HermesParser()), text)
    assert w["calls"] == [{"name": "get_weather", "arguments": WEATHER}]
    assert w["content"] == (text.split("<tool_call>")[0].strip() or None)


def test_hermes_several_calls_and_plain_text():
    call = '<tool_call>\n{"name": "f", "arguments": {"x": "a \\" } <tool_call>"}}\n</tool_call>'
    w = same(*tools(HermesParser()), call + "\n" + call.replace('"f"', '"g"'))
    assert [c["name"] for c in w["calls"]] == ["f", "g"] and w["calls"][0]["arguments"] == {"x": 'a " } <tool_call>'}
    plain = "No tools needed: 2 < 3 and <tool is not a tag."
    assert same(*tools(HermesParser()), plain) == {"content": plain, "reasoning": None, "calls": []}
    broken = '<tool_call>{"name": "f", "arguments": {"x": </tool_call>'
    assert whole(ChoiceStream(tools=HermesParser()), broken) == {"content": broken, "reasoning": None, "calls": []}


def test_hermes_streams_the_name_first_and_holds_back_a_partial_tag():
    stream = ChoiceStream(tools=HermesParser())
    assert stream.delta("Sure <tool", False) == {"content": "Sure "}
    assert stream.delta('Sure <tool_call>{"name": "get_w', False) == {}
    first = stream.delta('Sure <tool_call>{"name": "get_weather", "arguments": {"ci', False)["tool_calls"]
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"ci'} and first[0]["id"].startswith("chatcmpl-tool-")
    rest = stream.delta('Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', True)
    assert rest == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}
    assert stream.called


def test_llama3_json():
    parser = get_parser("llama3_json")
    w = same(*tools(parser), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                             '{"name": "g", "parameters": {}}')
    assert w["calls"] == [{"name": "get_weather", "arguments": WEATHER}, {"name": "g", "arguments": {}}]
    assert w["content"] is None
    assert same(*tools(parser), "The answer is 4.")["content"] == "The answer is 4."
    assert same(*tools(parser), '{"answer": 4}')["content"] == '{"answer": 4}'  # JSON, but no call


@pytest.mark.parametrize("text", [
    'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
    'Sure.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "unit": "celsius"}',
])
def test_mistral(text):
    stream = ChoiceStream(tools=get_parser("mistral"), id_style="mistral")
    w = same(stream, ChoiceStream(tools=get_parser("mistral")), text)
    assert w["calls"] == [{"name": "get_weather", "arguments": WEATHER}] and w["content"] == "Sure."
    ids = [c["id"] for c in stream.message(text)["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)  # Mistral's templates insist on these


def test_required_and_named_output():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "g", "parameters": {}}]'
    w = same(*tools(RequiredParser()), text)
    assert w["calls"] == [{"name": "get_weather", "arguments": WEATHER}, {"name": "g", "arguments": {}}]
    one = ChoiceStream(tools=RequiredParser(), parallel=False)
    assert [c["function"]["name"] for c in one.message(text)["tool_calls"]] == ["get_weather"]
    w = same(*tools(NamedParser("get_weather")), json.dumps(WEATHER))
    assert w["calls"] == [{"name": "get_weather", "arguments": WEATHER}]
    stream = ChoiceStream(tools=NamedParser("get_weather"))
    assert stream.delta("", False)["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


def test_partial_json_values():
    text = '{"a": "}\\"", "b": [1, {"c": 2}]} tail'
    assert value_end(text, 0) == text.index(" tail")
    assert value_end('{"a": "}', 0) is None
    assert value_end('"x\\\\"y', 0) == 5
    assert value_end("12", 0) is None and value_end("12,", 0) == 2


@pytest.mark.parametrize("kind,prompt,text,reasoning,content", [
    ("qwen3", "<|im_start|>assistant\n", "<think>\nHmm.\n</think>\n\nHi!", "\nHmm.\n", "\n\nHi!"),
    ("qwen3", "<|im_start|>assistant\n", "Hi!", None, "Hi!"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.</think>Hi!", "Hmm.", "Hi!"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3", "<|im_start|>assistant\n", "<think>cut off", "cut off", ""),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Hmm.</think>Hi!", "Hmm.", "Hi!"),
    ("deepseek_r1", "<｜Assistant｜>", "<think>Hmm.</think>Hi!", "Hmm.", "Hi!"),
    ("deepseek_r1", "<｜Assistant｜>", "all thinking", "all thinking", ""),
])
def test_reasoning_split_whole_and_streamed(kind, prompt, text, reasoning, content):
    message = ChoiceStream(reasoning=ReasoningParser(kind, prompt)).message(text)
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == (content if content or reasoning is None else None)
    for step in (1, 2, 5):
        s = streamed(ChoiceStream(reasoning=ReasoningParser(kind, prompt)), text, step)
        assert (s["reasoning"], s["content"]) == (reasoning or "", content)


def test_reasoning_then_tool_call():
    text = '<think>I should look it up.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    make = lambda: ChoiceStream(ReasoningParser("qwen3", ""), HermesParser())  # noqa: E731
    w = same(make(), make(), text)
    assert w["reasoning"] == "I should look it up." and w["calls"] == [{"name": "get_weather", "arguments": WEATHER}]
    assert ChoiceStream(ReasoningParser("qwen3", ""), HermesParser(), include_reasoning=False).message(text).get(
        "reasoning_content") is None
