"""`ingot serve --tp 2`: the engine process (a daemonic child of the server) spawns its worker;
requests are served, and every process goes when the server stops or is killed."""

from __future__ import annotations

import httpx
import pytest

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint
from tests.serve.server_process import running_server, wait_until
from tests.serve.test_engine_process import alive, children, engine_of


PROMPT = list(range(5, 40, 3))


def _complete(srv) -> list[float]:
    """Logprobs of the sampled tokens (seeded sampling: the logits decide which tokens)."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True, "logprobs": 1}
    r = httpx.post(srv.v1 + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_serve_tp2_answers_like_tp1_and_leaves_no_process(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "qwen2", "qwen2"))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=1)
    with LLM(path, device="cpu", max_model_len=128, show_progress=False) as llm:
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        expected = [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
    assert len(set(out.outputs[0].token_ids)) > 2
    with running_server("--model", path, "--quiet", "--max-model-len", "128", "--tp", "2") as srv:
        engine = engine_of(srv.proc.pid)
        workers = children(engine)
        assert workers and all(alive(w) for w in workers)
        assert _complete(srv) == pytest.approx(expected, abs=1e-4)
    assert srv.proc.returncode == 0
    assert wait_until(lambda: not any(alive(p) for p in [engine, *workers]), 30)


def test_killed_server_takes_engine_and_workers_along(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "qwen2", "qwen2"))
    with running_server("--model", path, "--quiet", "--max-model-len", "128", "--tp", "2") as srv:
        engine = engine_of(srv.proc.pid)
        workers = children(engine)
        srv.proc.kill()
        srv.proc.wait()
        assert wait_until(lambda: not any(alive(p) for p in [engine, *workers]), 30)
