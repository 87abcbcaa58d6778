"""The `ingot generate` / `ingot chat` commands on a tiny checkpoint."""

from __future__ import annotations

import io

import pytest

from ingot import LLM, SamplingParams
from ingot.cli import build_parser, main
from ingot.config import ConfigError
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "llama", "llama"))


def test_generate_streams_the_same_text_as_the_api(tiny, capsys):
    rc = main(["generate", "hello world", "--model", tiny, "--device", "cpu", "--max-tokens", "6", "--quiet"])
    assert rc == 0
    expected = LLM(tiny, device="cpu", show_progress=False).generate(
        "hello world", SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_chat_reads_turns_until_empty_line(tiny, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", _Terminal("hi\nhow are you\n\n"))
    assert main(["chat", "--model", tiny, "--device", "cpu", "--max-tokens", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2


def test_chat_with_piped_input_prints_only_the_replies(tiny, capsys, monkeypatch):
    """No `you>` / `assistant>` prompts when stdin is not a terminal: one reply per line."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhow are you\n"))
    assert main(["chat", "--model", tiny, "--device", "cpu", "--max-tokens", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "you>" not in out and "assistant>" not in out and out.count("\n") == 2


def test_generate_with_an_empty_prompt_prints_only_the_error(tiny, capfd):
    assert main(["generate", "", "--model", tiny, "--device", "cpu", "--quiet"]) == 2
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err.strip() == "ingot: error: prompt is empty"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "", "--device", "cpu"], "prompt is empty"),
        (["generate", "x", "--model", "/no/such/dir"], "does not exist"),
        (["generate", "x", "--top-p", "0"], "top_p"),
    ],
)
def test_errors_exit_2_with_a_message(tiny, capsys, argv, message):
    if "--model" not in argv:
        argv = [*argv, "--model", tiny]
    assert main([*argv, "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_help_explains_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--dtype", "--device", "--max-tokens", "--temperature", "--top-p", "--seed", "--decode-compile"):
        assert flag in text


def test_invalid_utf8_prompt_is_replaced_not_a_traceback(tiny, capsys):
    # what Python makes of the bytes ff fe on the command line
    prompt = b"\xff\xfe hello".decode("utf-8", "surrogateescape")
    assert main(["generate", prompt, "--model", tiny, "--device", "cpu", "--max-tokens", "4", "--quiet"]) == 0
    captured = capsys.readouterr()
    expected = LLM(tiny, device="cpu", show_progress=False).generate(
        "\ufffd\ufffd hello", SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].text
    assert captured.out == expected + "\n" and "Traceback" not in captured.err


def test_ctrl_c_stops_the_reply_and_keeps_the_chat(tiny, capsys, monkeypatch):
    """The first reply is interrupted; the chat goes on, and the next turn's prompt holds
    the conversation without the interrupted turn."""
    from ingot.llm import LLM as LLMClass

    real = LLMClass.stream
    seen = []

    def stream(self, prompt, params=None):
        seen.append([m["content"] for m in prompt])
        inner = real(self, prompt, params)
        if len(seen) == 1:
            next(inner)
            inner.close()
            raise KeyboardInterrupt
        return inner

    monkeypatch.setattr(LLMClass, "stream", stream)
    monkeypatch.setattr("sys.stdin", _Terminal("first\nsecond \udcff\n\n"))
    assert main(["chat", "--model", tiny, "--device", "cpu", "--max-tokens", "3", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "interrupted" in captured.err
    assert seen == [["first"], ["second \udcff"]]
    assert captured.out.count("assistant> ") == 2


def test_max_model_len_zero_is_an_error(tiny, capsys):
    assert main(["generate", "hi", "--model", tiny, "--device", "cpu", "--max-model-len", "0", "--quiet"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def test_engine_flags_reach_the_engine_config():
    """`ingot generate` / `serve` flags become EngineConfig fields; a bad value is the config's clear error."""
    from ingot.config import EngineConfig
    from ingot.engine_args import engine_overrides

    for command in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*command, "--prefill-wave-tokens", "0", "--no-overlap-scheduling"])
        cfg = EngineConfig.create(**engine_overrides(args), env={})
        assert cfg.prefill_wave_tokens == 0 and cfg.overlap_scheduling is False
    assert EngineConfig.create(env={}).prefill_wave_tokens == 2048  # the default: waves on
    with pytest.raises(ConfigError, match="prefill_wave_tokens"):
        EngineConfig.create(**engine_overrides(build_parser().parse_args(["serve", "--prefill-wave-tokens", "-1"])), env={})


def test_shape_and_load_format_reach_the_engine_config():
    """--shape NAME is --model NAME --load-format dummy; --shape with another load format is an error."""
    from ingot.config import EngineConfig
    from ingot.engine_args import engine_overrides

    for command in (["generate", "hi"], ["serve"], ["chat"]):
        args = build_parser().parse_args([*command, "--shape", "qwen2.5-7b", "--tokenizer", "default"])
        cfg = EngineConfig.create(**engine_overrides(args), env={})
        assert (cfg.model, cfg.load_format, cfg.tokenizer) == ("qwen2.5-7b", "dummy", "default")
        args = build_parser().parse_args([*command, "--model", "m", "--load-format", "dummy"])
        assert EngineConfig.create(**engine_overrides(args), env={}).load_format == "dummy"
    with pytest.raises(ConfigError, match="--shape takes random weights"):
        engine_overrides(build_parser().parse_args(["generate", "hi", "--shape", "qwen2.5-7b", "--load-format", "auto"]))
    with pytest.raises(SystemExit):  # --model and --shape exclude each other
        build_parser().parse_args(["generate", "hi", "--shape", "qwen2.5-7b", "--model", "m"])


def test_generate_with_random_weights_of_a_config(tmp_path, capsys):
    """--load-format dummy on a directory holding only a config.json: random weights, token-id words."""
    import json

    from tests.helpers import ARCHS, TINY

    (tmp_path / "config.json").write_text(json.dumps({**TINY, **ARCHS["qwen2"]}))
    assert main(["generate", "<1> <2> <3>", "--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                 "--max-tokens", "3", "--quiet"]) == 0
    words = capsys.readouterr().out.split()
    assert len(words) == 3 and all(w.startswith("<") and w.endswith(">") for w in words), words


def test_generate_with_the_default_model_as_its_own_draft(smollm2_gguf, capsys):
    """`ingot generate --speculative-config '{"model": ...}'`: the default model drafting for
    itself prints plain greedy decoding's text."""
    import json

    spec = json.dumps({"model": str(smollm2_gguf), "num_speculative_tokens": 3})
    prompt = "The three most useful things to know about the sea are"
    assert main(["generate", prompt, "--device", "cpu", "--max-tokens", "16", "--speculative-config", spec,
                 "--quiet"]) == 0
    with LLM(device="cpu", show_progress=False) as llm:
        expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"
