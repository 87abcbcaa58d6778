"""Tokenizer: HF `tokenizers` fast tokenizer + chat template + special ids,
and the incremental detokenizer used for streaming and stop strings."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.meta
import jinja2.sandbox
import tokenizers
from tokenizers.decoders import DecodeStream

from ingot.loading.errors import CheckpointError

Message = dict[str, Any]


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD.

    Python turns invalid UTF-8 into lone surrogates (``"\\udcff"`` for byte 0xff:
    command-line arguments, ``surrogateescape`` file reads); the tokenizer cannot
    encode them. ingot encodes such text as the Unicode replacement character,
    everywhere text enters (prompts, chat messages, stop strings are compared to it).
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Encoding(dict):
    """What calling a tokenizer returns (HF's ``BatchEncoding`` subset): a dict with
    ``input_ids`` and ``attention_mask``, also readable as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """What the engine needs from a tokenizer, whatever file it came from."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        chat_template: Optional[str] = None,
        bos_token_id: Optional[int] = None,
        eos_token_ids: Sequence[int] = (),
        prepend_bos: bool = False,
    ) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.prepend_bos = prepend_bos
        self._template: Optional[jinja2.Template] = None
        self._reads_tools_cache: dict[str, bool] = {}

    # ------------------------------------------------------------ construction
    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json for the chat template and special tokens)."""
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise CheckpointError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise CheckpointError(f"cannot read {tok_file}: {exc}") from None
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        bos = _token_id(tok, cfg.get("bos_token"))
        eos = [*eos_token_ids]
        cfg_eos = _token_id(tok, cfg.get("eos_token"))
        if cfg_eos is not None:
            eos.append(cfg_eos)
        # tokenizer.json's post-processor adds BOS itself when the model wants it
        return cls(tok, chat_template=template, bos_token_id=bos, eos_token_ids=eos)

    # ------------------------------------------------------------ encode / decode
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> Optional[int]:
        """The first end-of-sequence id (HF's attribute); ``eos_token_ids`` has all of them."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: Union[str, Sequence[str]], add_special_tokens: bool = True) -> Encoding:
        """HF-style call: ``{"input_ids", "attention_mask"}`` for one text or a list of texts."""
        if isinstance(text, str):
            ids: Any = self.encode(text, add_special_tokens)
            mask: Any = [1] * len(ids)
        else:
            ids = [self.encode(t, add_special_tokens) for t in text]
            mask = [[1] * len(i) for i in ids]
        return Encoding(input_ids=ids, attention_mask=mask)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (lone surrogates encoded as U+FFFD, see ``clean_text``)."""
        if not isinstance(text, str):
            raise TypeError(f"text to encode must be a str, got {type(text).__name__}")
        ids = self.tok.encode(clean_text(text), add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.prepend_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Union[int, Sequence[int]], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (HF's default: special tokens kept)."""
        if isinstance(ids, int):
            ids = [ids]
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """``decode`` of many id lists in one call (the Rust side runs them in parallel)."""
        return self.tok.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id) or ""

    def convert_ids_to_tokens(self, ids: Union[int, Sequence[int]]) -> Union[str, list[str]]:
        """The vocabulary entries (not decoded text) of ``ids``, as HF returns them."""
        if isinstance(ids, int):
            return self.token_text(ids)
        return [self.token_text(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Union[str, Sequence[str]]) -> Union[Optional[int], list[Optional[int]]]:
        if isinstance(tokens, str):
            return self.tok.token_to_id(tokens)
        return [self.tok.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)

    # ------------------------------------------------------------ chat
    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        continue_final_message: bool = False,
        tools: Optional[Sequence[dict[str, Any]]] = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        ``chat_template`` replaces the model's own template; ``continue_final_message``
        leaves the last (assistant) message open for the model to continue, as HF does:
        the text is cut right after that message's content. ``tools`` (OpenAI's tool
        definitions) reach the template as ``tools``, as in HF and vLLM; a template that
        never reads ``tools`` gets them in its system prompt instead, with tool calls and
        results of the history as text (``tools_as_text``). ``template_kwargs`` are more
        variables for the template (``enable_thinking``...). Raises ValueError with the
        reason for a conversation or template it cannot render.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("a conversation needs at least one message")
        taken = sorted(set(template_kwargs) & {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})
        if taken:
            raise ValueError(f"chat template kwargs cannot set {', '.join(taken)}")
        msgs = [_normalise_message(m) for m in messages]
        source = chat_template if chat_template is not None else self.chat_template
        if not source:
            raise ValueError("this model has no chat template; pass chat_template= or use generate() with a plain prompt")
        template = self._compiled_template(source)
        if not self._reads_tools(source) and (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)):
            msgs, tools = tools_as_text(msgs, tools), None
        special = {
            "bos_token": self.token_text(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else "",
        }
        try:
            text = template.render(messages=msgs, add_generation_prompt=add_generation_prompt, tools=tools or None,
                                   **special, **template_kwargs)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from None
        if continue_final_message:
            final = msgs[-1]["content"].strip()
            cut = text.rfind(final) if final else -1
            if cut == -1:
                raise ValueError("continue_final_message: the rendered template does not contain the last message")
            text = text[: cut + len(final)]
        return text

    def _reads_tools(self, source: str) -> bool:
        """Does the template read a ``tools`` variable (does it have a tool section)?"""
        cached = self._reads_tools_cache.get(source)
        if cached is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment()
            cached = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
            if source == self.chat_template:
                self._reads_tools_cache[source] = cached
        return cached

    def _compiled_template(self, source: str) -> jinja2.Template:
        if source == self.chat_template and self._template is not None:
            return self._template
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not parse: {exc}") from None
        if source == self.chat_template:
            self._template = template
        return template

    def apply_chat_template(
        self,
        conversation: Sequence[Message],
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        tools: Optional[Sequence[dict[str, Any]]] = None,
        **unused: Any,
    ) -> Union[str, list[int], Encoding]:
        """HF's method with transformers 5's defaults: the text with ``tokenize=False``; else
        ``{"input_ids", "attention_mask"}``, or the ids alone with ``return_dict=False``."""
        text = self.render_chat(conversation, add_generation_prompt, chat_template, continue_final_message, tools=tools)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    def encode_chat(self, messages: Sequence[Message], **render: Any) -> list[int]:
        # the template already carries every special token (BOS included, if any)
        return self.encode(self.render_chat(messages, **render), add_special_tokens=False)


TOOLS_PROMPT = (
    "You can call functions to help you answer. Their signatures are listed between <tools> and </tools>, "
    "one JSON object per line:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with its name and arguments as a JSON object between <tool_call> and "
    "</tool_call>, one block per call:\n<tool_call>\n"
    '{{"name": "<function name>", "arguments": {{<the arguments, as JSON>}}}}\n</tool_call>'
)


def tools_as_text(msgs: list[Message], tools: Optional[Sequence[dict[str, Any]]]) -> list[Message]:
    """A conversation for a template without a tool section: the tools described in the
    system prompt (added to the first system message, or a new one), the history's tool
    calls written into their assistant messages and tool results sent as user messages,
    all in the ``<tool_call>`` / ``<tool_response>`` format ingot's ``hermes`` parser reads."""
    out: list[Message] = []
    if tools:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if msgs[0]["role"] == "system":
            first = msgs[0]["content"]
            out.append({**msgs[0], "content": f"{first}\n\n{block}" if first else block})
            msgs = msgs[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args = json.loads(args) if isinstance(args, str) and _is_json(args) else args
                calls.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                             + "\n</tool_call>")
            text = "\n".join(calls)
            out.append({**m, "content": f"{m['content']}\n{text}" if m["content"] else text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append(m)
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _raise(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _normalise_message(m: Any) -> Message:
    """A message with string content: OpenAI's list of text parts is joined; other part
    types (images, audio) are refused."""
    if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
        raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message content parts must be {{'type': 'text', 'text': ...}}, got {part!r}")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")
    if not isinstance(m["role"], str):
        raise ValueError(f"message role must be a string, got {m['role']!r}")
    return {**m, "content": clean_text(content)}


def _token_id(tok: tokenizers.Tokenizer, token: Any) -> Optional[int]:
    if isinstance(token, dict):
        token = token.get("content")
    return tok.token_to_id(token) if isinstance(token, str) else None


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Decoding only a short window (a few tokens before the last emitted one)
    keeps each step O(1) and gets the spaces and multi-byte characters right:
    text is released only once it no longer ends in a partial character.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        # tokenizers' DecodeStream runs the same windows in Rust (``_step``); it holds the
        # first ``_stream_len`` ids and is rebuilt from the offsets whenever ``ids`` changed
        # behind its back (deferred tokens, a rolled-back failed step, the final flush)
        self._stream: Optional[DecodeStream] = None
        self._stream_len = -1

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (may be empty)."""
        return add_tokens([self], [token_ids])[0]

    def defer(self, token_ids: Sequence[int]) -> None:
        """Append tokens without decoding them: the text comes with the next ``add`` or
        ``add_tokens(..., final=True)`` (one decode for many tokens, when no one reads
        the text in between)."""
        self.ids.extend(token_ids)

    def _step(self, token_ids: Sequence[int]) -> str:
        """Append tokens and release the text they complete, as ``_windows`` + ``_advance``
        would (the text before the last release is the prefix, kept in the stream)."""
        ids = self.ids
        stream = self._stream
        if stream is None or self._stream_len != len(ids):  # new, or ids changed behind its back
            stream = self._stream = DecodeStream(ids=ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip)
            ids.extend(token_ids)
            pending: Any = ids[self.read_offset :]
        elif not token_ids:  # in step, nothing new: nothing more to release
            return ""
        else:
            ids.extend(token_ids)
            pending = token_ids[0] if len(token_ids) == 1 else list(token_ids)  # an int: the common, cheaper call
        self._stream_len = len(ids)
        if len(ids) == self.read_offset:  # nothing pending: nothing to release
            return ""
        try:
            delta = stream.step(self.tokenizer.tok, pending)
        except Exception:  # e.g. the new text does not extend the prefix's: the windows decide
            self._stream = None
            prefix, full = self.tokenizer.decode_batch(list(self._windows()), self.skip)
            return self._advance(prefix, full)
        if not delta:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        self.text += delta
        return delta

    def _windows(self) -> tuple[list[int], list[int]]:
        """The ids whose text is already out, and those plus the pending ones."""
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def _advance(self, prefix: str, full: str, final: bool = False) -> str:
        if final:  # nothing follows: release all but a trailing partial character
            full = full.rstrip("\ufffd")
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def _streams_supported() -> bool:
    """tokenizers' DecodeStream takes a prefix (``ids=``) and steps of several ids from 0.22 on
    (an environment that runs ingot from source may hold an older tokenizers)."""
    try:
        DecodeStream(ids=[], skip_special_tokens=False)
    except TypeError:
        return False
    return True


_STREAMS = _streams_supported()


def add_tokens(
    detoks: Sequence[IncrementalDetokenizer], token_ids: Sequence[Sequence[int]], final: bool = False
) -> list[str]:
    """``IncrementalDetokenizer.add`` for a whole step's sequences. Streaming, each goes
    through its tokenizers ``DecodeStream`` (at batch 256 on a 2-core CPU: 0.24 ms per
    step, against 0.63 ms for one ``decode_batch`` of every sequence's two windows and
    1.52 ms for two ``decode`` calls per sequence). ``final``: the sequences end here, so
    a trailing partial character is dropped rather than held back (what one-token-at-a-
    time decoding leaves out too): one ``decode_batch`` per tokenizer and skip flag."""
    if not final and _STREAMS:
        return [d._step(ids) for d, ids in zip(detoks, token_ids)]
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (d, ids) in enumerate(zip(detoks, token_ids)):
        d.ids.extend(ids)
        groups.setdefault((id(d.tokenizer), d.skip), []).append(i)
    deltas = [""] * len(detoks)
    for (_, skip), rows in groups.items():
        for i in rows:
            detoks[i]._stream = None  # the offsets move without it
        windows = [detoks[i]._windows() for i in rows]
        texts = detoks[rows[0]].tokenizer.decode_batch([w[0] for w in windows] + [w[1] for w in windows], skip)
        n = len(rows)
        for j, i in enumerate(rows):
            deltas[i] = detoks[i]._advance(texts[j], texts[n + j], final)
    return deltas
