"""The `ingot` command: generate and chat (streaming), with the engine's main knobs."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Optional, Sequence

from ingot.config import ConfigError
from ingot.engine_args import add_engine_args, engine_overrides


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens with this total probability")
    g.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="per-request seed: the same seed gives the same text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ingot", description="ingot: fast LLM inference for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming the text", description="Complete a prompt and stream the completion to stdout.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    add_engine_args(gen)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat, streaming replies", description="Chat with the model; an empty line or Ctrl-D quits.")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _sampling_args(chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve the model over HTTP with OpenAI's API (completions, chat completions, "
                                       "models, tokenize, detokenize, health, version, metrics).")
    add_engine_args(serve)
    srv = serve.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed when ready)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $INGOT_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model path's last part)")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="requests that may wait beyond the running batch; more get HTTP 503 (default: no limit)")
    srv.add_argument("--max-num-seqs", type=int, default=None, help="sequences in the running batch (default 512 on a GPU of 70 GiB or more, else 256)")
    srv.add_argument("--engine-in-thread", action="store_true",
                     help="run the engine in a thread of the server process instead of its own process")
    srv.add_argument("--api-server-count", type=int, default=1, metavar="N",
                     help="HTTP server processes sharing the port and the engine process: more of them write "
                          "streams' chunks sooner under heavy streaming load (default 1)")
    agents = serve.add_argument_group("tools")
    from ingot.serve.tool_parsers import PARSERS as TOOL_PARSERS

    agents.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="how the model writes tool calls (needed for tool_choice \"auto\"): hermes (<tool_call> "
                             "JSON, also what templates without a tool section are told), llama3_json, mistral")
    agents.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="allow tool_choice \"auto\" (the default when a request has tools); needs --tool-call-parser")
    # `ingot bench ...` and `ingot check ...`: each command module adds its own parser
    # and sets `func`; see ingot/bench/.
    bench = sub.add_parser("bench", help="benchmarks: decode step times, serving throughput")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    check = sub.add_parser("check", help="checks: drift of compiled decode against eager")
    check_sub = check.add_subparsers(dest="check_command", required=True)
    from ingot.bench import commands

    commands.add_parsers(bench_sub, check_sub)
    return parser


def _make_llm(args: argparse.Namespace):
    from ingot.llm import LLM

    return LLM(**engine_overrides(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from ingot.config import EngineConfig
    from ingot.serve.server import ServeOptions, serve

    if args.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1 (got {args.api_server_count})")
    if args.api_server_count > 1 and args.engine_in_thread:
        raise ConfigError("--api-server-count above 1 needs the engine in its own process (drop --engine-in-thread)")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ConfigError("--max-queued-requests must be >= 0")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    options = ServeOptions(args.host, args.port, args.api_key, args.served_model_name, args.max_queued_requests,
                           engine_process=not args.engine_in_thread, log_level="warning" if args.quiet else "info",
                           tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                           api_server_count=args.api_server_count)
    config = EngineConfig.create(**engine_overrides(args))
    if options.api_server_count > 1:
        from ingot.serve.api_servers import serve_many

        return serve_many(config, options)
    return serve(config, options)



def _params(args: argparse.Namespace):
    from ingot.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _stream(llm, prompt: Any, params) -> str:
    """Print the reply as it comes; returns its text. A failed request raises RequestError."""
    from ingot.engine.request import RequestError

    text = ""
    outputs = llm.stream(prompt, params)  # an invalid request raises here, before anything is printed
    try:
        for out in outputs:
            sys.stdout.write(out.delta)
            sys.stdout.flush()
            text = out.outputs[0].text
            if out.error:
                raise RequestError(out.error)
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _make_llm(args)
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    _stream(llm, prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from ingot.engine.request import RequestError

    params = _params(args)
    llm = _make_llm(args)
    # piped input: no prompts, only the replies (one per line of input)
    interactive = sys.stdin.isatty()
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    while True:
        try:
            line = (input("you> ") if interactive else _read_line()).strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
            if interactive:
                print()
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        if interactive:
            sys.stdout.write("assistant> ")
        try:
            reply = _stream(llm, history, params)
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            print("[reply interrupted]", file=sys.stderr)
            history.pop()
            continue
        except RequestError as exc:  # this turn failed; the conversation goes on without it
            print(f"ingot: error: {exc}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
    return 0


def _read_line() -> str:
    """One line of piped input (``input()`` without its prompt); EOFError at the end."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    quiet = getattr(args, "quiet", False)
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ingot.engine.request import RequestError
    from ingot.loading.errors import CheckpointError
    from ingot.sampling_params import SamplingError

    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "serve":
            return cmd_serve(args)
        return int(args.func(args) or 0)
    except (ConfigError, CheckpointError, RequestError, SamplingError) as exc:
        print(f"ingot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
