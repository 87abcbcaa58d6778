"""The decode compile's cache key names the ingot ops' schemas."""

from __future__ import annotations

import pytest

import ingot.ops  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.runner import decode_compile as dc


def test_compile_cache_key_names_the_op_schemas(monkeypatch):
    """A graph Inductor cached against other op schemas (an older ingot) must not be reused:
    configure_process puts the schemas' digest in torch.compile's cache key."""
    import torch.compiler.config as compiler_config

    from ingot.ops import library

    if not hasattr(compiler_config, "cache_key_tag"):
        pytest.skip("this PyTorch has no torch.compiler.config.cache_key_tag")
    digest = library.schema_digest()
    with compiler_config.patch(cache_key_tag="user-tag"):
        dc._tag_compile_caches()
        dc._tag_compile_caches()  # idempotent
        assert compiler_config.cache_key_tag == f"user-tag ingot-ops-{digest}"
    assert any("ingot::decode_attention_rope(" in line and "window" in line for line in library.schema_lines())
    lines = library.schema_lines()
    monkeypatch.setattr(library, "schema_lines", lambda: [*lines[:-1], lines[-1] + " "])
    assert library.schema_digest() != digest
