"""The event loop the server and the HTTP bench client run on (uvloop where installed), and
the engine process's client on it: outputs arrive whole through a pipe libuv polls."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from ingot.config import EngineConfig
from ingot.engine import event_loop
from ingot.engine.async_llm import AsyncLLM
from ingot.engine.engine import Engine
from ingot.llm import LLM
from ingot.engine.engine_process import PIPE_BYTES, widen_pipe
from ingot.loading.checkpoint import open_checkpoint
from ingot.sampling_params import SamplingParams
from tests.helpers import write_tiny_checkpoint


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_when_installed():
    pytest.importorskip("uvloop")
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_run_falls_back_to_asyncio(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert event_loop.run(_loop_module()).startswith("asyncio")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_widen_pipe():
    r, w = os.pipe()
    try:
        assert widen_pipe(w) == PIPE_BYTES
        os.write(w, b"x" * (PIPE_BYTES - 1))  # would block at Linux's default 64 KiB
    finally:
        os.close(r)
        os.close(w)


def test_engine_process_on_uvloop(tmp_path):
    """Greedy outputs through the engine process on uvloop equal the in-process engine's;
    the outputs pipe stays blocking although libuv polls it (else a step's message can be
    read half-written: BlockingIOError)."""
    pytest.importorskip("uvloop")
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["hello world", "the sea is", "one two three four"]
    offline = LLM(model=str(path), dtype="float32", device="cpu", show_progress=False)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    offline.shutdown()
    llm = AsyncLLM.in_process(config)

    async def one(prompt: str) -> list[int]:
        ids: list[int] = []
        async for out in llm.generate(prompt, params):
            ids = out.outputs[0].token_ids
        return ids

    async def main() -> tuple[bool, list[list[int]]]:
        got = await asyncio.gather(*(one(p) for p in prompts))
        return os.get_blocking(llm.backend._out.fileno()), got

    try:
        blocking, got = event_loop.run(main())
    finally:
        llm.backend.shutdown()
    assert blocking
    assert got == expected
