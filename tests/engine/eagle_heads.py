"""Tiny random EAGLE heads in their published checkpoint formats, an independent reference of
what they draft (plain PyTorch over HF transformers' hidden states of the target, recomputed
from scratch at every draft: no cache, no ingot code), and the EAGLE tests' fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.eagle_round import every_draft_kept
from ingot.runner.eagle_runner import EagleRunner

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128


def _layer(r, in_features: int, prefix: str, input_norm: bool) -> dict[str, torch.Tensor]:
    w = {f"{prefix}self_attn.q_proj.weight": r(HEADS * HEAD_DIM, in_features),
         f"{prefix}self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, in_features),
         f"{prefix}self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, in_features),
         f"{prefix}self_attn.o_proj.weight": r(H, HEADS * HEAD_DIM),
         f"{prefix}post_attention_layernorm.weight": 1 + r(H),
         f"{prefix}mlp.gate_proj.weight": r(INTER, H), f"{prefix}mlp.up_proj.weight": r(INTER, H),
         f"{prefix}mlp.down_proj.weight": r(H, INTER)}
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = 1 + r(H)
    return w


def _config(arch: str, vocab: int, **extra) -> dict:
    return {"architectures": [arch], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "hidden_act": "silu", "torch_dtype": "float32", **extra}


def write_eagle3(path: Path, vocab: int, draft_vocab: Optional[int], seed: int = 0, aux: Optional[list[int]] = None,
                 embed: bool = False, fmt: str = "safetensors", speculators: bool = False) -> Path:
    """An EAGLE-3 head as SafeAILab/EAGLE and SpecForge save it: ``midlayer.*``, ``fc`` (3H -> H),
    ``norm``, ``lm_head`` over ``draft_vocab`` ids with ``d2t`` / ``t2d`` (None: the target's
    vocabulary, no map); ``aux``: the target layers named in the config (else the default).
    ``speculators``: the speculators library's layout instead (``layers.0.*``, the layer's
    config under ``transformer_layer_config``, ``norm_before_residual``, the target layers
    at the top level)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    w = {"fc.weight": r(H, 3 * H), "midlayer.hidden_norm.weight": 1 + r(H), "norm.weight": 1 + r(H),
         **_layer(r, 2 * H, "midlayer.", input_norm=True)}
    dv = draft_vocab or vocab
    w["lm_head.weight"] = r(dv, H) * 10
    extra = {}
    if draft_vocab is not None:
        ids = torch.randperm(vocab, generator=g)[:dv].sort().values
        w["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
        extra["draft_vocab_size"] = dv
    if embed:  # (with a target's sliding window copied into the config, as some heads carry it: unused)
        w["embed_tokens.weight"] = r(vocab, H)
        extra["sliding_window"] = 4
    if speculators:
        w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": _config("LlamaForCausalLM", vocab), "norm_before_residual": True,
                  "target_hidden_size": H, **extra}
        if aux is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux
        return _save(path, w, config, fmt)
    if aux is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    return _save(path, w, _config("LlamaForCausalLMEagle3", vocab, **extra), fmt)


def write_eagle1(path: Path, vocab: int, seed: int = 0, fmt: str = "bin") -> Path:
    """An EAGLE-1 head as SafeAILab/EAGLE saves it (``pytorch_model.bin``): ``fc`` (2H -> H, with
    bias), ``layers.0.*`` without an input norm, its own ``embed_tokens``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    w = {"fc.weight": r(H, 2 * H), "fc.bias": r(H), "embed_tokens.weight": r(vocab, H),
         **_layer(r, H, "layers.0.", input_norm=False)}
    return _save(path, w, _config("LlamaForCausalLM", vocab), fmt)


def _save(path: Path, w: dict, config: dict, fmt: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "bin":
        torch.save(w, path / "pytorch_model.bin")
    else:
        save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _load(path: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    file = path / "model.safetensors"
    w = load_file(str(file)) if file.exists() else torch.load(path / "pytorch_model.bin", weights_only=True)
    w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
    return w, json.loads((path / "config.json").read_text())


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def _layer_forward(w: dict, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The head's layer over a whole sequence (causal), from its attention input ``x``."""
    t = x.shape[0]
    p = "layers.0."
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
    pos = torch.arange(t)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, HEADS * HEAD_DIM)
    h = residual + attn @ w[p + "self_attn.o_proj.weight"].T
    n = _rms(h, w[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T))
    return h + mlp @ w[p + "mlp.down_proj.weight"].T


def reference_drafts(target_hf, head: Path, variant: str, tokens: list[int], k: int) -> list[int]:
    """The ``k`` greedy drafts of ``head`` after ``tokens`` (the last one not yet through the
    target): EAGLE reads the target's hidden state at ``t`` with token ``t + 1``, then its own
    output in place of the target's for the drafts it chains."""
    w, cfg = _load(head)
    n = target_hf.config.num_hidden_layers
    with torch.no_grad():
        hs = target_hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        embed = w.get("embed_tokens.weight", target_hf.get_input_embeddings().weight)
        if variant == "eagle3":
            aux = (cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3])
            hidden = torch.cat([hs[i][0] for i in aux], -1) @ w["fc.weight"].T
        else:
            hidden = hs[-1][0]  # the final normed states
        ids = list(tokens[1:])
        drafts = []
        for _ in range(k):
            e = embed[torch.tensor(ids)]
            if variant == "eagle3":
                hidden_normed = _rms(hidden, w["layers.0.hidden_norm.weight"])
                x = torch.cat([_rms(e, w["layers.0.input_layernorm.weight"]), hidden_normed], -1)
                out = _layer_forward(w, x, hidden_normed if cfg.get("norm_before_residual") else hidden)
                logits = _rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T
                d = int(logits.argmax())
                token = d + int(w["d2t"][d]) if "d2t" in w else d
            else:
                x = torch.cat([e, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
                out = _layer_forward(w, x, x)
                token = int((out[-1] @ target_hf.get_output_embeddings().weight.T).argmax())
            drafts.append(token)
            hidden = torch.cat([hidden, out[-1:]])
            ids.append(token)
    return drafts


# ---------------------------------------------------------------------- fixtures of the EAGLE tests
@pytest.fixture
def proposals(monkeypatch):
    """Every greedy round's (tokens so far, drafts), recorded as the head proposes them."""
    seen: list[tuple[list[int], list[int]]] = []
    real = EagleRunner.propose

    def recording(self, batch, eos_token_ids):
        real(self, batch, eos_token_ids)
        for seq, drafts in zip(batch.seqs, batch.draft_tokens):
            if drafts and seq.params.greedy:
                seen.append((seq.tokens(0, seq.num_computed_tokens + 1), list(drafts)))

    monkeypatch.setattr(EagleRunner, "propose", recording)
    return seen


@pytest.fixture
def agreeing():
    """The target made to agree with every draft (its verify logits raised at each draft, as
    ``benchmarks/eagle_round.py`` times rounds), so every round keeps all its drafts: the head
    then chains from its own last draft, whose hidden state it never computed (the rows one short)."""
    with every_draft_kept():
        yield


def check_against_reference(models: dict, head: str, variant: str, seen: list) -> None:
    assert len(seen) >= 8
    for tokens, drafts in seen:
        assert drafts == reference_drafts(models["hf"], models[head], variant, tokens, len(drafts)), tokens
