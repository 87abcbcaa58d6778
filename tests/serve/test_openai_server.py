"""`ingot serve` with the default model (SmolLM2-135M, CPU), driven by the official `openai`
client; every answer is checked against the offline engine on the same model."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ingot import LLM, SamplingParams
from tests.serve.server_process import running_server, wait_until
from tests.serve.soak import Answer, make_jobs, run_clients

KEY = "test-key"
MODEL = "smol"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three most useful things"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    with running_server("--api-key", KEY, "--served-model-name", MODEL, "--quiet") as srv:
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
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools"
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
    """300 concurrent requests of mixed lengths, 20% of the clients leave at random points:
    every other request completes with offline greedy's text, no block leaks, still healthy
    (tests/serve/test_soak_cuda.py: 2,000 on a GPU)."""
    jobs = make_jobs(int(os.environ.get("INGOT_SOAK_REQUESTS", "300")))
    expected = [o.outputs[0].text for o in offline.generate([j.prompt for j in jobs], [greedy(j.max_tokens) for j in jobs],
                                                             use_tqdm=False)]
    results = run_clients(server.v1, KEY, MODEL, jobs)
    kept = [i for i, r in enumerate(results) if r != "left"]
    assert len(kept) > 0.65 * len(jobs)
    assert [results[i].text if isinstance(results[i], Answer) else results[i] for i in kept] == [expected[i] for i in kept]
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
