"""The server soak: many concurrent clients of mixed lengths, a fifth of them leaving at
random points, streamed and not, some constrained (structured outputs: a choice, a regex, a
JSON schema, as vLLM's ``structured_outputs`` and OpenAI's ``response_format``); shared by the
CPU test and the GPU one."""

from __future__ import annotations

import json
import random
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import httpx
import jsonschema

from ingot.sampling_params import StructuredOutputsParams

WORDS = "the sea river mountain code python garden music history science light".split()

_SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["river", "sea"]}, "depth": {"type": "integer", "minimum": 0,
           "maximum": 99}}, "required": ["kind", "depth"], "additionalProperties": False}
_ENUM = {"enum": ["river", "sea", "mountain"]}  # a JSON string: no room for free whitespace
_REGEX = r"[0-9]{3}-[a-z]{2}"
_CHOICES = ["yes", "no", "maybe"]
# name -> (the request's fields, StructuredOutputsParams' fields for the offline reference)
CONSTRAINTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "choice": ({"structured_outputs": {"choice": _CHOICES}}, {"choice": _CHOICES}),
    "regex": ({"guided_regex": _REGEX}, {"regex": _REGEX}),
    "json": ({"structured_outputs": {"json": _SCHEMA, "disable_any_whitespace": True}},
             {"json": _SCHEMA, "disable_any_whitespace": True}),
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": _ENUM}}},
                        {"json": _ENUM}),
}
CONSTRAINED_MAX_TOKENS = 48  # room for the longest constrained answer


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    stream: bool
    leave: bool  # the client goes away before the answer is complete
    after: int  # ... after this many stream lines (or 0.05 s per unit when not streaming)
    constraint: Optional[str] = None  # a key of CONSTRAINTS

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The constraint as the offline engine takes it."""
        return None if self.constraint is None else StructuredOutputsParams(**CONSTRAINTS[self.constraint][1])


@dataclass
class Answer:
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # with logprobs: the completion's tokens
    top: list[dict[str, float]] = field(default_factory=list)  # and each one's top logprobs
    finish_reason: Optional[str] = None


def make_jobs(count: int, seed: int = 11, constrained: float = 0.0) -> list[Job]:
    """``count`` jobs; with probability ``constrained`` each also follows one of CONSTRAINTS
    (and may write up to CONSTRAINED_MAX_TOKENS tokens, so that most finish their answer)."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        job = Job(prompt, rng.randint(2, 24), rng.random() < 0.5, rng.random() < 0.2, rng.randint(1, 6))
        if constrained and rng.random() < constrained:
            job = Job(job.prompt, CONSTRAINED_MAX_TOKENS, job.stream, job.leave, job.after, rng.choice(sorted(CONSTRAINTS)))
        jobs.append(job)
    return jobs


def valid(job: Job, text: str) -> bool:
    """Does a finished answer follow its job's constraint?"""
    kind = job.constraint
    if kind == "choice":
        return text in _CHOICES
    if kind == "regex":
        return re.fullmatch(_REGEX, text) is not None
    try:
        jsonschema.validate(json.loads(text), _ENUM if kind == "response_format" else _SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _add(answer: Answer, choice: dict) -> None:
    answer.text += choice["text"]
    answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
    lp = choice.get("logprobs")
    if lp:
        answer.tokens += lp["tokens"]
        answer.top += lp["top_logprobs"]


def run_clients(url_v1: str, key: str, model: str, jobs: list[Job], logprobs: Optional[int] = None,
                timeout: float = 600.0) -> list[Union[Answer, str, Exception]]:
    """One thread per job, all at once; each result is an Answer, "left", or the exception."""
    results: list = [None] * len(jobs)
    headers = {"Authorization": f"Bearer {key}"}

    def run(i: int) -> None:
        job = jobs[i]
        body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0, "stream": job.stream}
        if job.constraint is not None:
            body.update(CONSTRAINTS[job.constraint][0])
        if logprobs is not None:
            body["logprobs"] = logprobs
        try:
            with httpx.Client(timeout=timeout) as http:
                if job.stream:
                    answer = Answer()
                    with http.stream("POST", url_v1 + "/completions", json=body, headers=headers) as r:
                        for n, line in enumerate(r.iter_lines()):
                            if job.leave and n >= job.after:
                                results[i] = "left"
                                return
                            if line.startswith("data: {"):
                                for choice in json.loads(line[6:])["choices"]:
                                    _add(answer, choice)
                    results[i] = answer
                elif job.leave:
                    try:
                        http.post(url_v1 + "/completions", json=body, headers=headers, timeout=0.05 * job.after)
                    except httpx.TimeoutException:
                        pass
                    results[i] = "left"
                else:
                    answer = Answer()
                    _add(answer, http.post(url_v1 + "/completions", json=body, headers=headers).json()["choices"][0])
                    results[i] = answer
        except Exception as exc:  # surfaced by the caller's comparison
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


def close_to(answer: Answer, expected_tokens: list[str], expected_top: list[dict[str, float]]) -> Optional[str]:
    """None if ``answer`` is greedy decoding's answer up to floating-point ties: equal tokens
    until the first difference, where each side's token is among the other's top logprobs
    (the two then continue from different texts, so the rest is not compared). Otherwise
    what is wrong."""
    for pos, (got, want) in enumerate(zip(answer.tokens, expected_tokens)):
        if got == want:
            continue
        if got in expected_top[pos] and want in answer.top[pos]:
            return None
        return f"token {pos}: {got!r} (top {answer.top[pos]}) against {want!r} (top {expected_top[pos]})"
    if len(answer.tokens) != len(expected_tokens):
        return f"{len(answer.tokens)} tokens against {len(expected_tokens)}"
    return None
