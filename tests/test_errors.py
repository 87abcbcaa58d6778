"""Bad models and files get clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from ingot import CheckpointError, ConfigError, EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import write_tiny_checkpoint


def make(path, **kw):
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False, **kw))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "llama", "llama")


def variant(tiny, dest, **config_changes):
    """A copy of the tiny checkpoint with config.json fields changed."""
    shutil.copytree(tiny, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config_changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_unknown_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        make("/no/such/model")


def test_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="local model directory"):
        make("someorg/somemodel-that-is-not-cached")


def test_truncated_safetensors(tmp_path, tiny):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        make(bad)


def test_unsupported_architecture(tmp_path, tiny):
    bad = variant(tiny, tmp_path / "arch", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        make(bad)


def test_missing_weights(tmp_path, tiny):
    bad = tmp_path / "missing"
    shutil.copytree(tiny, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != victim}
    (bad / victim).unlink()
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing weights"):
        make(bad)


def test_a_sliding_window_shorter_than_the_context_is_served(tmp_path, tiny):
    path = variant(tiny, tmp_path / "mistral", architectures=["MistralForCausalLM"], sliding_window=32)
    engine = make(path)
    assert engine.max_model_len > 32 and engine.scheduler.blocks.window == 32


def test_max_model_len_beyond_cache(tiny):
    with pytest.raises(ConfigError, match="exceeds the KV cache"):
        make(tiny, max_model_len=200, num_kv_blocks=4)


def test_bad_config_values():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="INGOT_MAX_NUM_SEQS"):
        EngineConfig.create(env={"INGOT_MAX_NUM_SEQS": "many"})
    with pytest.raises(ConfigError, match="INGOT_DECODE_COMPILE"):
        EngineConfig.create(env={"INGOT_DECODE_COMPILE": "maybe"})
    with pytest.raises(ConfigError, match="unknown engine argument"):
        EngineConfig.create(max_num_seq=3)
