"""Sliding-window attention through the whole engine against HF transformers (fp32, CPU): tiny
random Mistral (every layer windowed: blocks outside the window handed back), Qwen2 (a global
and a windowed layer), Gemma 2 (alternating, soft-capped) and Gemma 3 (two local layers to a
global one) checkpoints, windows of 8 tokens, shorter than prompt + generation."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import hf_model, write_tiny_checkpoint

# arch -> (config changes, each layer's window as ingot reads it)
WINDOWED = {
    "mistral": (dict(sliding_window=8), (8, 8)),
    "qwen2": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), (0, 8)),
    "gemma2": ({}, (8, 0)),
    "gemma3": ({}, (8, 8, 0)),
}
PROMPTS = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (21, 17)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def hf_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_model(path)
    out = []
    for prompt in prompts:
        with torch.no_grad():
            full = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(full[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def checkpoint(request, tmp_path_factory):
    arch = request.param
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=4, overrides=WINDOWED[arch][0])
    return arch, path, hf_greedy(path, PROMPTS, GREEDY.max_tokens)


def test_greedy_tokens_match_hf(checkpoint):
    """A batch of two prompts, prefilled in chunks of 6 tokens over 4-token blocks, so chunks
    straddle the window's edge, then decoded 16 tokens each; with prefix caching the second
    round takes the first's cached blocks (those handed back included, while not reused)."""
    arch, path, expected = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, block_size=4, max_num_batched_tokens=6)
    assert llm.engine.model_config.layer_windows == WINDOWED[arch][1]
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.stats.prefix_cache_hits > 0


@pytest.mark.parametrize("checkpoint", ["mistral"], indirect=True)  # every layer windowed (a global layer keeps all)
def test_blocks_outside_the_window_are_handed_back(checkpoint):
    """Every layer windowed (Mistral): a decoding sequence holds only the blocks its window
    touches, the rest of its table is the dummy block; the tokens still equal HF's, also when
    the pool is so small that handed-back blocks are taken again by the other sequence."""
    _, path, expected = checkpoint
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False, block_size=4,
                                 num_kv_blocks=17, enable_prefix_caching=False))
    seqs = [engine.add_request(prompt, GREEDY) for prompt in PROMPTS]
    held: dict[int, list[int]] = {0: [], 1: []}  # per sequence, after each step it decoded in
    while engine.has_unfinished():
        engine.step()
        for i, s in enumerate(seqs):
            if not s.finished and not s.is_prefill:
                held[i].append(sum(1 for b in s.block_ids if b))
    # after its prefill a sequence holds its prompt's blocks; from its first decode step on only
    # the window's: the block the window starts in, the full ones after it, the one being filled
    assert held[0][0] == 6 and max(held[0][1:] + held[1][1:]) <= 8 // 4 + 2
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.scheduler.stats.num_preemptions == 0  # 2 x 37 tokens in a 64-token pool: only by handing back
    assert engine.scheduler.blocks.num_free == 16
