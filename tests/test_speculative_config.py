"""speculative_config: vLLM's dict form, validated at start-up with errors that name the problem."""

from __future__ import annotations

import argparse
import re

import pytest

from ingot.config import ConfigError, EngineConfig, SpeculativeConfig
from ingot.engine_args import add_engine_args, engine_overrides


def test_the_dict_form_and_vllms_lookup_defaults():
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert c.speculative_config == SpeculativeConfig("ngram", 3, 4, 4)
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 5, "disable_by_batch_size": 8})
    assert c.speculative_config == SpeculativeConfig("ngram", 16, 2, 5, 8)
    assert EngineConfig().speculative_config is None


def test_a_model_implies_the_draft_model_method():
    c = EngineConfig(speculative_config={"model": "org/draft", "num_speculative_tokens": 3, "quantization": "fp8",
                                         "draft_tensor_parallel_size": 1})
    assert c.speculative_config == SpeculativeConfig("draft_model", 3, model="org/draft", quantization="fp8")
    assert c.speculative_config.uses_draft_model
    c = EngineConfig(speculative_config={"method": "draft_model", "model": "m", "num_speculative_tokens": 1})
    assert c.speculative_config == SpeculativeConfig("draft_model", 1, model="m")
    c = EngineConfig(tensor_parallel_size=2, speculative_config={"model": "m", "num_speculative_tokens": 1})
    assert c.speculative_config.uses_draft_model  # (the draft runs whole on the driver: tests/distributed/test_tp_draft.py)


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' needs 'model'"),
    ({"method": "eagle3", "model": "m", "quantization": "fp8", "num_speculative_tokens": 2}, "not to an 'eagle3' head"),
    ({"method": "eagle3", "model": "m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram"}, "missing field(s) ['num_speculative_tokens']"),
    ({"num_speculative_tokens": 2}, "missing field(s) ['method']"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "org/draft"}, "method must be 'draft_model'"),
    ({"model": "org/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 4},
     "draft_tensor_parallel_size must be 1"),
    ({"model": "org/draft", "num_speculative_tokens": 2, "quantization": "int3"}, "quantization must be one of"),
    ({"model": "org/draft", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "apply to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "revision": "main"}, "unknown field(s) ['revision']"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_are_refused_by_name(spec, message):
    with pytest.raises(ConfigError, match="speculative_config: .*" + re.escape(message)) as e:
        EngineConfig(speculative_config=spec)
    assert e.value.field == "speculative_config"


def test_environment_and_command_line():
    c = EngineConfig.create(env={"INGOT_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 2}'})
    assert c.speculative_config == SpeculativeConfig("ngram", 2)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert EngineConfig(**engine_overrides(args)).speculative_config == SpeculativeConfig("ngram", 5)
    with pytest.raises(ConfigError, match="--speculative-config: not JSON"):
        engine_overrides(p.parse_args(["--speculative-config", "{method: ngram}"]))
