"""Write a random-weight HF checkpoint of a benchmark shape, with a token-id tokenizer and prompts.

    python -m benchmarks.random_checkpoint --shape qwen2.5-1.5b --out /tmp/random-qwen2.5-1.5b

For checks that need a model directory but not real weights: `ingot check drift`
on a model whose head counts divide by the tensor-parallel size (SmolLM2's 9 do
not divide by 2). The weights are transformers' own initialisation of the
shape's config (bf16, made on the GPU when there is one); the tokenizer spells
token ``i`` as ``<i>`` (``ingot.bench.random_engine.id_tokenizer``), and
``prompts.txt`` holds 8 seeded prompts of 12..60 random tokens in that spelling,
for ``--prompts``:

    ingot check drift --model /tmp/random-qwen2.5-1.5b --prompts /tmp/random-qwen2.5-1.5b/prompts.txt --tp 2
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from ingot.bench.decode import SHAPES
from ingot.bench.random_engine import id_tokenizer

MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


def write(shape: str, out: Path, num_prompts: int = 8, seed: int = 0) -> Path:
    import transformers

    fields = dict(SHAPES[shape])
    model_type = MODEL_TYPES[fields["architectures"][0]]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    vocab = fields["vocab_size"]
    id_tokenizer(vocab).tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    rng = random.Random(seed)
    lines = [" ".join(f"<{rng.randrange(vocab)}>" for _ in range(rng.randint(12, 60))) for _ in range(num_prompts)]
    (out / "prompts.txt").write_text("\n".join(lines) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    print(f"wrote {write(args.shape, args.out)}")


if __name__ == "__main__":
    main()
