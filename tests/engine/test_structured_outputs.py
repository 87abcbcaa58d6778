"""Structured outputs on a tiny random checkpoint: every constraint kind, sampling modes,
overlap scheduling on and off (and with the ahead thread CUDA engines use: a step's
matchers advanced and the next step's rows filled off the engine loop), preemption, prefix
caching, the compile cache, errors.

A random model has no idea of JSON: what it writes is the grammar's doing alone. Schemas
here are bounded (enums, ranges, patterns, maxItems, no free whitespace) so that every
output completes within max_tokens. (No maxLength: xgrammar lets such strings hold raw
control characters, which a random model writes and strict JSON refuses.)
"""

from __future__ import annotations

import json
import math
import re
import threading

import jsonschema
import pytest

from ingot import LLM, RequestError, SamplingParams, StructuredOutputsParams
from ingot.engine import structured
from ingot.sampling_params import SamplingError
from tests.helpers import write_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9_]{0,3}$"}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object", "properties": {"floor": {"type": "integer", "minimum": -2, "maximum": 9},
                                                  "city": {"enum": ["Oslo", "Lima"]}},
                 "required": ["city"]},
    },
    "required": ["name", "age", "tags", "home"],
}
PROMPTS = ["hello world", "The quick brown fox", "def f(x): return"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("so") / "llama", "llama"))


def make_llm(path: str, ahead: bool = False, **kw) -> LLM:
    """``ahead``: the grammar work of a step in flight in the ahead thread (a CUDA engine's way)."""
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **{"max_num_seqs": 16, **kw})
    llm.engine.grammars.ahead = ahead
    return llm


@pytest.fixture(scope="module", params=["overlap", "ahead", "serial"])
def llm(request, path):
    llm = make_llm(path, ahead=request.param == "ahead", overlap_scheduling=request.param != "serial")
    yield llm
    llm.shutdown()


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_params_need_exactly_one_constraint():
    with pytest.raises(SamplingError, match="exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"):
        StructuredOutputsParams()
    with pytest.raises(SamplingError, match="got regex and choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(SamplingError, match="whitespace_pattern"):
        StructuredOutputsParams(json={}, whitespace_pattern=r"\s*")
    with pytest.raises(SamplingError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(SamplingError, match="json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)).key == StructuredOutputsParams(json=SCHEMA).key
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.regex == "a+"
    with pytest.raises(SamplingError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regexp": "a+"})


def test_json_schema_over_seeds(llm):
    """Random sampling (top-k / top-p / penalties on some), many seeds, n > 1 (more than 16
    rows: xgrammar's batch fill): every output validates."""
    spec = so(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, seed=s, n=4, max_tokens=120, structured_outputs=spec) for s in range(4)]
    params += [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                              seed=10, max_tokens=120, structured_outputs=spec),
               SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec)]
    outs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(set(texts(outs))) > 4  # the seeds differ


def test_regex_choice_grammar(llm):
    regex = r"(ab|cd){1,3}-[0-9]{2}"
    ebnf = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9] | [1-9] [0-9]'
    choices = ["yes", "no", 'a "quoted"\\ one', "ünï"]
    kinds = [(so(regex=regex), lambda t: re.fullmatch(regex, t)),
             (so(choice=choices), lambda t: t in choices),
             (so(grammar=ebnf), lambda t: re.fullmatch(r"\((\d{1,2}\+)*\d{1,2}\)", t))]
    for spec, ok in kinds:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=spec) for s in range(5)]
        params.append(SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec))
        for o in llm.generate(PROMPTS[:1] * len(params), params):
            c = o.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (spec, c.text)


def test_structural_tag(llm):
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<fn>", "end": "</fn>",
        "content": {"type": "json_schema", "json_schema": {"enum": [{"x": 1}, {"x": 2}, [3]]}}}}
    legacy = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {"enum": ["u", "v"]}, "end": "</a>"}],
              "triggers": ["<a>"]}
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                                     structured_outputs=so(structural_tag=json.dumps(tag))),
                                      SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so(structural_tag=tag))])
    for o in outs:
        m = re.fullmatch(r"<fn>(.*)</fn>", o.outputs[0].text, re.S)
        assert m and json.loads(m.group(1)) in ({"x": 1}, {"x": 2}, [3]), o.outputs[0].text
    # the legacy form: free text, where every "<a>" opens a tag whose content follows the schema
    text = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=0, max_tokens=30,
                                                   structured_outputs=so(structural_tag=legacy)))[0].outputs[0].text
    for m in re.finditer("<a>", text):
        rest = text[m.end():]
        assert any(w.startswith(rest) or rest.startswith(w) for w in ('"u"</a>', '"v"</a>')), text


def test_seeded_reproducible_and_logprobs_of_the_masked_distribution(llm):
    spec = so(choice=["yes", "no", "maybe"])
    p = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8, logprobs=5, structured_outputs=spec)
    a, b = llm.generate(PROMPTS[1], p)[0], llm.generate(PROMPTS[1], p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    for c in a.outputs:
        assert c.text in ("yes", "no", "maybe")
        first = c.logprobs[0]  # the grammar allows a few first tokens only: their probabilities add up to 1
        finite = [lp.logprob for lp in first.values() if math.isfinite(lp.logprob)]
        assert 0 < len(finite) < 5 and math.isclose(sum(math.exp(x) for x in finite), 1.0, rel_tol=1e-4)
        assert c.logprobs[-1][c.token_ids[-1]].logprob == pytest.approx(0.0, abs=1e-5)  # EOS: the only choice


def test_stop_rules_still_apply(llm):
    spec = so(regex=r"(ab){4}c")
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, stop=["ba"], structured_outputs=spec))[0]
    assert cut.outputs[0].text == "a" and cut.outputs[0].stop_reason == "ba"  # "aba" cut before the stop string
    short = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=spec))[0].outputs[0]
    assert short.finish_reason == "length" and "ababababc".startswith(short.text)
    # min_tokens keeps EOS out while the grammar can go on; a complete output may only end
    long = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12,
                                                    structured_outputs=so(regex="a+")))[0].outputs[0]
    assert len(long.token_ids) > 12 and set(long.text) == {"a"}
    done = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, ignore_eos=True,
                                                    structured_outputs=so(choice=["yes"])))[0].outputs[0]
    assert done.text == "yes" and done.finish_reason == "stop"  # ignore_eos: the grammar ends it


def test_unconstrained_rows_unchanged_by_a_constrained_neighbour(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    spec = so(json=SCHEMA, disable_any_whitespace=True)
    mixed = llm.generate(PROMPTS + ["Hello tokens"], [plain] * 3 + [SamplingParams(temperature=0.0, max_tokens=120,
                                                                                    structured_outputs=spec)])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[3].outputs[0].text), SCHEMA)


@pytest.mark.parametrize("ahead", [False, True], ids=["loop", "ahead"])
def test_preemption_and_prefix_caching(path, ahead):
    """A KV pool too small for the batch preempts sequences (recomputed, the matchers not
    advanced again); a prompt seen before is served from the prefix cache. Greedy outputs
    equal those of a roomy engine."""
    spec = so(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec),
              SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=120, structured_outputs=spec)]
    prompts = [PROMPTS[1] * 3, PROMPTS[2] * 3]
    roomy = make_llm(path, block_size=4)
    want = roomy.generate(prompts * 2, params * 2)
    tight = make_llm(path, ahead, block_size=4, num_kv_blocks=40, max_num_seqs=8)
    got = tight.generate(prompts * 2, params * 2)
    assert tight.engine.stats().num_preemptions > 0
    assert texts(got) == texts(want)
    for t in texts(got):
        jsonschema.validate(json.loads(t), SCHEMA)
    again = roomy.generate(prompts[:1], params[:1])[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].text == want[0].outputs[0].text
    roomy.shutdown()
    tight.shutdown()


def test_a_repeated_grammar_is_compiled_once(path):
    llm = make_llm(path)
    grammars = llm.engine.grammars
    base = grammars.compiles
    spec_a, spec_b = so(json=SCHEMA), so(json=json.dumps(SCHEMA))  # equal schemas, dict and text
    llm.generate(PROMPTS, [SamplingParams(max_tokens=4, structured_outputs=s) for s in (spec_a, spec_b, spec_a)])
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_outputs=spec_b))
    assert grammars.compiles == base + 1
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)))
    assert grammars.compiles == base + 2
    llm.shutdown()


@pytest.mark.parametrize("spec, problem", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), 'Unsupported type "strin"'),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (dict(regex="(ab"), "parenthesis is not closed"),
    (dict(grammar='root ::= foo'), 'Rule "foo" is not defined'),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "not recognized"),
])
def test_what_xgrammar_rejects_is_a_request_error(llm, spec, problem):
    kind = next(iter(spec))
    with pytest.raises(RequestError, match=f"structured_outputs.{kind}: xgrammar cannot compile it: .*{re.escape(problem)}"):
        llm.engine.add_request("hi", SamplingParams(structured_outputs=so(**spec)))
    out = llm.generate("hi", SamplingParams(structured_outputs=so(**spec)))[0]  # LLM: the request's error output
    assert out.outputs[0].finish_reason == "error" and problem in out.error


def test_a_vocabulary_dependent_failure_fails_its_request_alone(llm):
    """A structural tag naming a token the vocabulary lacks passes the caller's check (made
    without the vocabulary) and fails at compilation: an error output, the others go on."""
    tag = {"type": "structural_tag", "format": {"type": "token", "token": "<|no such token|>"}}
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=5, structured_outputs=so(structural_tag=tag)),
                                      SamplingParams(max_tokens=5, ignore_eos=True)])
    assert outs[0].outputs[0].finish_reason == "error" and "xgrammar cannot compile" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 5


@pytest.mark.parametrize("ahead", [False, True], ids=["loop", "ahead"])
@pytest.mark.parametrize("samples", [1, 20], ids=["row-by-row", "batch-fill"])
def test_a_failing_matcher_fails_its_request_alone(path, samples, ahead):
    """Whether the rows are filled one by one or (many rows) in xgrammar's batch fill, in
    the engine loop or the ahead thread."""
    llm = make_llm(path, ahead, max_num_seqs=32)
    eng = llm.engine
    spec = so(regex="[a-z]{30}")
    bad = eng.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec), "bad")
    eng.add_request(PROMPTS[1], SamplingParams(temperature=1.0, seed=3, n=samples, max_tokens=40, structured_outputs=spec), "good")
    good = eng.requests["good"].seqs
    plain = eng.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), "plain")
    while eng.has_unfinished():
        if bad.grammar is not None and not hasattr(bad.grammar.matcher, "broken"):
            bad.grammar.matcher = _Broken(bad.grammar.matcher)
        eng.step()
    assert bad.finish_reason == "error" and "grammar matcher failed: matcher exploded" in bad.error
    assert all(s.finish_reason == "stop" and re.fullmatch("[a-z]{30}", s.text) for s in good)
    assert plain.finish_reason == "length" and len(plain.output_token_ids) == 20
    llm.shutdown()


class _Broken:
    """A matcher whose third token fails."""

    broken = True

    def __init__(self, matcher) -> None:
        self.matcher, self.seen = matcher, 0

    def accept_token(self, token: int) -> bool:
        self.seen += 1
        if self.seen == 3:
            raise RuntimeError("matcher exploded")
        return self.matcher.accept_token(token)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def test_compilation_does_not_block_the_loop(path, monkeypatch):
    """A request whose grammar is still compiling waits outside the scheduler; the others decode."""
    llm = make_llm(path)
    eng = llm.engine
    release = threading.Event()
    compile_now = structured.Grammars._compile_now

    def slow(self, key):
        release.wait(30)
        return compile_now(self, key)

    monkeypatch.setattr(structured.Grammars, "_compile_now", slow)
    held = eng.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=so(regex="x+y")), "held")
    gone = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=6, structured_outputs=so(regex="z+")), "gone")
    plain = eng.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), "plain")
    while not plain.finished:
        eng.step()
    assert eng.grammars.num_held == 2 and eng.stats().num_waiting == 2 and not held.output_token_ids
    assert eng.abort("gone").finished and gone.finish_reason == "abort" and eng.grammars.num_held == 1
    release.set()
    while eng.has_unfinished():
        eng.step()
    assert re.fullmatch("x+y", held.text) or (held.finish_reason == "length" and set(held.text) == {"x"})
    llm.shutdown()


def test_overlap_keeps_the_next_forward_queued_and_equals_serial(path, monkeypatch):
    """With overlap scheduling a step with grammar rows is queued (its forward) before the
    step in flight is read back; the mask waits for that read-back, not the forward.
    Outputs equal the serial engine's, penalties (which wait before scheduling) included."""
    from ingot.runner import model_runner

    events: list[str] = []
    run_model, collect, token_mask = model_runner.ModelRunner.run_model, model_runner.LaunchedStep.collect, structured.Grammars.token_mask
    monkeypatch.setattr(model_runner.ModelRunner, "run_model", lambda self, *a: events.append("forward") or run_model(self, *a))
    monkeypatch.setattr(model_runner.LaunchedStep, "collect", lambda self: events.append("collect") or collect(self))

    def mask(self, *a):
        out = token_mask(self, *a)
        events.append("mask")
        return out

    monkeypatch.setattr(structured.Grammars, "token_mask", mask)
    spec = so(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec),
              SamplingParams(temperature=0.9, seed=1, n=2, max_tokens=120, structured_outputs=so(regex="[a-z]{5,40}")),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2, structured_outputs=so(choice=["yes", "no"]))]
    results = {}
    for overlap in (True, False):
        events.clear()
        llm = make_llm(path, overlap_scheduling=overlap)
        results[overlap] = [(c.token_ids, c.finish_reason) for o in llm.generate(PROMPTS + PROMPTS[:1], params) for c in o.outputs]
        llm.shutdown()
        early = sum(events[i : i + 3] == ["forward", "collect", "mask"] for i in range(len(events)))
        assert (early > 10) if overlap else (early == 0), events[:40]
    assert results[True] == results[False]


def test_the_ahead_thread_advances_the_matchers_and_fills_the_next_masks(path, monkeypatch):
    """With the ahead thread, each step left in flight is read back, its matchers advanced and
    the next step's rows filled off the engine loop; the next mask takes those rows (whole
    in a decode step of the same rows). Outputs equal the serial engine's: penalties and
    min_tokens (read back before scheduling), a sequence that stops while its next step
    is in flight, sampled and greedy rows, an unconstrained neighbour."""
    from ingot.engine import engine as engine_module

    threads: dict[str, set] = {"advance": set(), "fill_ahead": set()}
    whole = []
    advance, fill_ahead, rows = engine_module.advance, structured.Grammars.fill_ahead, structured.Grammars._rows

    def record(name, fn):
        return lambda *a, **kw: threads[name].add(threading.current_thread().name) or fn(*a, **kw)

    def taken(self, seqs, filled, stop_ids):
        out = rows(self, seqs, filled, stop_ids)
        whole.append(filled is not None and out is filled.bitmask)
        return out

    monkeypatch.setattr(engine_module, "advance", record("advance", advance))
    monkeypatch.setattr(structured.Grammars, "fill_ahead", record("fill_ahead", fill_ahead))
    monkeypatch.setattr(structured.Grammars, "_rows", taken)
    spec = so(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec),
              SamplingParams(temperature=0.9, seed=1, n=2, max_tokens=120, structured_outputs=so(regex="[a-z]{5,40}")),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2, structured_outputs=so(choice=["yes", "no"])),
              SamplingParams(temperature=0.8, seed=4, max_tokens=60, min_tokens=20, structured_outputs=so(regex="[a-z]{1,50}"))]
    results = {}
    for ahead in (True, False):
        llm = make_llm(path, ahead, overlap_scheduling=ahead)
        results[ahead] = [(c.token_ids, c.finish_reason) for o in llm.generate(PROMPTS + PROMPTS[:2], params) for c in o.outputs]
        llm.shutdown()
        if ahead:
            assert threads == {"advance": {"ingot-grammar-ahead_0"}, "fill_ahead": {"ingot-grammar-ahead_0"}}, threads
            assert sum(whole) > 20, whole
    assert results[True] == results[False]


def test_an_abort_while_the_ahead_thread_holds_its_rows(path):
    """A request aborted while the ahead thread advances its step leaves the others' greedy
    outputs as a run without it makes them."""
    llm = make_llm(path, ahead=True)
    eng = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so(json=SCHEMA, disable_any_whitespace=True))
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)]
    seqs = [eng.add_request(prompt, p, f"r{i}") for i, prompt in enumerate(PROMPTS)]
    gone = eng.add_request(PROMPTS[0] + " again", p, "gone")
    for _ in range(6):
        eng.step()
    assert eng._inflight is not None and eng._inflight.ahead is not None
    eng.abort("gone")
    while eng.has_unfinished():
        eng.step()
    assert gone.finish_reason == "abort" and [s.output_token_ids for s in seqs] == want
    llm.shutdown()


@pytest.mark.parametrize("vocab", [64, 100, 383])
def test_the_sampler_mask_equals_xgrammars(vocab):
    """The sampler's unpacking of the bitmask agrees with xgrammar's own kernel, for some
    rows of a batch and a vocabulary that is no multiple of 32."""
    import torch
    import xgrammar as xgr

    from ingot.runner.sampler import TokenMask, apply_token_mask

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = [0, 2, 3]
    got = logits.clone()
    apply_token_mask(got, TokenMask(rows, bitmask))
    want = logits.clone()
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab)
    assert torch.equal(got, want)
    assert torch.isinf(got[rows]).any() and torch.equal(got[[1, 4]], logits[[1, 4]])


def test_many_rows_fill_in_one_batch_call(path, monkeypatch):
    """From BATCH_FILL_ROWS constrained rows on, one threaded xgrammar call fills them."""
    alone = []
    fill = structured.SequenceGrammar.fill
    monkeypatch.setattr(structured.SequenceGrammar, "fill", lambda self, *a: alone.append(1) or fill(self, *a))
    llm = make_llm(path, max_num_seqs=32)
    n = structured.BATCH_FILL_ROWS + 4
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=2, n=n, max_tokens=20, ignore_eos=True,
                                                  structured_outputs=so(regex="[a-z]{20,}")))[0]
    assert all(re.fullmatch("[a-z]{20,}", c.text) for c in out.outputs)
    assert len(alone) < n * 20 / 4  # the first sample's prefill and the last rows, one by one; the rest batched
    llm.shutdown()


def test_xgrammar_is_imported_only_by_a_structured_request(path):
    """Engine start-up and unconstrained requests never import xgrammar (nor transformers)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ingot import LLM, SamplingParams\n"
        f"llm = LLM({path!r}, dtype='float32', device='cpu', show_progress=False)\n"
        "llm.generate('hi', SamplingParams(max_tokens=3))\n"
        "assert 'xgrammar' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
