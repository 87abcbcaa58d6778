"""What an EAGLE head's round costs, on random weights: a built-in shape as the target with a
random head of its shape (``{"method": "eagle3", "model": SHAPE}``).

    python -m benchmarks.eagle_round --model qwen2.5-7b --tokenizer TOK [--head PATH_OR_SHAPE] \\
        [--method eagle3] [--k 4] [--batch 1] [--input-len 512] [--output-len 256] [--requests 4] [--out PATH]

(``--model``: a built-in shape, random weights, or a model path; ``--head``: the head, by
default a random one of the model's shape.)

A random head's drafts are never the target's, so to time rounds that keep their drafts the
target's verify logits are raised at each draft (``verify_drafts`` patched: one ``index_put_``
a verify step): every round then runs as with a head that always agrees (k drafting steps,
the next round's first step feeding the k kept drafts again, the verify step; the tokens are
not the target's greedy ones). On the one engine it decodes the same prompts plainly
(speculation off) and speculating with every draft kept, alternated ``--repeat`` times, and
reports the time per output token (TPOT, from each request's first to last token) of both,
the round (TPOT x (k + 1)) and the speed-up that round predicts at per-draft acceptance 0.6 /
0.8 / 0.9 / 1 (a round emitting ``(1 - a**(k + 1)) / (1 - a)`` tokens; a round that keeps
fewer drafts feeds fewer again, so this slightly overstates its cost). Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
from typing import Any, Iterator

import torch

from ingot import LLM, SamplingParams
from ingot.bench.report import write_json
from ingot.bench.speculation import speculation_off
from ingot.loading.dummy import SHAPES
from ingot.runner import model_runner

ACCEPTANCES = (0.6, 0.8, 0.9, 1.0)


@contextlib.contextmanager
def every_draft_kept() -> Iterator[None]:
    """Inside, each verify step's logits are raised by 1e4 at every draft before the drafts are
    checked, so every draft is kept (the tests' ``agreeing`` fixture too)."""
    real = model_runner.verify_drafts

    def agree(sampler, logits, rows, drafts, mask=None, probs=None):
        at, tokens, start = [], [], 0
        for d in drafts:
            at.extend(range(start, start + len(d)))
            tokens.extend(d)
            start += len(d) + 1
        if at:
            index = torch.tensor([at, tokens], dtype=torch.int64).to(logits.device, non_blocking=True)
            logits = logits.index_put((index[0], index[1]), torch.tensor(1e4, dtype=logits.dtype, device=logits.device),
                                      accumulate=True)
        return real(sampler, logits, rows, drafts, mask, probs)

    model_runner.verify_drafts = agree
    try:
        yield
    finally:
        model_runner.verify_drafts = real


def tpot_ms(outputs: list[Any]) -> float:
    """Mean time per output token (ms), each request from its first token to its last."""
    per = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) * 1e3
           for o in outputs]
    return statistics.mean(per)


def predicted(plain_tpot: float, round_ms: float, k: int) -> dict[str, float]:
    out = {}
    for a in ACCEPTANCES:
        tokens = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
        out[f"{a:g}"] = tokens * plain_tpot / round_ms
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--head", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--method", choices=("eagle", "eagle3"), default="eagle3")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--requests", type=int, default=4, help="requests per round, run --batch at a time")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    spec = {"method": args.method, "model": args.head or args.model, "num_speculative_tokens": args.k}
    shape = args.model in SHAPES
    llm = LLM(args.model, load_format="dummy" if shape else "auto", tokenizer=args.tokenizer or ("default" if shape else None),
              speculative_config=spec, max_num_seqs=args.batch, enable_prefix_caching=False, show_progress=False)
    rng = random.Random(0)
    vocab = min(30000, llm.engine.model_config.vocab_size)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab // 3, vocab) for _ in range(args.input_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: args.batch], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    plain, spec_tpot, accepted = [], [], []
    for _ in range(args.repeat):
        with speculation_off(llm.engine):
            plain.append(tpot_ms(llm.generate(prompts, params, use_tqdm=False)))
        with every_draft_kept():
            outs = llm.generate(prompts, params, use_tqdm=False)
        spec_tpot.append(tpot_ms(outs))
        accepted.append(statistics.mean(o.metrics.spec_mean_accepted_length or 0 for o in outs))
    p_ms, s_ms = statistics.median(plain), statistics.median(spec_tpot)
    tokens_per_round = 1 + statistics.median(accepted)
    round_ms = s_ms * tokens_per_round
    result = {"model": args.model, "head": spec["model"], "method": args.method, "k": args.k, "batch": args.batch,
              "input_len": args.input_len, "output_len": args.output_len, "device": torch.cuda.get_device_name()
              if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "plain_tpot_ms": plain, "kept_tpot_ms": spec_tpot, "tokens_per_round": tokens_per_round,
              "round_ms": round_ms, "speedup_all_kept": p_ms / s_ms, "predicted": predicted(p_ms, round_ms, args.k)}
    print(f"{args.model}, {args.method} head {spec['model']}, k={args.k}, batch {args.batch}, {result['device']}")
    print(f"{'plain TPOT ms':>16} {'kept TPOT ms':>13} {'tokens/round':>13} {'round ms':>9} "
          + " ".join(f"{'a=' + k:>7}" for k in result["predicted"]))
    print(f"{p_ms:16.3f} {s_ms:13.3f} {tokens_per_round:13.2f} {round_ms:9.3f} "
          + " ".join(f"{v:6.2f}x" for v in result["predicted"].values()))
    if args.out:
        write_json(args.out, result)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
