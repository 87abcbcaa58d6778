"""`ingot check quant`: how far do the quantized kernels move a model's outputs?

A quantized model runs as it serves (ingot's engine: its decode steps through the
quantized GEMV / GEMM kernels and CUDA graphs), greedily, on the user's prompts. The
same quantized weights, dequantized to the model dtype at load, then run the plain
path (a dense model, one forward over each prompt and the tokens the quantized engine
chose). At every generated position it reports whether the dense model's top-1 is the
token the quantized engine chose (teacher-forced top-1 agreement) and the difference
of that token's logprob between the two: the kernels' error alone, since both hold
the same weights.

    ingot check quant --model Qwen/Qwen2.5-7B-Instruct-AWQ --steps 128 --json quant.json
    ingot check quant                       # the default model's own Q4_1 blocks
    ingot check quant --model path/to/bf16 --quantization int4
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ingot.bench import report

DEFAULT_STEPS = 128


@dataclass
class QuantAgreement:
    prompts: int
    positions: int
    top1_agreement: float  # fraction of positions where the dequantized model's top-1 is the quantized engine's token
    max_logprob_diff: float  # largest |logprob| difference of the chosen token
    mean_logprob_diff: float


def quantized_run(config: Any, prompts: list[list[int]], steps: int) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their logprobs) of each prompt from the engine serving ``config``."""
    from ingot.llm import LLM
    from ingot.sampling_params import SamplingParams

    llm = LLM(**{f: getattr(config, f) for f in ("model", "tokenizer", "load_format", "quantization", "dtype",
                                                    "device", "max_model_len", "show_progress")})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs = []
        for out in outs:
            c = out.outputs[0]
            runs.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
        return runs
    finally:
        llm.shutdown()


def dense_logprobs(config: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the log-softmax [len, vocab] of the quantized weights dequantized at load, from one
    plain forward (a one-sequence KV pool, prefill attention) in the model dtype."""
    from ingot.layers.attention import AttentionMetadata
    from ingot.loading.checkpoint import open_checkpoint
    from ingot.models.loader import held_dense, load_checkpoint, resolve_device, resolve_dtype
    from ingot.runner.kv_pool import KVCachePool, blocks_for

    ckpt = open_checkpoint(config.model, config.tokenizer, config.load_format, config.quantization,
                           dequantize_on_load=True, held_dense=held_dense)  # online -q spares them, as served
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, ckpt.config.torch_dtype)
    longest = max(len(s) for s in sequences)
    model = load_checkpoint(ckpt, dtype, device, longest, progress=config.show_progress)
    cfg, bs = model.config, config.block_size
    entry = cfg.kv_cache_entry  # DeepSeek's latent attention caches one entry a token, no V
    pool = KVCachePool(cfg.num_layers, blocks_for(longest, bs) + 1, bs, entry.heads, entry.head_dim, dtype, device,
                       entry.separate_values)
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache, attn.v_cache = pool.layer(i)
    out = []
    with torch.inference_mode():
        for seq in sequences:
            n = len(seq)
            meta = AttentionMetadata(
                is_prefill=True, slot_mapping=torch.arange(bs, bs + n, device=device),
                block_tables=torch.arange(1, blocks_for(n, bs) + 1, dtype=torch.int32, device=device)[None],
                seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
                cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device))
            hidden = model(torch.tensor(seq, device=device), torch.arange(n, device=device), meta)
            out.append(torch.log_softmax(model.compute_logits(hidden).float(), -1).cpu())
    return out


def compare(prompts: list[list[int]], runs: list[tuple[list[int], list[float]]],
            dense: list[torch.Tensor]) -> QuantAgreement:
    """The agreement of the quantized runs with the dense logprobs at every generated position."""
    agree, diffs = 0, []
    for prompt, (tokens, logprobs), lp in zip(prompts, runs, dense):
        for i, (tok, q_lp) in enumerate(zip(tokens, logprobs)):
            row = lp[len(prompt) - 1 + i]  # the position that predicts generated token i
            agree += int(row.argmax()) == tok
            diffs.append(abs(float(row[tok]) - q_lp))
    n = len(diffs)
    return QuantAgreement(len(prompts), n, agree / max(n, 1), max(diffs, default=0.0), sum(diffs) / max(n, 1))


def cmd_quant(args: argparse.Namespace) -> int:
    from ingot.bench.drift_cli import DriftInputError, builtin_prompts, encode_prompts, read_prompts
    from ingot.config import EngineConfig
    from ingot.engine_args import model_overrides
    from ingot.loading.checkpoint import open_checkpoint

    try:
        specs = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    except DriftInputError as exc:
        print(f"ingot check quant: error: {exc}", file=sys.stderr)
        return 2
    config = EngineConfig.create(dtype=args.dtype, device=args.device, show_progress=not args.quiet,
                                 **model_overrides(args))
    tokenizer = open_checkpoint(config.model, config.tokenizer, config.load_format).tokenizer
    prompts = encode_prompts(tokenizer, specs)
    runs = quantized_run(config, prompts, args.steps)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    dense = dense_logprobs(config, [p + toks[:-1] for p, (toks, _) in zip(prompts, runs)])
    result = compare(prompts, runs, dense)
    passed = result.top1_agreement >= args.threshold
    print(f"{config.model or 'default model'} ({config.quantization or 'as stored'}), {result.prompts} prompts x "
          f"{args.steps} steps: teacher-forced top-1 agreement {100 * result.top1_agreement:.2f}%, logprob difference "
          f"max {result.max_logprob_diff:.3e} mean {result.mean_logprob_diff:.3e} -> {'PASS' if passed else 'FAIL'} "
          f"(threshold {100 * args.threshold:.2f}%)")
    if args.json:
        doc = {"command": "ingot check quant", "env": report.env_info(), "model": config.model,
               "quantization": config.quantization, "steps": args.steps, "threshold": args.threshold,
               "passed": passed, **asdict(result)}
        print(f"wrote {report.write_json(args.json, doc)}")
    return 0 if passed else 1


def add_parser(subparsers) -> None:
    from ingot.config import DTYPES
    from ingot.engine_args import add_model_args

    p = subparsers.add_parser(
        "quant", help="compare a quantized model's kernels with its weights dequantized (teacher-forced top-1)",
        description="Run a quantized model greedily as ingot serves it, then the same quantized weights dequantized "
                    "at load through the plain path; report the teacher-forced top-1 agreement and the logprob "
                    "difference of the chosen tokens. Exit code 1 below --threshold.")
    add_model_args(p.add_argument_group("model"))
    p.add_argument("--prompts", default=None, metavar="FILE", help="one prompt per line (default: 8 built-in prompts)")
    p.add_argument("--steps", type=report.positive_int, default=DEFAULT_STEPS, help=f"tokens per prompt (default {DEFAULT_STEPS})")
    p.add_argument("--threshold", type=float, default=0.995, help="minimum top-1 agreement (default 0.995)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--quiet", action="store_true", help="no progress bars or logs")
    p.set_defaults(func=cmd_quant)
