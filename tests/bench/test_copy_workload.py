"""The copy workload of `ingot bench serve --workload copy`: deterministic prompts of the asked
lengths that hold the standard-library text they ask the model to repeat."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from ingot.bench.copy_workload import INSTRUCTIONS, SOURCE_MODULES, copy_prompts
from ingot.bench.workload import Workload, WorkloadError, make_requests
from ingot.loading.dummy import id_tokenizer
from ingot.loading.tokenizer import Tokenizer
from tests.helpers import write_tokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    from ingot.loading.checkpoint import open_tokenizer

    return open_tokenizer(str(smollm2_gguf))


@pytest.fixture(scope="module")
def stdlib_text() -> dict[str, set[str]]:
    """The reference: every stripped line of the modules' sources (code), and of their
    docstrings as Python reads them (text)."""
    code, text = set(), set()
    for name in SOURCE_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        code |= {line.strip() for line in source.splitlines()}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text |= {line.strip() for line in (ast.get_docstring(node) or "").splitlines()}
    return {"code": code, "text": text}


LENGTHS = [70, 100, 257, 1000, 3000]


def test_prompts_have_the_asked_lengths_and_are_deterministic_per_seed(smollm2_tokenizer):
    first = copy_prompts(smollm2_tokenizer, LENGTHS, seed=3)
    assert [len(p.token_ids) for p in first] == LENGTHS
    assert copy_prompts(smollm2_tokenizer, LENGTHS, seed=3) == first
    other = copy_prompts(smollm2_tokenizer, LENGTHS, seed=4)
    assert [p.token_ids for p in other] != [p.token_ids for p in first]
    assert {p.kind for p in copy_prompts(smollm2_tokenizer, [80] * 12, seed=0)} == {"code", "text"}


def test_prompts_hold_the_standard_library_text_they_ask_to_repeat(smollm2_tokenizer, stdlib_text):
    tok = smollm2_tokenizer
    for p in copy_prompts(tok, [300, 600, 1200, 300, 800, 500], seed=11):
        rendered = tok.decode(p.token_ids)
        # the chat template around the instruction, then the text, then the assistant's turn
        assert f"<|im_start|>user\n{INSTRUCTIONS[p.kind]}\n\n" in tok.decode(p.token_ids[: p.text_start])
        assert tok.decode(p.token_ids[p.text_end :]) == "<|im_end|>\n<|im_start|>assistant\n"
        assert rendered.endswith("<|im_start|>assistant\n")
        text = tok.decode(p.token_ids[p.text_start : p.text_end])
        lines = [line.strip() for line in text.splitlines()[:-1]]  # the last line may be cut
        assert len(lines) >= 3
        missing = [line for line in lines if line not in stdlib_text[p.kind]]
        assert not missing, (p.kind, missing[:3])


def test_without_a_chat_template_the_instruction_is_plain_text(tmp_path):
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    tok.chat_template = None
    (p,) = copy_prompts(tok, [200], seed=1)
    assert len(p.token_ids) == 200
    assert tok.decode(p.token_ids[: p.text_start]).endswith(f"{INSTRUCTIONS[p.kind]}\n\n")
    assert tok.decode(p.token_ids[p.text_end :]) == "\n\n"


def test_too_short_and_textless_tokenizers_are_refused(smollm2_tokenizer):
    with pytest.raises(ValueError, match="copy prompts need at least"):
        copy_prompts(smollm2_tokenizer, [40], seed=0)  # the SmolLM2 template alone is about 30 tokens
    with pytest.raises(ValueError, match="--tokenizer"):
        copy_prompts(id_tokenizer(1000), [200], seed=0)  # a --shape without --tokenizer: every word is <0>


def test_copy_workload_requests(smollm2_tokenizer):
    w = Workload(5, (90, 400), (16, 32), seed=7, kind="copy")
    reqs = make_requests(w, smollm2_tokenizer.vocab_size, smollm2_tokenizer)
    assert reqs == make_requests(w, smollm2_tokenizer.vocab_size, smollm2_tokenizer)
    assert all(90 <= len(r.prompt_token_ids) <= 400 and 16 <= r.output_len <= 32 and r.arrival_s == 0 for r in reqs)
    assert len({len(r.prompt_token_ids) for r in reqs}) > 1
    with pytest.raises(WorkloadError, match="tokenizer"):
        make_requests(w, smollm2_tokenizer.vocab_size)
    with pytest.raises(WorkloadError, match="copy prompts need at least"):
        make_requests(Workload(2, (20, 30), (4, 4), kind="copy"), smollm2_tokenizer.vocab_size, smollm2_tokenizer)
    with pytest.raises(WorkloadError, match="shared prefix"):
        Workload(2, (90, 100), (4, 4), kind="copy", shared_prefix_len=8)
