"""EAGLE-1 and EAGLE-3 draft heads: one decoder layer that proposes the target's next tokens
from the target's own hidden states (Li et al., 2024 and 2025; the published checkpoints of
SafeAILab/EAGLE, SpecForge and the speculators library).

Both heads work one position behind the target's tokens: at position ``t`` the head reads
the hidden state the target computed at ``t`` (``h_t``) with the embedding of the token
after it (``x_{t+1}``) and predicts ``x_{t+2}``. Where it drafts several tokens in a row,
the hidden state it reads at ``t + 1`` is its own output at ``t``.

* EAGLE-1: ``h_t`` is the target's final normed hidden state; ``fc`` maps
  ``[embed(x_{t+1}), h_t]`` (2H) to H; the layer has no input norm; its output goes
  through the target's lm_head unnormed.
* EAGLE-3: ``h_t`` is ``fc`` of the residual stream entering three target layers
  (``aux_layers``, by default 2, L/2 and L-3), 3H to H; the layer's attention reads
  ``[input_layernorm(embed(x_{t+1})), hidden_norm(h_t)]`` (2H); its output goes through
  the head's ``norm`` and its own ``lm_head`` over a draft vocabulary (``draft_vocab_size``
  ids, mapped to the target's by ``d2t``: target id = draft id + d2t[draft id]).

The hidden states the head reads live in a paged cache beside the KV cache (``EagleSink``:
one row per KV slot): the target's forward writes its rows (EAGLE-3 after ``fc``, so every
row is H wide), and a drafting step writes its output to the slot of the next position
(``runner/eagle_runner.py``). The head's forward reads the rows at its own slots, so it
runs through the same decode graphs as any draft model.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from ingot.layers.attention import AttentionMetadata
from ingot.layers.embedding import Embedding, LMHead
from ingot.layers.linear import Linear, MergedLinear
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.layers.rotary import RotaryEmbedding
from ingot.loading.eagle import EagleSpec
from ingot.loading.model_config import ModelConfig
from ingot.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class EagleSink:
    """The hidden-state cache an EAGLE head reads (``[slots, H]``, the target's dtype), and the
    store the target's forward runs into it (``LlamaForCausalLM.hidden_sink``)."""

    def __init__(self, layers: tuple[int, ...], fc: Optional[MergedLinear], cache: torch.Tensor) -> None:
        self.layers = layers
        self.fc = fc  # EAGLE-3's fc (the head's module), applied as the target stores its streams
        self.cache = cache

    def store(self, states: list[torch.Tensor], slots: torch.Tensor, policy: OpPolicy) -> None:
        h = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
        if self.fc is not None:
            h = self.fc(h, policy)
        self.cache.index_copy_(0, slots, h.to(self.cache.dtype))


class EagleLayer(nn.Module):
    """The head's decoder layer; its attention reads ``in_features`` (2H for EAGLE-3, H for
    EAGLE-1) and writes H. Checkpoint names as a Llama layer's, plus EAGLE-3's ``hidden_norm``."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, eagle3: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = LlamaAttention(dataclasses.replace(cfg, hidden_size=2 * h if eagle3 else h), rotary,
                                        prefix="layers.0.self_attn")
        self.self_attn.o_proj = Linear(cfg.num_heads * cfg.head_dim, h, cfg.o_bias)  # back to H
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(h, cfg.intermediate_size)


class EagleHead(LlamaForCausalLM):
    """An EAGLE head as a one-layer model with the decoder interface the runners use
    (``forward``, ``compute_logits``, ``attention_layers``, HF-named ``load_weights``).

    ``shared``: the target's embedding and lm_head, used where the checkpoint has none (held
    outside the module tree: they are the target's parameters, loaded and counted there).
    ``compute_logits`` returns logits over the target's vocabulary (EAGLE-3's draft ids
    scattered to their target ids, ``-inf`` elsewhere), so drafts are target ids."""

    def __init__(self, cfg: ModelConfig, spec: EagleSpec, max_position: int, target_vocab: int,
                 shared: tuple[Embedding, LMHead]) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.spec = spec
        self.head_order = None
        eagle3 = spec.variant == "eagle3"
        self.eagle3 = eagle3
        h = cfg.hidden_size
        fc_in = 3 * spec.target_hidden_size if eagle3 else 2 * h
        self.fc = MergedLinear(fc_in, (h,), bias=spec.fc_bias)
        rotary = self.make_rotary(cfg, max_position)
        self.layers = nn.ModuleList([EagleLayer(cfg, rotary, eagle3)])
        self.embed_tokens = Embedding(target_vocab, h) if spec.own_embedding else None
        self.norm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        self.lm_head = LMHead(spec.draft_vocab_size, h, None) if spec.own_lm_head else None
        # EAGLE-3's draft ids in the target's vocabulary (draft id + d2t[draft id], from the checkpoint)
        self.register_buffer("target_ids", torch.zeros(spec.draft_vocab_size, dtype=torch.int64) if spec.has_d2t else None)
        self._shared = shared
        self.target_vocab = target_vocab
        self.sink: Optional[EagleSink] = None  # set with the KV cache (runner/eagle_runner.py)
        self.out_hidden: Optional[torch.Tensor] = None  # each decode row's output, for the next drafting step

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        """The head's output hidden states [T, H] (before EAGLE-3's norm): each row reads the
        hidden state at its own KV slot and the embedding of its token."""
        assert self.sink is not None, "an EAGLE head runs with its hidden-state cache attached"
        hidden = self.sink.cache.index_select(0, meta.slot_mapping)
        embeds = (self.embed_tokens if self.embed_tokens is not None else self._shared[0])(input_ids)
        layer = self.layers[0]
        if self.eagle3:
            hidden_normed = layer.hidden_norm(hidden, None, policy)
            x = torch.cat([layer.input_layernorm(embeds, None, policy), hidden_normed], -1)
            residual = hidden_normed if self.spec.norm_before_residual else hidden
        else:
            x = self.fc(torch.cat([embeds, hidden], -1), policy)
            residual = x
        attn = layer.self_attn(positions, layer.self_attn.qkv_proj(x, policy), meta, policy)
        normed, residual = layer.post_attention_layernorm(attn, residual, policy)
        out = residual + layer.mlp(layer.mlp.gate_up_proj(normed, policy), policy)
        keep = self.out_hidden
        if not meta.is_prefill and keep is not None:  # (a round's drafting steps chain from these rows)
            assert out.shape[0] <= keep.shape[0], f"{out.shape[0]} decode rows, kept rows for {keep.shape[0]}"
            keep[: out.shape[0]].copy_(out)
        return out

    def compute_logits(self, hidden: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        if not self.eagle3:
            return self._shared[1](hidden, policy)
        head = self.lm_head if self.lm_head is not None else self._shared[1]
        logits = head(self.norm(hidden, None, policy), policy)
        if self.target_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
        return full.index_copy_(1, self.target_ids, logits)

    # ------------------------------------------------------------------ loading
    def _skipped(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or name == "t2d"  # (t2d: the inverse of d2t, not needed)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name == "d2t":  # (its shape and range checked with the checkpoint: loading/eagle.py)
            ids = self.target_ids
            ids.copy_(torch.arange(ids.shape[0], device=ids.device) + tensor.to(ids.device, torch.int64))
            return []
        return super().load_tensor(name, tensor)
