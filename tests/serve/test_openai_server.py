"""`ingot serve` with the default model (SmolLM2-135M, CPU), driven by the official `openai`
client; every answer is checked against the offline engine on the same model."""

from __future__ import annotations

import json
import os
import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ingot import LLM, SamplingParams
from ingot.serve.protocol import CompletionRequest
from tests.serve.server_process import running_server, wait_until
from tests.serve.soak import CONSTRAINTS, Answer, make_jobs, run_clients, valid

KEY = "test-key"
MODEL = "smol"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three most useful things"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    with running_server("--api-key", KEY, "--served-model-name", MODEL, "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", "--quiet") as srv:
        yield srv
    assert srv.proc.returncode == 0, "".join(srv.log[-20:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(smollm2_gguf):
    llm = LLM(device="cpu", show_progress=False)
    yield llm
    llm.shutdown()


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def idle(server) -> bool:
    m = metrics(server)
    return m["ingot:num_requests_running"] == 0 and m["ingot:num_requests_waiting"] == 0 and m["ingot:kv_cache_usage_perc"] == 0


def test_completions_plain_and_streamed_equal_offline(client, offline):
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy(), use_tqdm=False)]
    plain = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == expected
    assert plain.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in offline.generate(PROMPTS, greedy(), use_tqdm=False))
    assert plain.object == "text_completion" and plain.model == MODEL and plain.id and plain.created
    for prompt, text in zip(PROMPTS, expected):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_token_id_prompts(client, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[0])
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == offline.generate({"prompt_token_ids": ids}, greedy(6), use_tqdm=False)[0].outputs[0].text


def test_chat_plain_and_streamed_equal_offline(client, offline):
    expected = offline.chat(CHAT, greedy(16), use_tqdm=False)[0].outputs[0]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].message.content == expected.text
    assert plain.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_n_with_a_seed_is_reproducible(client):
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[2], n=2, seed=7, temperature=1.0, max_tokens=10)
            for _ in range(2)]
    texts = [[c.text for c in sorted(r.choices, key=lambda c: c.index)] for r in runs]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    chat = [client.chat.completions.create(model=MODEL, messages=CHAT, n=2, seed=3, temperature=1.0, max_tokens=8)
            for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]


def test_completion_logprobs_legacy_format(client, offline):
    expected = offline.generate(PROMPTS[0], greedy(5, logprobs=3), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([p[t].logprob for t, p in zip(expected.token_ids, expected.logprobs)], abs=1e-4)
    assert lp.tokens == [p[t].decoded_token for t, p in zip(expected.token_ids, expected.logprobs)]
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=1, echo=True)
    n_prompt = len(offline.get_tokenizer().encode(PROMPTS[0]))
    assert echo.choices[0].text.startswith(PROMPTS[0])
    assert len(echo.choices[0].logprobs.tokens) == n_prompt + 2 and echo.choices[0].logprobs.token_logprobs[0] is None


def test_chat_logprobs_format(client, offline):
    expected = offline.chat(CHAT, greedy(4, logprobs=2), use_tqdm=False)[0].outputs[0]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([p[t].logprob for t, p in zip(expected.token_ids, expected.logprobs)], abs=1e-4)
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                                 top_logprobs=1, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_stop_strings(client, offline):
    full = offline.generate(PROMPTS[1], greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = "return"
    assert stop in full, full
    expected = offline.generate(PROMPTS[1], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == expected.text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text


def test_token_rules_equal_offline(client, server, offline):
    tok = offline.get_tokenizer()
    plain = offline.generate(PROMPTS[0], greedy(8), use_tqdm=False)[0].outputs[0]
    word = plain.text.split()[0]  # the answer's first word
    allowed = sorted(set(plain.token_ids) | set(tok.encode(" Lyon, London and Rome are cities.", add_special_tokens=False)))
    bias = {tok.encode(" Lyon", add_special_tokens=False)[0]: 2.5, plain.token_ids[-1]: -3.0}
    expected = offline.generate(PROMPTS[0], greedy(8, logit_bias=bias, allowed_token_ids=allowed, bad_words=[word]),
                                use_tqdm=False)[0].outputs[0]
    assert expected.text != plain.text and set(expected.token_ids) <= set(allowed)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                     logit_bias={str(t): b for t, b in bias.items()},
                                     extra_body={"allowed_token_ids": allowed, "bad_words": [word]})
    assert out.choices[0].text == expected.text
    answer = offline.chat(CHAT, greedy(8), use_tqdm=False)[0].outputs[0].text
    red = tok.encode(" Red", add_special_tokens=False)[0]
    expected = offline.chat(CHAT, greedy(8, bad_words=[answer.split()[0]], logit_bias={red: 100.0}), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                          logit_bias={str(red): 250}, extra_body={"bad_words": [answer.split()[0]]})
    assert chat.choices[0].message.content == expected.outputs[0].text != answer
    r = raw(server, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "logit_bias": {"red": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_logit_bias_keys_are_ids_and_biases_are_clamped():
    body = CompletionRequest(prompt="x", logit_bias={"5": 250, "6": -1e9, "7": 0.5})
    assert body.sampling_params(4, None).logit_bias == {5: 100.0, 6: -100.0, 7: 0.5}


def test_include_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.total_tokens == chat[-1].usage.prompt_tokens + 3


def raw(server, method: str, path: str, key: str | None = KEY, headers: dict | None = None, **kw) -> httpx.Response:
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kw)


BAD = {"type": "nonsense"}  # a schema xgrammar cannot compile


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [10 ** 7]}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "suffix": "x"}, "suffix"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"one": 5}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"1": 5, str(10 ** 7): 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "bad_words": ["ok", " "]}, "bad_words"),
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ({"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"model": MODEL, "prompt": "hi", "guided_regex": "[a-"}, "guided_regex"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
     "response_format"),
    ({"model": MODEL, "prompt": "hi", "guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_completion_requests_get_400_naming_the_field(server, body, param):
    r = raw(server, "POST", "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert "Traceback" not in r.text


def test_error_statuses(server, client):
    assert raw(server, "POST", "/v1/completions", key=None, json={"prompt": "hi"}).status_code == 401
    wrong = raw(server, "POST", "/v1/completions", key="nope", json={"prompt": "hi"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    missing = raw(server, "POST", "/v1/chat/completions", json={"model": "gpt-4", "messages": CHAT})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    long = raw(server, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi " * 1000, "max_tokens": 8000})
    assert long.status_code == 400 and "maximum context length" in long.json()["error"]["message"]
    assert "8000" in long.json()["error"]["message"]
    garbled = raw(server, "POST", "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert garbled.status_code == 400 and "JSON" in garbled.json()["error"]["message"]
    tools = raw(server, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]})
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools.0.function"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])


def test_models_health_version_tokenize(server, offline):
    ready = next(line for line in server.log if "ready on" in line)
    assert ready.rstrip().endswith(", max_num_seqs 256)"), ready  # the default on a CPU
    models = raw(server, "GET", "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert raw(server, "GET", "/health", key=None).status_code == 200
    assert "version" in raw(server, "GET", "/version", key=None).json()
    tok = offline.get_tokenizer()
    got = raw(server, "POST", "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert got["tokens"] == tok.encode(PROMPTS[0]) and got["count"] == len(got["tokens"])
    chat = raw(server, "POST", "/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tok.encode_chat(CHAT)
    assert raw(server, "POST", "/detokenize", json={"tokens": got["tokens"]}).json()["prompt"] == tok.decode(got["tokens"])


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metrics(server)["ingot:kv_cache_usage_perc"] > 0
    assert wait_until(lambda: idle(server), 30), metrics(server)


def test_metrics_count_requests_and_latencies(server, client):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["ingot:generation_tokens_total"] - before["ingot:generation_tokens_total"] >= 4
    assert after["ingot:time_to_first_token_seconds_count"] == before["ingot:time_to_first_token_seconds_count"] + 1
    assert after["ingot:e2e_request_latency_seconds_count"] == before["ingot:e2e_request_latency_seconds_count"] + 1
    assert after["ingot:inter_token_latency_seconds_count"] - before["ingot:inter_token_latency_seconds_count"] == 3


def test_soak_with_disconnecting_clients(server, offline):
    """200 concurrent requests (INGOT_SOAK_REQUESTS) of mixed lengths, a quarter of them
    constrained (a choice, a regex, a JSON schema through structured_outputs, guided_regex
    and response_format), 20% of the clients leave at random points: every other request
    completes with offline greedy's text under the same constraint, every finished
    constrained answer follows it, no block leaks, still healthy (tests/serve/test_soak_cuda.py:
    2,000 on a GPU)."""
    jobs = make_jobs(int(os.environ.get("INGOT_SOAK_REQUESTS", "200")), constrained=0.25)
    params = [greedy(j.max_tokens, structured_outputs=j.structured_outputs()) for j in jobs]
    expected = [o.outputs[0].text for o in offline.generate([j.prompt for j in jobs], params, use_tqdm=False)]
    results = run_clients(server.v1, KEY, MODEL, jobs)
    kept = [i for i, r in enumerate(results) if r != "left"]
    assert len(kept) > 0.65 * len(jobs)
    assert [results[i].text if isinstance(results[i], Answer) else results[i] for i in kept] == [expected[i] for i in kept]
    finished = [i for i in kept if jobs[i].constraint is not None and results[i].finish_reason == "stop"]
    assert {jobs[i].constraint for i in finished} == set(CONSTRAINTS), "every kind of constraint finished an answer"
    assert [i for i in finished if not valid(jobs[i], results[i].text)] == []
    assert wait_until(lambda: idle(server), 60), metrics(server)
    assert raw(server, "GET", "/health", key=None).status_code == 200


def test_full_queue_gets_503(tmp_path, smollm2_gguf):
    with running_server("--max-num-seqs", "1", "--max-queued-requests", "0", "--quiet") as srv:
        body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a collected iterator closes the connection
            next(lines)
            busy = httpx.post(srv.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
        assert wait_until(lambda: idle(srv), 30)
        assert httpx.post(srv.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
    assert srv.proc.returncode == 0


# ---------------------------------------------------------------- structured outputs, tools, fields

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "country"],
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0},
                       "country": {"enum": ["France", "Italy", "Spain"]}}}
ASK_CITY = [{"role": "user", "content": "Describe the capital of France as JSON."}]


def test_response_format_json_schema_plain_and_streamed(client):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    plain = client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=60, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(plain.choices[0].message.content), CITY)
    chunks = client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=60, temperature=0, response_format=fmt,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    # the completions API takes response_format too (the legacy client has no argument for it)
    text = client.completions.create(model=MODEL, prompt="The capital of France, as JSON:", max_tokens=40, temperature=0,
                                     extra_body={"response_format": fmt}).choices[0].text
    jsonschema.validate(json.loads(text), CITY)


def test_vllm_structured_output_fields(client):
    jsonschema = pytest.importorskip("jsonschema")

    def chat(**extra) -> str:
        return client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=40, temperature=0,
                                              extra_body=extra).choices[0].message.content

    jsonschema.validate(json.loads(chat(guided_json=CITY, guided_decoding_backend="xgrammar")), CITY)
    assert chat(guided_choice=["Paris", "Rome"]) in ("Paris", "Rome")
    assert re.fullmatch(r"[A-Z][a-z]{1,9}, (France|Italy)", chat(guided_regex=r"[A-Z][a-z]{1,9}, (France|Italy)"))
    assert chat(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                              "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                                                             "properties": {"city": {"type": "string", "maxLength": 20}}}}},
           {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                              "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                                                             "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls(response, stream: bool) -> tuple[list[tuple[str, dict]], str, object]:
    """(name, arguments) of each call, the finish reason and the content, streamed or not."""
    if not stream:
        choice = response.choices[0]
        return ([(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []],
                choice.finish_reason, choice.message.content)
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in response:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.id:
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        content += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(name, json.loads(args)) for name, args in calls.values()], finish, content or None


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice(client, stream):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        response = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=WEATHER, tool_choice=choice,
                                                  max_tokens=60, temperature=0, stream=stream)
        calls, finish, content = _calls(response, stream)
        assert calls and finish == "tool_calls" and content is None
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])
        if choice is named:
            assert [name for name, _ in calls] == ["get_weather"]


def test_tools_with_none_and_auto_and_a_tool_result(client, server):
    """SmolLM2's template has no tool section: the tools go into the system prompt, the
    history's call and result become text in the hermes format."""
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=WEATHER, tool_choice=choice,
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "Sunny, 24 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=WEATHER, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content
    ids = raw(server, "POST", "/tokenize", json={"messages": history, "tools": WEATHER}).json()["tokens"]
    prompt = raw(server, "POST", "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in prompt


def test_fields_openai_and_vllm_define_are_refused_others_ignored_with_one_warning(server):
    for field, value in [("store", True), ("functions", [{"name": "f"}]), ("audio", {"voice": "x"}),
                         ("logprob_token_ids", [1]), ("echo", True)]:
        r = raw(server, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    ok = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "store": False, "parallel_tool_calls": True,
          "user": "u", "service_tier": "auto", "not_a_field_anywhere": 1}
    for _ in range(2):
        assert raw(server, "POST", "/v1/chat/completions", json=ok).status_code == 200
    assert wait_until(lambda: any("not_a_field_anywhere" in line for line in server.log), 5)
    assert sum("not_a_field_anywhere" in line for line in server.log) == 1


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}], "messages.1.content"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], "messages.1.tool_call_id"),
])
def test_bad_messages_get_400(server, messages, param):
    r = raw(server, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_logprobs_truncation_and_continuous_usage(client, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[3])
    expected = offline.generate({"prompt_token_ids": ids}, greedy(3, prompt_logprobs=1), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 1}).choices[0]
    plp = got.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [p[str(t)]["logprob"] for p, t in zip(plp[1:], ids[1:])] == pytest.approx(
        [p[t].logprob for p, t in zip(expected.prompt_logprobs[1:], ids[1:])], abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    # truncate_prompt_tokens keeps the last N tokens
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == offline.generate({"prompt_token_ids": ids[-3:]}, greedy(4), use_tqdm=False)[0].outputs[0].text
    # continuous_usage_stats: usage in every chunk, counting up
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True,
                                                 stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 4


def test_model_retrieve_and_embeddings(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="hello")
    assert "/v1/embeddings is not supported" in err.value.body["message"]
