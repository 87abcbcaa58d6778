"""Structured outputs with a reasoning parser: the constraint applies to the answer after
``</think>``, the reasoning is free.

At the Grammars level, scripted sequences of sampled tokens: each step's mask is every
token in the reasoning, a fresh xgrammar matcher's (fed the answer's tokens only) in the
answer, and that plus ``<think>`` where a qwen3 reply may open its reasoning; verify-step
masks walk the phases through the drafts and leave the sequence as it was. End to end, a
tiny model that reasons at random (tests/engine/thinking_model.py), many seeds: every
answer after ``</think>`` validates, the reasoning before it does not follow the schema,
greedy speculative decoding equals plain decoding, and a tokenizer without the tags is
refused at start-up.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import jsonschema
import numpy as np
import pytest

from ingot import LLM, SamplingParams, StructuredOutputsParams
from ingot.config import ConfigError
from ingot.engine import structured
from ingot.engine.reasoning import ACTIVE, OPENING, REASONING, reasoning_tags
from ingot.loading.tokenizer import Tokenizer
from tests.engine.thinking_model import write_thinking_checkpoint
from tests.helpers import write_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}},
          "required": ["pet", "age"], "additionalProperties": False}
SPEC = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
VOCAB = 384
EOS = 2


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_thinking_checkpoint(tmp_path_factory.mktemp("thinking") / "model")


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_hf_dir(path, eos_token_ids=[EOS])


# ------------------------------------------------------------------ Grammars, scripted


@dataclass
class FakeSeq:
    """What Grammars reads of a sequence."""

    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: Any = None
    num_pending: int = 0
    finished: bool = False


def admitted(grammars: structured.Grammars, prompt_ids: list[int], params: SamplingParams) -> FakeSeq:
    seq = FakeSeq(prompt_ids, params)
    grammars.hold("r", params.structured_outputs, SimpleNamespace(seqs=[seq]))
    deadline = time.monotonic() + 60
    while grammars.num_held and time.monotonic() < deadline:
        grammars.wait(1.0)
        assert grammars.admit(lambda s: None, lambda *a: pytest.fail(f"compile failed: {a}")) == []
    assert seq.grammar is not None
    return seq


def allowed(words: np.ndarray) -> set[int]:
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


class Reference:
    """A fresh xgrammar matcher of the same compiled grammar, fed the answer's tokens only."""

    def __init__(self, grammars: structured.Grammars) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(grammars._compile(SPEC.key).result())
        self.bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def allowed(self) -> set[int]:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return allowed(self.bitmask[0].numpy())


def make_grammars(tok: Tokenizer, parser: str) -> structured.Grammars:
    return structured.Grammars(tok, VOCAB, (EOS,), reasoning=reasoning_tags(parser, tok))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def scripts(tok: Tokenizer) -> list[tuple[str, str, str, list[int]]]:
    """(parser, prompt, the phase the reply starts in, the reply's tokens)."""
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    reasoning = ids(tok, "Hmm, the quick fox? {no")  # not JSON: the schema forbids its first token
    answer = ids(tok, json.dumps({"pet": "dog", "age": 42, "tags": ["bc"]})) + [EOS]
    return [
        ("deepseek_r1", "hello world", REASONING, reasoning + [end] + answer),
        ("deepseek_r1", "hello world", REASONING, [start] + reasoning + [end] + answer),  # R1 opening it itself
        ("deepseek_r1", "an earlier </think> is history", REASONING, reasoning + [end] + answer),
        ("qwen3", "hello world", OPENING, [start] + reasoning + [end] + answer),
        ("qwen3", "hello world", OPENING, answer),  # answering at once
        ("qwen3", "an earlier </think> is history", OPENING, answer),
        ("qwen3", "thinking-only template<think>\n", REASONING, reasoning + [end] + answer),
        ("qwen3", "thinking off<think>\n\n</think>\n\n", ACTIVE, answer),
        ("deepseek_r1", "thinking off<think>\n\n</think>\n\n", ACTIVE, answer),
    ]


@pytest.mark.parametrize("ahead", [False, True], ids=["loop", "ahead"])
@pytest.mark.parametrize("case", range(9))
def test_masks_follow_the_phases(tok, case, ahead):
    """Each step's mask against a reference written here: every token while reasoning, the
    reference matcher's tokens in the answer, those and <think> on a qwen3 reply's first.
    ``ahead``: what the ahead thread does, each token accepted in the batched call and the
    next step's row filled then (``fill_ahead``), which the mask takes."""
    parser, prompt, first, reply = scripts(tok)[case]
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    grammars = make_grammars(tok, parser)
    seq = admitted(grammars, ids(tok, prompt), SamplingParams(structured_outputs=SPEC))
    ref = Reference(grammars)
    phase = first
    assert seq.grammar.phase == first
    filled = None
    for token in reply:
        seq.num_pending = int(filled is not None)
        mask = grammars.token_mask([seq], (EOS,), (lambda: filled) if ahead else None, [0])
        assert filled is None or mask.bitmask is filled.bitmask
        assert mask.rows == [0]
        got = allowed(mask.bitmask[0].numpy())
        if phase == REASONING:
            assert got == set(range(VOCAB))
            phase = ACTIVE if token == end else REASONING
        else:
            want = ref.allowed() | ({start} if phase == OPENING else set())
            assert got == want and end not in got
            if phase == OPENING and token == start:
                phase = REASONING
            else:
                assert ref.matcher.accept_token(token)
                phase = ACTIVE
        structured.advance([seq], [token], None, batched=ahead)
        assert seq.grammar.error is None and seq.grammar.phase == phase
        if ahead:
            filled = grammars.fill_ahead([seq], (EOS,))
    assert seq.grammar.terminated and ref.matcher.is_terminated()


def test_the_batched_advance_takes_and_refuses_as_row_by_row(tok):
    """One xgrammar call for the rows the grammar decides, the others (opening or in their
    reasoning, finished, failed sampling, failed before) as row by row: the same phases,
    counts and refusals."""
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    brace, x = ids(tok, "{")[0], ids(tok, "x")[0]  # the schema opens with "{"
    prompts = ["thinking off<think>\n\n</think>\n\n"] * 2 + ["hello"] * 2 + ["thinking off<think>\n\n</think>\n\n"] * 4
    tokens = [brace, x, start, end, brace, brace, brace, brace]
    states = []
    for batched in (False, True):
        grammars = make_grammars(tok, "qwen3")
        seqs = [admitted(grammars, ids(tok, p), SamplingParams(structured_outputs=SPEC)) for p in prompts]
        structured.advance(seqs[3:4], [start], None)  # reasoning: its </think> ends it
        seqs[5].finished = True
        seqs[7].grammar.error = "failed before"
        structured.advance(seqs, tokens, [None] * 6 + ["sampling failed", None], batched=batched)
        states.append([(s.grammar.phase, s.grammar.num_accepted, s.grammar.num_matched, s.grammar.error) for s in seqs])
    assert states[0] == states[1]
    assert states[0][:2] == [(ACTIVE, 1, 1, None), (ACTIVE, 0, 0, f"structured outputs: token {x} is not allowed by the grammar")]
    assert [p for p, *_ in states[0]] == [ACTIVE, ACTIVE, REASONING, ACTIVE, ACTIVE, ACTIVE, ACTIVE, ACTIVE]
    assert [n for _, n, *_ in states[0]] == [1, 0, 1, 2, 1, 0, 0, 0]


def test_reasoning_holds_stop_tokens_below_min_tokens(tok):
    grammars = make_grammars(tok, "deepseek_r1")
    params = SamplingParams(min_tokens=3, stop_token_ids=[7], structured_outputs=SPEC)
    seq = admitted(grammars, ids(tok, "hello"), params)
    for step, token in enumerate(ids(tok, "Hmm, well then")[:5]):
        got = allowed(grammars.token_mask([seq], (EOS,), None, [0]).bitmask[0].numpy())
        assert got == (set(range(VOCAB)) - {EOS, 7} if step < 3 else set(range(VOCAB)))
        structured.advance([seq], [token], None)


def test_an_eos_in_the_reasoning_is_allowed(tok):
    """EOS while reasoning: allowed (the request then ends with no answer, as vLLM does)."""
    grammars = make_grammars(tok, "deepseek_r1")
    seq = admitted(grammars, ids(tok, "hello"), SamplingParams(structured_outputs=SPEC))
    assert EOS in allowed(grammars.token_mask([seq], (EOS,), None, [0]).bitmask[0].numpy())
    structured.advance([seq], [EOS], None)
    assert seq.grammar.error is None and not seq.grammar.terminated and seq.grammar.phase == REASONING


@pytest.mark.parametrize("opening", [False, True])
def test_draft_masks_walk_the_phases_and_leave_the_sequence_as_it_was(tok, opening):
    """A verify step's masks: position i is what is allowed after the drafts before it, the
    phase changing at a drafted <think> / </think>; afterwards the sequence is where it was."""
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    reasoning = ids(tok, "Hmm, so")
    answer = ids(tok, json.dumps({"pet": "cat", "age": 7}))
    grammars = make_grammars(tok, "qwen3")
    seq = admitted(grammars, ids(tok, "hello"), SamplingParams(structured_outputs=SPEC))
    if opening:  # a qwen3 reply's first step: the drafts open the reasoning
        drafts = [start, *reasoning[:2], end, *answer[:3]]
    else:  # already reasoning
        structured.advance([seq], [start], None)
        drafts = [*reasoning[:2], end, *answer[:3]]
    before = (seq.grammar.phase, seq.grammar.num_accepted)
    other = FakeSeq([1], SamplingParams())  # an unconstrained row between
    mask = grammars.token_mask([other, seq], (EOS,), None, [0, 1], drafts=[[5, 6], drafts])
    assert mask.rows == [3 + i for i in range(len(drafts) + 1)]  # after the other row's 3 positions
    ref = Reference(grammars)
    phase = OPENING if opening else REASONING
    for i, row in enumerate(mask.bitmask.numpy()):
        got = allowed(row)
        if phase == REASONING:
            assert got == set(range(VOCAB)), i
        else:
            assert got == ref.allowed() | ({start} if phase == OPENING else set()), i
        if i == len(drafts):
            break
        token = drafts[i]
        if phase == REASONING:
            phase = ACTIVE if token == end else REASONING
        elif phase == OPENING and token == start:
            phase = REASONING
        else:
            assert ref.matcher.accept_token(token)
    assert (seq.grammar.phase, seq.grammar.num_accepted) == before
    # the matcher was rolled back too: the tokens taken for real give the reference's masks
    for token in drafts[: len(drafts) - 3]:
        structured.advance([seq], [token], None)
    assert seq.grammar.phase == ACTIVE
    assert allowed(grammars.token_mask([seq], (EOS,), None, [0]).bitmask[0].numpy()) == Reference(grammars).allowed()


def test_a_tokenizer_without_the_tags_is_refused_at_start_up(tmp_path, tok):
    plain = write_tiny_checkpoint(tmp_path / "plain", "llama")
    for parser in ("qwen3", "deepseek_r1"):
        with pytest.raises(ConfigError, match=f"reasoning_parser '{parser}': the tokenizer has no single token '<think>'"):
            LLM(str(plain), dtype="float32", device="cpu", show_progress=False, reasoning_parser=parser)
    assert reasoning_tags("qwen3", tok).start == tok.convert_tokens_to_ids("<think>")


# ------------------------------------------------------------------ end to end


def split(tok: Tokenizer, token_ids: list[int]) -> tuple[list[int], list[int], bool]:
    """(reasoning, answer, closed): the tokens before and after the first </think>."""
    end = tok.convert_tokens_to_ids("</think>")
    if end not in token_ids:
        return list(token_ids), [], False
    k = token_ids.index(end)
    return list(token_ids[:k]), list(token_ids[k + 1:]), True


def sampled(n_seeds: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=s, n=4, max_tokens=160, structured_outputs=SPEC, **kw)
            for s in range(n_seeds)]


def check_answers(tok: Tokenizer, outs, first_token_free: bool) -> dict[str, int]:
    """Every answer after </think> validates; counts of what happened."""
    start = tok.convert_tokens_to_ids("<think>")
    seen = {"closed": 0, "ended_reasoning": 0, "direct": 0, "free": 0}
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length")
            if c.token_ids[0] != start and first_token_free is False:  # answered at once (qwen3)
                seen["direct"] += 1
                assert c.finish_reason == "stop"
                jsonschema.validate(json.loads(tok.decode(c.token_ids, skip_special_tokens=True)), SCHEMA)
                continue
            reasoning, answer, closed = split(tok, c.token_ids)
            if not closed:  # ended (EOS) or cut off inside the reasoning: no answer
                seen["ended_reasoning"] += c.finish_reason == "stop"
                continue
            seen["closed"] += 1
            text = tok.decode(reasoning, skip_special_tokens=True).removeprefix("<think>")
            seen["free"] += bool(text) and not text.startswith("{")  # the schema's first token is "{"
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(tok.decode(answer, skip_special_tokens=True)), SCHEMA)
    return seen


@pytest.fixture(scope="module", params=["overlap", "ahead", "serial"])
def deepseek(path, request):
    """``ahead``: a step's grammar work in the ahead thread, as on CUDA."""
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False, reasoning_parser="deepseek_r1",
             overlap_scheduling=request.param != "serial") as llm:
        llm.engine.grammars.ahead = request.param == "ahead"
        yield llm


@pytest.fixture(scope="module")
def qwen3(path):
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False, reasoning_parser="qwen3") as llm:
        yield llm


def test_deepseek_r1_reasons_freely_and_answers_to_the_schema(deepseek, tok):
    outs = deepseek.generate(["hello world", "The quick brown fox"] * 5, sampled(10), use_tqdm=False)
    seen = check_answers(tok, outs, first_token_free=True)
    assert seen["closed"] >= 20 and seen["free"] >= 15 and seen["ended_reasoning"] >= 1, seen


def test_qwen3_opens_its_reasoning_or_answers_at_once(qwen3, tok):
    outs = qwen3.generate(["hello world"] * 10, sampled(10), use_tqdm=False)
    seen = check_answers(tok, outs, first_token_free=False)
    assert seen["closed"] >= 10 and seen["direct"] >= 3 and seen["free"] >= 5, seen


def test_chat_with_thinking_off_is_constrained_from_the_first_token(qwen3, tok):
    """LLM.chat with chat_template_kwargs {"enable_thinking": false}: the prompt closes the
    reasoning, so the whole reply validates; with thinking on a reply may reason first."""
    messages = [{"role": "user", "content": "hello world"}]
    off = qwen3.chat([messages] * 6, sampled(6), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    start = tok.convert_tokens_to_ids("<think>")
    for o in off:
        assert tok.decode(o.prompt_token_ids).endswith("</think>\n\n")
        for c in o.outputs:
            assert c.finish_reason == "stop" and start not in c.token_ids
            jsonschema.validate(json.loads(c.text), SCHEMA)
    on = qwen3.chat([messages] * 6, sampled(6), use_tqdm=False)
    assert any(c.token_ids[0] == start for o in on for c in o.outputs)
    check_answers(tok, on, first_token_free=False)


def test_min_tokens_holds_eos_in_the_reasoning(deepseek, tok):
    outs = deepseek.generate(["hello world"] * 8, sampled(8, min_tokens=40), use_tqdm=False)
    for o in outs:
        for c in o.outputs:
            _, _, closed = split(tok, c.token_ids)
            if not closed and c.finish_reason == "stop":
                assert len(c.token_ids) > 40 and c.token_ids[-1] == EOS
    check_answers(tok, outs, first_token_free=True)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_speculative_decoding_equals_plain_through_the_reasoning(path, tok, parser):
    """n-gram drafts across </think>: greedy output equals plain greedy decoding token for
    token; sampled outputs still answer to the schema."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # JSON in the prompt for the lookups to draft from, tags too
    prompts = ['hello {"pet": "dog", "age": 42} world <think> hello', '{"pet": "cat", "age": 1}{"pet": "cat", "age": 1} hi',
               "The quick </think> brown fox jumps"]
    greedy = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=SPEC)
    runs = {}
    for speculative in (None, spec):
        with LLM(str(path), dtype="float32", device="cpu", show_progress=False, reasoning_parser=parser,
                 speculative_config=speculative) as llm:
            llm.engine.grammars.ahead = speculative is not None  # steps left in flight between verify steps
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            runs[speculative is None] = [(c.token_ids, c.finish_reason) for o in outs for c in o.outputs]
            if speculative is not None:
                assert sum(o.metrics.spec_num_accepted_tokens for o in outs) > 0
                check_answers(tok, llm.generate(prompts * 2, sampled(6), use_tqdm=False),
                              first_token_free=parser == "deepseek_r1")
    assert runs[False] == runs[True]
    assert any(split(tok, ids_)[2] for ids_, _ in runs[True]), "a greedy reply closed its reasoning"
