"""ModelRunner.weight_bytes: what the load log reports as the weights' memory."""

from types import SimpleNamespace

import torch
from torch import nn

from ingot.runner.model_runner import ModelRunner


def test_weight_bytes_counts_each_storage_once_and_buffers_as_stored():
    model = nn.Module()
    model.embed = nn.Embedding(10, 4)  # fp32: 160 bytes
    model.head = nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight  # tied: counted once
    model.register_buffer("qweight", torch.zeros(6, 2, dtype=torch.int32))  # packed int4: 48 bytes
    model.register_buffer("scales", torch.zeros(6, 1, dtype=torch.float16))  # 12 bytes
    runner = SimpleNamespace(model=model, device=torch.device("cpu"))
    assert ModelRunner.weight_bytes(runner) == 160 + 48 + 12
    assert ModelRunner.weight_bytes(SimpleNamespace(model=model, device=torch.device("meta"))) == 0
