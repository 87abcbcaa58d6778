"""EngineConfig: defaults, INGOT_* overrides, precedence, clear errors."""

from __future__ import annotations

import pytest

from ingot.config import ConfigError, EngineConfig


def test_env_overrides_defaults_and_args_override_env():
    env = {"INGOT_DECODE_COMPILE": "1", "INGOT_MAX_NUM_SEQS": "64", "INGOT_CUDAGRAPH_CAPTURE_SIZES": "1, 4,16",
           "INGOT_COMPILE_NATIVE_OPS": "rms_norm", "INGOT_MAX_MODEL_LEN": "none", "INGOT_GPU_MEMORY_UTILIZATION": "0.5"}
    cfg = EngineConfig.create(env=env)
    assert cfg.decode_compile is True and cfg.max_num_seqs == 64
    assert cfg.cudagraph_capture_sizes == (1, 4, 16)
    assert cfg.compile_native_ops == ("rms_norm",) and cfg.max_model_len is None
    assert cfg.gpu_memory_utilization == 0.5
    assert EngineConfig.create(env=env, max_num_seqs=8).max_num_seqs == 8
    assert EngineConfig.create(env={}).decode_compile is False


@pytest.mark.parametrize("value,expected", [("on", True), ("TRUE", True), ("0", False), ("off", False)])
def test_bool_spellings(value, expected):
    assert EngineConfig.create(env={"INGOT_DECODE_COMPILE": value}).decode_compile is expected


@pytest.mark.parametrize(
    "env,match",
    [
        ({"INGOT_DECODE_COMPILE": "yes please"}, "INGOT_DECODE_COMPILE"),
        ({"INGOT_BLOCK_SIZE": "0"}, "block_size"),
        ({"INGOT_DTYPE": "float8"}, "dtype"),
        ({"INGOT_COMPILE_NATIVE_OPS": "attention"}, "compile_native_ops"),
        ({"INGOT_CUDAGRAPH_CAPTURE_SIZES": "1,x"}, "INGOT_CUDAGRAPH_CAPTURE_SIZES"),
        ({"INGOT_DEVICE": "tpu"}, "device"),
        ({"INGOT_REASONING_PARSER": "granite"}, r"INGOT_REASONING_PARSER='granite': reasoning_parser must be one of"),
    ],
)
def test_bad_values_name_the_problem(env, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.create(env=env)


def test_load_format_from_env_and_bounds():
    assert EngineConfig().load_format == "auto"
    assert EngineConfig.create(env={"INGOT_LOAD_FORMAT": "dummy"}).load_format == "dummy"
    with pytest.raises(ConfigError, match=r"INGOT_LOAD_FORMAT='pt': load_format must be one of \('auto', 'dummy'\)"):
        EngineConfig.create(env={"INGOT_LOAD_FORMAT": "pt"})


def test_reasoning_parser_from_env():
    assert EngineConfig().reasoning_parser is None
    assert EngineConfig.create(env={"INGOT_REASONING_PARSER": "qwen3"}).reasoning_parser == "qwen3"
    assert EngineConfig.create(env={"INGOT_REASONING_PARSER": "none"}).reasoning_parser is None
    with pytest.raises(ConfigError, match="reasoning_parser must be one of"):
        EngineConfig(reasoning_parser="r1")


def test_removed_options_are_unknown_arguments():
    """Options measured to lose or never used by a default are gone: asking for one is an error."""
    for name in ("skinny_gemm_max_rows", "compile_autotune_gemm", "fake_graph_capture"):
        with pytest.raises(ConfigError, match=f"unknown engine argument.*{name}"):
            EngineConfig.create(env={}, **{name: 1})


def test_at_most_25_fields():
    import dataclasses

    assert len(dataclasses.fields(EngineConfig)) <= 25


def test_bad_bool_message_names_the_variable_once():
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(env={"INGOT_ENABLE_PREFIX_CACHING": "maybe"})
    assert str(info.value) == "INGOT_ENABLE_PREFIX_CACHING='maybe' is not a boolean (use 1/0, true/false, on/off)"


@pytest.mark.parametrize("var,value", [("INGOT_MAX_NUM_SEQS", "0"), ("INGOT_BLOCK_SIZE", "-4"),
                                       ("INGOT_GPU_MEMORY_UTILIZATION", "1.5"), ("INGOT_NUM_KV_BLOCKS", "1"),
                                       ("INGOT_PREFILL_WAVE_TOKENS", "-1")])
def test_bad_environment_values_name_their_variable(var, value):
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(env={var: value})
    assert str(info.value).startswith(f"{var}={value!r}: ")


def test_a_bad_argument_names_the_argument_not_the_environment():
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(env={"INGOT_MAX_NUM_SEQS": "8"}, max_num_seqs=0)
    assert str(info.value).startswith("max_num_seqs must be")


def test_max_num_seqs_defaults_by_device_memory():
    """Left open (None), it is 512 on a GPU of 70 GiB or more and 256 elsewhere; a set value stays."""
    from ingot.config import max_num_seqs_for

    gib = 2**30
    cfg = EngineConfig.create(env={})
    assert cfg.max_num_seqs is None
    assert cfg.for_device(None).max_num_seqs == 256  # CPU
    assert cfg.for_device(40 * gib).max_num_seqs == 256
    assert cfg.for_device(70 * gib).max_num_seqs == 512 and cfg.for_device(141 * gib).max_num_seqs == 512
    assert EngineConfig.create(env={}, max_num_seqs=64).for_device(141 * gib).max_num_seqs == 64
    assert EngineConfig.create(env={"INGOT_MAX_NUM_SEQS": "none"}).max_num_seqs is None
    assert [max_num_seqs_for(m) for m in (None, 70 * gib - 1, 70 * gib)] == [256, 256, 512]


def test_an_engine_resolves_max_num_seqs_for_its_device(tmp_path):
    from ingot.engine.engine import Engine
    from tests.helpers import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    engine = Engine(EngineConfig.create(env={}, model=str(path), device="cpu", show_progress=False))
    assert engine.config.max_num_seqs == 256 == engine.scheduler.max_num_seqs == engine.info().max_num_seqs
