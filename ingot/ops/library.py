"""The ``torch.ops.ingot.*`` custom ops, made from the declarations in reference.py (and reference_mla.py,
reference_geglu.py).

A model never calls a kernel directly; it calls these ops. To Dynamo/Inductor
each one is a single opaque node with a fake (meta) implementation, so compile
neither breaks the graph nor traces into a Triton launcher, and an outer CUDA
graph records the launch. Each op's schema is inferred from its reference
function's annotations, which is also its default implementation; CUDA kernels
are registered per op by ``ingot.ops.triton.register_cuda_kernels``.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

from torch.library import CustomOpDef, custom_op, infer_schema

from ingot.ops import reference, reference_geglu, reference_mla  # noqa: F401 - each module declares its ops on import


def _define(name: str, decl: reference.OpDecl) -> CustomOpDef:
    module = sys.modules[decl.reference.__module__]  # reference.py, or the file that declared it

    def run_reference(*args: Any, **kwargs: Any) -> Any:
        # looked up per call, like any Python call site: patching ``<module>.<name>`` patches the op
        return getattr(module, name)(*args, **kwargs)

    schema = infer_schema(decl.reference, mutates_args=decl.mutates_args)
    op = custom_op(f"ingot::{name}", run_reference, mutates_args=decl.mutates_args, schema=schema)
    op.register_fake(decl.fake)
    return op


# name -> op: ``OPS["rms_norm"]`` defines ``torch.ops.ingot.rms_norm`` (its register_kernel, ...)
OPS: dict[str, CustomOpDef] = {name: _define(name, decl) for name, decl in reference.DECLARED.items()}


def schema_lines() -> list[str]:
    """Every ingot op's schema, one line each, sorted."""
    import torch

    return sorted(str(getattr(torch.ops.ingot, name).default._schema) for name in OPS)


def schema_digest() -> str:
    """A digest of the ops' schemas. Code that Inductor compiled around the ops calls them with
    these arguments, so its on-disk caches are only valid for them (``decode_compile`` puts the
    digest in the compile cache key)."""
    return hashlib.sha256("\n".join(schema_lines()).encode()).hexdigest()[:16]
