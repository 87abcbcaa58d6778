"""`ingot serve --tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser qwen3` on a
scripted model (tests/serve/scripted_model.py: its greedy replies are known), driven by the
official `openai` client: reasoning split out of the answer, tool calls parsed from the reply,
streamed and not, a tool's result answered, and the constraints of structured outputs and of
required / named tool choice applied to the answer after the reasoning."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.serve.scripted_model import reply, write_scripted_checkpoint
from tests.serve.server_process import running_server


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return write_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def server(scripted):
    with running_server("--model", str(scripted), "--dtype", "float32", "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", "--reasoning-parser", "qwen3", "--quiet") as srv:
        yield srv
    assert srv.proc.returncode == 0, "".join(srv.log[-20:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=60)


def ask(client, content: str, stream: bool = False, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=client.models.list().data[0].id, stream=stream, temperature=0,
                                          messages=[{"role": "user", "content": content}], **kw)


def collect(chunks) -> dict:
    """A streamed reply put back together: content, reasoning, tool calls, finish reason."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "chunks": 0}
    for chunk in chunks:
        out["chunks"] += 1
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id:
                assert call.index not in out["calls"] and call.type == "function" and call.function.name
                out["calls"][call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            out["calls"][call.index]["arguments"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_reasoning_is_split_from_the_answer(client):
    message = ask(client, "What is 2 + 2? [think]").choices[0].message
    assert message.reasoning_content == "Let me think." and message.content == "The answer is 4."
    streamed = collect(ask(client, "What is 2 + 2? [think]", stream=True))
    assert (streamed["reasoning"], streamed["content"]) == ("Let me think.", "The answer is 4.")
    hidden = ask(client, "What is 2 + 2? [think]", extra_body={"include_reasoning": False}).choices[0].message
    assert getattr(hidden, "reasoning_content", None) is None and hidden.content == "The answer is 4."


def test_chat_template_kwargs_reach_the_template(client, server):
    """enable_thinking=false ends the reasoning in the prompt (the scripted template writes
    <think></think>): the reply is all answer, and a constraint is allowed on it."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = ask(client, "Hi", extra_body=off).choices[0].message
    assert message.content == reply("</think>") and getattr(message, "reasoning_content", None) is None
    tokens = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], **off}).json()
    assert httpx.post(server.url + "/detokenize", json=tokens).json()["prompt"].endswith("<think></think>")
    choice = ask(client, "Hi", extra_body={**off, "guided_choice": ["yes", "no"]}).choices[0].message.content
    assert choice in ("yes", "no")


CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_applies_to_the_answer_after_the_reasoning(client, stream):
    """The model reasons first ("[think]": <think> is its first token), freely: its reasoning
    is text no constraint allows; the answer after </think> follows the constraint."""
    asks = [({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}},
             lambda text: jsonschema.validate(json.loads(text), CITY)),
            ({"extra_body": {"guided_choice": ["yes", "no"]}}, lambda text: text in ("yes", "no") or pytest.fail(text))]
    for kw, validate in asks:
        response = ask(client, "Hi [think]", stream=stream, max_tokens=40, **kw)
        if stream:
            got = collect(response)
            reasoning, content, finish = got["reasoning"], got["content"], got["finish"]
        else:
            message = response.choices[0].message
            reasoning, content, finish = message.reasoning_content, message.content, response.choices[0].finish_reason
        assert reasoning == "Let me think." and finish == "stop"
        validate(content)


def test_completions_constrain_after_the_reasoning_and_return_the_whole_text(client):
    """/v1/completions with a reasoning parser: the same engine rule, the text unsplit."""
    name = client.models.list().data[0].id
    out = client.completions.create(model=name, prompt="Hi [think]", max_tokens=40, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("<think>Let me think.</think>yes", "<think>Let me think.</think>no")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_call_is_parsed(client, stream):
    response = ask(client, "Weather in Paris? [tool]", stream=stream, tools=TOOLS)
    if stream:
        got = collect(response)
        (call,) = got["calls"].values()
        assert got["content"] == "" and got["finish"] == "tool_calls"
        name, arguments, call_id = call["name"], call["arguments"], call["id"]
    else:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function"
        name, arguments, call_id = call.function.name, call.function.arguments, call.id
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert call_id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_a_call_is_text_and_none_never_parses(client, stream):
    got = ask(client, "Weather? [plain]", stream=stream, tools=TOOLS)
    text = collect(got)["content"] if stream else got.choices[0].message.content
    assert text == reply("[plain]")
    none = ask(client, "Weather in Paris? [tool]", stream=stream, tools=TOOLS, tool_choice="none")
    if stream:
        got = collect(none)
        assert got["content"] == reply("[tool]") and not got["calls"] and got["finish"] == "stop"
    else:
        assert none.choices[0].message.content == reply("[tool]") and not none.choices[0].message.tool_calls


def test_a_tool_result_is_answered(client, server):
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny [plain]"}]
    name = client.models.list().data[0].id
    answer = client.chat.completions.create(model=name, messages=messages, tools=TOOLS, temperature=0, max_tokens=16)
    assert answer.choices[0].message.content == reply("[plain]") and answer.choices[0].finish_reason == "stop"
    prompt = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    text = httpx.post(server.url + "/detokenize", json=prompt).json()["prompt"]
    # the template's tool section and its rendering of the call (arguments handed over as a mapping)
    assert "Tools: get_weather get_time" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert text.endswith("tool\nsunny [plain]")


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choice_always_give_valid_calls(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in [(named, ["get_time"]), ("required", None)]:
        # the model reasons first, freely; the calls' constraint applies after </think>
        response = ask(client, "What time is it? [think]", stream=stream, tools=TOOLS, tool_choice=choice,
                       parallel_tool_calls=False, max_tokens=80)
        if stream:
            got = collect(response)
            calls = [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()]
            assert got["finish"] == "tool_calls" and got["content"] == "" and got["reasoning"] == "Let me think."
        else:
            message = response.choices[0].message
            assert response.choices[0].finish_reason == "tool_calls" and message.content is None
            assert message.reasoning_content == "Let me think."
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        assert len(calls) == 1
        name, arguments = calls[0]
        assert names is None or name in names
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
        assert set(arguments) == set(schema["required"])
        assert all(v in schema["properties"][k]["enum"] for k, v in arguments.items())


def test_tool_choice_errors(client):
    for kw, param in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                      ({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                       "response_format"),
                      ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type")]:
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, "Hi [plain]", **kw)
        assert err.value.body["param"] == param, err.value.body


def test_offline_chat_renders_tools_and_template_kwargs(scripted):
    """LLM.chat(tools=...) renders them into the prompt (the template's tool section, or for a
    template without one the system prompt) and returns the reply as text."""
    from ingot import LLM, SamplingParams

    llm = LLM(str(scripted), device="cpu", show_progress=False)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16)
        out = llm.chat([{"role": "user", "content": "Weather in Paris? [tool]"}], greedy, tools=TOOLS)[0]
        assert out.outputs[0].text == reply("[tool]")
        assert llm.get_tokenizer().decode(out.prompt_token_ids).startswith("<|im_start|>system\nTools: get_weather get_time")
        off = llm.chat([{"role": "user", "content": "Hi"}], greedy, chat_template_kwargs={"enable_thinking": False})[0]
        assert off.outputs[0].text == reply("</think>")
        plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"  # no tool section
        text = llm.get_tokenizer().render_chat([{"role": "user", "content": "Hi"}], chat_template=plain, tools=TOOLS)
        assert text.startswith("system: You can call functions") and '"name": "get_time"' in text
    finally:
        llm.shutdown()
