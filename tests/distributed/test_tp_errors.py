"""Tensor-parallel failures: clear errors, and no worker process left behind, whatever happens."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from ingot import LLM, SamplingParams
from ingot.config import ConfigError
from ingot.loading.model_config import ModelConfig
from ingot.models.registry import check_tensor_parallel
from ingot.runner.tp_runner import TensorParallelError
from tests.distributed.tp_helpers import FAULT_ENV, FAULT_SITE, alive, fail_in_forward, tp_engine
from tests.helpers import TINY, write_tiny_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "qwen2", "qwen2"))


def _no_children() -> bool:
    return not multiprocessing.active_children()


def _config(**fields) -> ModelConfig:
    return ModelConfig.from_hf({**TINY, "architectures": ["Qwen2ForCausalLM"], **fields})


@pytest.mark.parametrize("fields, size, words", [
    (dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), 2, "num_attention_heads=9"),
    (dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=72), 2, "num_key_value_heads=3"),
    (dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=130), 4, "intermediate_size=130"),
])
def test_shapes_that_do_not_split_are_config_errors(fields, size, words):
    with pytest.raises(ConfigError, match=words) as info:
        check_tensor_parallel(_config(**fields), size)
    assert info.value.field == "tensor_parallel_size"


def test_moe_shapes():
    moe = dict(architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
    check_tensor_parallel(_config(**moe), 2)
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=42 is not divisible by tensor_parallel_size=4"):
        check_tensor_parallel(_config(**{**moe, "shared_expert_intermediate_size": 42}), 4)
    with pytest.raises(ConfigError, match="moe_intermediate_size=30"):
        check_tensor_parallel(_config(**{**moe, "moe_intermediate_size": 30}), 4)
    olmoe = dict(architectures=["OlmoeForCausalLM"], num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match="q/k norm spans every head"):
        check_tensor_parallel(_config(**olmoe), 2)


def test_shapes_that_split():
    check_tensor_parallel(_config(num_attention_heads=8, num_key_value_heads=2), 4)  # KV heads replicated twice
    check_tensor_parallel(_config(vocab_size=385), 2)  # the vocabulary is padded
    check_tensor_parallel(_config(num_attention_heads=9, num_key_value_heads=3, hidden_size=72, intermediate_size=96), 3)


def test_smollm2_over_two_ranks_is_refused_before_any_process_starts(smollm2_gguf):
    with pytest.raises(ConfigError, match="num_attention_heads=9 is not divisible by tensor_parallel_size=2"):
        LLM(str(smollm2_gguf), device="cpu", tensor_parallel_size=2, show_progress=False)
    assert _no_children() and not dist.is_initialized()


def test_worker_failing_to_load_surfaces_its_traceback(tiny, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1")  # the spawned worker of rank 1 fails loading its shard
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAULT_SITE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    with pytest.raises(TensorParallelError) as info:
        tp_engine(tiny, tensor_parallel_size=2)
    text = str(info.value)
    assert "worker 1 failed" in text and "Traceback (most recent call last)" in text
    assert "RuntimeError: injected fault on rank 1 while loading" in text
    assert _no_children() and not dist.is_initialized()


def test_worker_failing_in_a_step_fails_its_requests_and_stops_the_group(tiny):
    engine = tp_engine(tiny, tensor_parallel_size=2, max_model_len=128)
    engine.executor.run_on_ranks(fail_in_forward, 1, 2)
    pids = engine.executor.workers.pids
    seq = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    error = outputs[-1].error
    assert seq.finish_reason == "error"
    assert "worker 1 failed" in error and "Traceback (most recent call last)" in error
    assert "RuntimeError: injected fault on rank 1 in forward" in error
    assert not any(alive(p) for p in pids) and _no_children() and not dist.is_initialized()
    engine.add_request([5, 6], SamplingParams(max_tokens=2))
    (later,) = engine.step()
    assert "the tensor-parallel group is down" in later.error and "injected fault" in later.error
    engine.close()


def _driver(tiny: str, body: str) -> subprocess.Popen:
    """A child Python process that starts a TP2 LLM, prints its worker pids, then runs ``body``.
    Ctrl-C raises KeyboardInterrupt there even if this run's parent ignores SIGINT (a
    background job of a shell without job control does, and children inherit it)."""
    code = textwrap.dedent(f"""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from ingot import LLM, SamplingParams
        llm = LLM({tiny!r}, device="cpu", tensor_parallel_size=2, show_progress=False, max_model_len=256)
        print(*llm.engine.executor.workers.pids, flush=True)
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _pids(proc: subprocess.Popen) -> list[int]:
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        pytest.fail(f"the driver did not start: {proc.stderr.read()}")
    return [int(p) for p in line.split()]


def _gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_workers_exit_when_the_driver_is_killed(tiny):
    proc = _driver(tiny, "import time; time.sleep(120)")
    try:
        pids = _pids(proc)
        assert pids and all(alive(p) for p in pids)
        proc.kill()  # SIGKILL: no clean-up in the driver at all
        proc.wait(30)
        assert _gone(pids)
    finally:
        proc.kill()


def test_ctrl_c_in_the_driver_stops_everything(tiny):
    body = """
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        while True:
            llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
            print("round", flush=True)
    """
    proc = _driver(tiny, body)
    try:
        pids = _pids(proc)
        assert proc.stdout.readline().strip() == "round"  # mid-generate from here on
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
        assert _gone(pids)
    finally:
        proc.kill()


def test_tensor_parallel_size_from_the_environment_and_the_command_line():
    from ingot.cli import build_parser
    from ingot.config import EngineConfig
    from ingot.engine_args import engine_overrides

    assert EngineConfig.create(env={"INGOT_TENSOR_PARALLEL_SIZE": "2"}).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="INGOT_TENSOR_PARALLEL_SIZE='0'"):
        EngineConfig.create(env={"INGOT_TENSOR_PARALLEL_SIZE": "0"})
    for argv in (["generate", "hi", "--tp", "3"], ["serve", "--tensor-parallel-size", "3"]):
        assert engine_overrides(build_parser().parse_args(argv))["tensor_parallel_size"] == 3
    assert build_parser().parse_args(["bench", "decode", "--tp", "2"]).tp == 2
    assert build_parser().parse_args(["check", "drift", "--tensor-parallel-size", "2"]).tp == 2
