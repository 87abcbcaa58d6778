"""LLM: the Python API (vLLM-style) — generate(), chat(), stream()."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Sequence as Seq, Union

from tqdm.auto import tqdm

from ingot.config import EngineConfig
from ingot.engine.engine import Engine, Prompt, RequestError
from ingot.engine.sequence import Sequence
from ingot.loading.tokenizer import Message, Tokenizer
from ingot.outputs import CompletionOutput, RequestOutput
from ingot.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompts = Union[str, Seq[int], Seq[str], Seq[Seq[int]]]
Params = Union[SamplingParams, Seq[SamplingParams], None]


class LLM:
    """Load a model once; run many requests through continuous batching.

    ``model`` is an HF directory, a .gguf file, a hub id, or None for the
    default SmolLM2-135M-Instruct. ``engine_args`` are EngineConfig fields.
    """

    def __init__(self, model: Optional[str] = None, dtype: str = "auto", device: str = "auto", **engine_args: Any) -> None:
        explicit = dict(engine_args)
        if model is not None:
            explicit["model"] = model
        if dtype != "auto":
            explicit["dtype"] = dtype
        if device != "auto":
            explicit["device"] = device
        self.config = EngineConfig.create(**explicit)
        self.engine = Engine.from_config(self.config)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts: Prompts, sampling_params: Params = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; a bad prompt gets ``error`` set while the rest complete."""
        items = _as_prompt_list(prompts)
        return self._run([(p, False) for p in items], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Union[Seq[Message], Seq[Seq[Message]]],
        sampling_params: Params = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them, rendered by the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items: list[tuple[Prompt, bool]] = []
        for conv in convs:
            try:
                items.append((self.engine.tokenizer.apply_chat_template(conv), True))
            except ValueError as exc:
                items.append((_Invalid(str(exc)), True))
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items: list[tuple[Any, bool]], sampling_params: Params, use_tqdm: bool) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(items))
        outputs: list[Optional[RequestOutput]] = [None] * len(items)
        seqs: dict[str, tuple[int, Sequence]] = {}
        for i, ((prompt, chat), p) in enumerate(zip(items, params)):
            try:
                if isinstance(prompt, _Invalid):
                    raise RequestError(prompt.message)
                seq = self.engine.add_request(prompt, p, chat=chat, stream=False)
                seqs[seq.request_id] = (i, seq)
            except (RequestError, ValueError) as exc:
                log.warning("request %d rejected: %s", i, exc)
                outputs[i] = _error_output(str(i), prompt, str(exc))
        bar = tqdm(total=len(seqs), desc="Generating", unit=" req", disable=not (use_tqdm and self.config.show_progress and seqs))
        try:
            while self.engine.has_unfinished():
                for seq in self.engine.step():
                    if seq.finished:
                        bar.update(1)
        finally:
            bar.close()
        for rid, (i, seq) in seqs.items():
            outputs[i] = to_request_output(seq)
            self.engine.requests.pop(rid, None)
        return [o for o in outputs if o is not None]

    # ------------------------------------------------------------------ streaming
    def stream(self, prompt: Union[Prompt, Seq[Message]], sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput after each new token; ``delta`` holds the new text."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            seq = self.engine.add_request(self.engine.tokenizer.apply_chat_template(prompt), sampling_params, chat=True)
        else:
            seq = self.engine.add_request(prompt, sampling_params)  # type: ignore[arg-type]
        try:
            while not seq.finished:
                if seq in self.engine.step():
                    yield to_request_output(seq)
        finally:
            if not seq.finished:
                self.engine.abort(seq.request_id)
            self.engine.requests.pop(seq.request_id, None)


class _Invalid:
    def __init__(self, message: str) -> None:
        self.message = message


def _as_prompt_list(prompts: Prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one tokenized prompt
    return items


def _as_params_list(params: Params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def to_request_output(seq: Sequence) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=seq.text,
        token_ids=list(seq.output_token_ids),
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
    )
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion],
        finished=seq.finished,
        delta=seq.delta,
    )


def _error_output(request_id: str, prompt: Any, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return RequestOutput(
        request_id=request_id,
        prompt=text,
        prompt_token_ids=ids,
        outputs=[CompletionOutput(0, "", [], finish_reason="error")],
        finished=True,
        error=message,
    )
