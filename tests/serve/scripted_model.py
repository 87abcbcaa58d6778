"""A tiny checkpoint whose greedy reply is a script: each token's successor is fixed.

Its attention and MLP write nothing to the residual stream (``o_proj`` and ``down_proj``
are zero), so the last hidden state is the current token's embedding; those of the
scripted tokens are orthonormal and the lm_head maps each to its successor. The
script's pieces are added tokens, so a reply is a few whole pieces: the last token of
the prompt (a trigger word ending the last message) picks which script runs. Greedy
replies are therefore known exactly, which is what the parsers of reasoning and tool
calls need to be tested through a real server.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import ARCHS, TINY, write_tokenizer

EOS = "</s>"
SCRIPTS = {
    "[think]": ["<think>", "Let me think.", "</think>", "The answer is 4.", EOS],
    "[tool]": ["<tool_call>", '\n{"name": "get_weather", "arguments": ', '{"city": "Paris"}', "}\n", "</tool_call>", EOS],
    "[plain]": ["It is sunny in Paris.", EOS],
}
# after </think> in the prompt (thinking turned off), the answer starts at once
SCRIPTS["</think>"] = SCRIPTS["[think]"][3:]

# ChatML with a tool section (so tools reach the template, not the system prompt), replies
# written from the last message's end (its trigger word), and Qwen3's enable_thinking switch
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}{% if not loop.last %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
)


def reply(trigger: str) -> str:
    """The text the model writes after a prompt ending with ``trigger``."""
    return "".join(p for p in SCRIPTS[trigger] if p != EOS)


def write_scripted_checkpoint(path: Path) -> Path:
    import transformers
    from tokenizers import AddedToken, Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    pieces = sorted({p for script in SCRIPTS.values() for p in script if p != EOS} | set(SCRIPTS) | {"<think>", "</think>"})
    tok.add_tokens([AddedToken(p, normalized=False) for p in pieces])
    tok.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TEMPLATE}))
    ids = {p: tok.token_to_id(p) for p in [*pieces, EOS]}

    cfg = {**TINY, **ARCHS["llama"]}
    assert max(ids.values()) < cfg["vocab_size"]
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    successors = {}
    for trigger, script in SCRIPTS.items():
        chain = [trigger, *script]
        successors.update({ids[a]: ids[b] for a, b in zip(chain, chain[1:])})
    hidden = cfg["hidden_size"]
    basis, _ = torch.linalg.qr(torch.randn(hidden, hidden))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for k, (token, successor) in enumerate(sorted(successors.items())):
            model.model.embed_tokens.weight[token] = basis[k]
            model.lm_head.weight[successor] += 5.0 * basis[k]
    model.save_pretrained(path, safe_serialization=True)
    return path
