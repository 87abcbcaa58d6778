"""A tiny random checkpoint that "thinks": its tokenizer has ``<think>`` and ``</think>`` as
tokens of their own (added, not special, as in Qwen3's and DeepSeek-R1's tokenizers), and
some of its tokens are often followed by ``</think>`` or the end of the sequence.

Its attention and MLP write nothing to the residual stream (``o_proj`` and ``down_proj``
are zero), so the next token depends on the current one alone: random logits, except that
after one token in eight (``closers``) ``</think>`` and EOS get a large logit, and after
any token ``<think>`` a moderate one. Sampled at temperature 1, a reply reasons for a few
to a few dozen tokens of random text and then closes its reasoning, or sometimes ends in
it; what the grammar allows after ``</think>`` is the grammar's doing alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import ARCHS, TINY, write_tokenizer

START, END = "<think>", "</think>"
# Qwen3's switch: thinking off closes an empty reasoning in the prompt
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def closers(vocab: int) -> list[int]:
    """The tokens after which </think> (and EOS) are likely: one in eight."""
    return list(range(5, vocab, 8))


def write_thinking_checkpoint(path: Path, end_logit: float = 6.8, eos_logit: float = 5.0,
                              start_logit: float = 0.5) -> Path:
    """After a closer the logits of </think> and EOS are ``end_logit`` and ``eos_logit`` (0
    after other tokens), ``<think>``'s about ``start_logit`` after any token, and the
    others' random (standard deviation 0.5): with 384 tokens, </think> follows a closer
    about 60% of the time and EOS 10%."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(START, normalized=False), AddedToken(END, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TEMPLATE}))
    start, end, eos = tok.token_to_id(START), tok.token_to_id(END), tok.token_to_id("</s>")

    cfg = {**TINY, **ARCHS["llama"]}
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    # embeddings [s R, R, r] with r random of norm R, s = 1 for a closer, else 0: the normed
    # hidden state (norm sqrt(hidden)) has x = sqrt(hidden / 3) in dimensions 0 and 1 after
    # a closer, 0 and sqrt(hidden / 2) after other tokens
    emb = torch.randn(vocab, hidden)
    emb[:, :2] = 0.0
    norm = emb.norm(dim=1)
    emb[:, 1] = norm
    emb[closers(vocab), 0] = norm[closers(vocab)]
    x = (hidden / 3) ** 0.5
    head = torch.randn(vocab, hidden) * 0.5 / (hidden ** 0.5)
    head[:, :2] = 0.0
    head[end], head[eos], head[start] = 0.0, 0.0, 0.0
    head[end, 0], head[eos, 0], head[start, 1] = end_logit / x, eos_logit / x, start_logit / x
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path, safe_serialization=True)
    return path
