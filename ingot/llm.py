"""LLM: the offline Python API (vLLM's names and shapes): generate(), chat(), stream().

An ``LLM`` is a client of one engine loop (``engine/engine_loop.py``): its
calls tokenize and validate in the caller's thread, submit, and wait for their
own requests' outputs. Any number of threads may call one ``LLM`` at once, and
streams may be interleaved or left open: each request's outputs reach only its
caller. A call that is interrupted (Ctrl-C) or a stream that is closed or
garbage-collected aborts its requests, which frees their KV blocks before the
engine's next step.
"""

from __future__ import annotations

import itertools
import logging
import queue
import weakref
from typing import Any, Iterator, Mapping, Optional, Sequence as Seq, Union

from tqdm.auto import tqdm

from ingot.config import ConfigError, EngineConfig
from ingot.engine.engine import Engine
from ingot.engine.engine_loop import EngineLoop
from ingot.engine.outputs import Accumulator, failed_output
from ingot.engine.request import EngineRequest, Prompt, RequestError
from ingot.loading.tokenizer import Message, Tokenizer
from ingot.outputs import RequestOutput
from ingot.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompts = Union[Prompt, Seq[Prompt]]
Params = Union[SamplingParams, Seq[SamplingParams], None]
Conversation = Seq[Message]

# vLLM engine arguments ingot knows the meaning of but does not support
_UNSUPPORTED = {
    "enable_lora": "LoRA adapters are not supported",
    "max_loras": "LoRA adapters are not supported",
    "max_lora_rank": "LoRA adapters are not supported",
    "pipeline_parallel_size": "pipeline parallelism is not supported",
}
# how long an interrupted call waits for the engine to confirm its aborts
_ABORT_WAIT_S = 30.0


class LLM:
    """Load a model once; run many requests through continuous batching.

    ``model`` is an HF directory, a .gguf file, a hub id, or None for the
    default SmolLM2-135M-Instruct. ``engine_args`` are EngineConfig fields;
    vLLM's ``enforce_eager`` is accepted for ``eager_mode``.
    """

    def __init__(
        self,
        model: Optional[str] = None,
        dtype: str = "auto",
        device: str = "auto",
        *,
        enforce_eager: Optional[bool] = None,
        trust_remote_code: bool = False,
        **engine_args: Any,
    ) -> None:
        for name, why in _UNSUPPORTED.items():
            if engine_args.get(name):
                raise ConfigError(f"{name}: {why} by ingot")
            engine_args.pop(name, None)
        explicit = dict(engine_args)
        if model is not None:
            explicit["model"] = model
        if dtype != "auto":
            explicit["dtype"] = dtype
        if device != "auto":
            explicit["device"] = device
        if enforce_eager is not None:
            explicit["eager_mode"] = bool(enforce_eager)
        # trust_remote_code only permits custom code; ingot runs none, and a model that needs
        # it fails as an unsupported architecture with its name
        self.config = EngineConfig.create(**explicit)
        self.engine = Engine(self.config)
        self._loop = EngineLoop(self.engine)
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, self._loop.shutdown)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer, with the HF methods vLLM users call (encode, decode,
        __call__, apply_chat_template, eos_token_id, convert_ids_to_tokens)."""
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every block in the prefix cache (vLLM's call), so later requests hit none
        of the KV computed so far; False, and nothing changes, while requests are in flight.
        Runs in the engine loop's thread, between two steps."""
        return self._loop.call(Engine.reset_prefix_cache)

    def shutdown(self) -> None:
        """Stop the engine loop (aborting whatever still runs) and release the model, its KV cache
        and graphs (device memory for a next engine); also done when the LLM leaves its ``with``
        block. A collected LLM stops its loop and closes its engine, which frees them unless
        the engine is referenced elsewhere."""
        self._finalizer()
        self.engine.release()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: Prompts,
        sampling_params: Params = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Complete every prompt, in order. A prompt is text, token ids, or a dict with
        ``prompt`` or ``prompt_token_ids``; a bad one gets ``error`` set while the rest complete."""
        _no_lora(lora_request)
        items = _as_prompt_list(prompts)
        return self._run([(p, False) for p in items], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Union[Conversation, Seq[Conversation]],
        sampling_params: Params = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[Seq[Mapping[str, Any]]] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them, rendered by the
        chat template (or ``chat_template``); a conversation that cannot be rendered gets
        ``error`` set while the rest complete.

        ``tools`` (OpenAI's function definitions) are rendered into the prompt: by the
        template's own tool section, or for a template without one, into the system prompt
        (docs/serving.md); the reply is returned as text (finding tool calls in it is the
        server's). ``chat_template_kwargs`` are more template variables (``enable_thinking``)."""
        _no_lora(lora_request)
        render = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, tools=list(tools) if tools else None,
                      **(chat_template_kwargs or {}))
        items: list[tuple[Any, bool]] = []
        for conv in _as_conversations(messages):
            try:
                items.append((self.engine.inputs.render_chat(conv, **render), True))
            except RequestError as exc:
                items.append((exc, True))
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items: list[tuple[Any, bool]], sampling_params: Params, use_tqdm: bool) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(items))
        outputs: list[Optional[RequestOutput]] = [None] * len(items)
        sink: queue.SimpleQueue = queue.SimpleQueue()
        totals = Accumulator()
        order: dict[str, int] = {}
        submitted: dict[str, int] = {}  # what the loop holds (and an interrupt must end)
        try:
            requests = []
            for i, ((prompt, chat), p) in enumerate(zip(items, params)):
                request = self._process(prompt, p, chat, stream=False)
                if isinstance(request, RequestOutput):
                    outputs[i] = request
                    continue
                order[request.request_id] = i
                requests.append(request)
            if requests:  # all at once: the first step sees every prompt of the call
                self._loop.submit_all(requests, sink)
                submitted = order
            show = use_tqdm and self.config.show_progress and bool(order)
            with tqdm(total=len(order), desc="Generating", unit=" req", disable=not show) as bar:
                pending = len(order)
                while pending:
                    out = totals.add(sink.get())
                    if out.finished:
                        outputs[order[out.request_id]] = out
                        pending -= 1
                        bar.update(1)
        except BaseException:  # Ctrl-C, or anything else: this call's requests end with it
            self._abort_and_wait([rid for rid, i in submitted.items() if outputs[i] is None], sink)
            raise
        return [o for o in outputs if o is not None]

    def _process(self, prompt: Any, params: SamplingParams, chat: bool, stream: bool) -> Union[EngineRequest, RequestOutput]:
        """The engine request for one prompt, or its error output if it is invalid."""
        rid = str(next(self._ids))
        try:
            if isinstance(prompt, RequestError):
                raise prompt
            return self.engine.inputs.process(prompt, params, rid, stream=stream, chat=chat)
        except RequestError as exc:
            log.warning("request %s rejected: %s", rid, exc)
            return _rejected(rid, prompt, params, str(exc))

    def _abort_and_wait(self, request_ids: list[str], sink: "queue.SimpleQueue[RequestOutput]") -> None:
        """Abort ``request_ids`` and wait until the loop has ended them (nothing left registered)."""
        for rid in request_ids:
            self._loop.abort(rid)
        left = set(request_ids)
        while left and self._loop.running:
            try:
                out = sink.get(timeout=_ABORT_WAIT_S)
            except queue.Empty:
                log.warning("the engine did not confirm %d abort(s) in %.0f s", len(left), _ABORT_WAIT_S)
                return
            if out.finished:
                left.discard(out.request_id)

    # ------------------------------------------------------------------ streaming
    def stream(
        self, prompt: Union[Prompt, Conversation], sampling_params: Optional[SamplingParams] = None
    ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput each time the request advances; ``delta`` holds the new text.

        A conversation (a list of messages) is rendered by the chat template. Closing
        the iterator early (``break``, ``close()``, garbage collection, Ctrl-C) aborts
        the request.
        """
        chat = _is_conversation(prompt)
        params = _as_params_list(sampling_params, 1)[0]
        if chat:
            prompt = self.engine.inputs.render_chat(prompt)  # type: ignore[arg-type]
        # the caller gets the RequestError; nothing to log
        request = self.engine.inputs.process(prompt, params, str(next(self._ids)), stream=True, chat=chat)
        return self._stream(request)

    def _stream(self, request: EngineRequest) -> Iterator[RequestOutput]:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        totals = Accumulator()
        self._loop.submit(request, sink)
        finished = False
        try:
            while not finished:
                out = totals.add(sink.get())
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._loop.abort(request.request_id)


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ConfigError("lora_request: LoRA adapters are not supported by ingot")


def _is_conversation(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


def _as_conversations(messages: Any) -> list[Any]:
    if _is_conversation(messages):
        return [messages]
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
        return list(messages)
    raise TypeError("chat() takes a conversation (a list of {'role', 'content'} dicts) or a list of conversations")


def _as_prompt_list(prompts: Any) -> list[Any]:
    """The prompts of one call: a single prompt (text, token ids, dict) or a list of them."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one tokenized prompt
        return list(prompts)
    raise TypeError(
        "prompts must be a string, a list of token ids, a prompt dict ({'prompt': ...} or "
        f"{{'prompt_token_ids': [...]}}), or a list of those; got {type(prompts).__name__}"
    )


def _as_params_list(params: Params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)


def _rejected(request_id: str, prompt: Any, params: SamplingParams, message: str) -> RequestOutput:
    """The output of a request refused before it reached the engine."""
    text = prompt if isinstance(prompt, str) else None
    ids = list(prompt) if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt) else []
    return failed_output(request_id, text, ids, params.n, message)


