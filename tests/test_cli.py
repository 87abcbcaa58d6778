"""The `ingot generate` / `ingot chat` commands on a tiny checkpoint."""

from __future__ import annotations

import io

import pytest

from ingot import LLM, SamplingParams
from ingot.cli import build_parser, main
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


def test_chat_reads_turns_until_empty_line(tiny, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhow are you\n\n"))
    assert main(["chat", "--model", tiny, "--device", "cpu", "--max-tokens", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2


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
