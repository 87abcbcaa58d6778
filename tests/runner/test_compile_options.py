"""ingot.runner.compile_options (CPU): the Inductor options per PyTorch version, checked on
stand-ins of each release's config and on this torch's own, and the Dynamo limits' names."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.config as dynamo_config

from ingot.runner import compile_options as co
from tests.runner.compile_fixtures import clean_state  # noqa: F401  (autouse)


def ns(**kw) -> SimpleNamespace:
    return SimpleNamespace(**kw)


def resolve(config, dotted: str):
    return functools.reduce(getattr, dotted.split("."), config)


def fake_inductor(version: str) -> SimpleNamespace:
    """Namespaces shaped like torch._inductor.config of a PyTorch release (only the names we touch)."""
    cfg = ns(triton=ns(cudagraphs=True, cudagraph_trees=True), fallback_random=False, emulate_precision_casts=False)
    if version == "2.10":
        cfg.emulate_divison_rounding = False
        cfg.deterministic = False
    elif version == "2.11":
        cfg.eager_numerics = ns(division_rounding=False)
        cfg.deterministic = False
        cfg.triton.enable_pdl = False
    elif version == "2.14":
        cfg.eager_numerics = ns(division_rounding=False, disable_ftz=False, use_pytorch_libdevice=False)
        cfg.deterministic = False
        cfg.triton.enable_pdl = False
    return cfg


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.8", {"triton.cudagraphs": False, "emulate_precision_casts": True}),
        ("2.10", {"triton.cudagraphs": False, "emulate_precision_casts": True, "emulate_divison_rounding": True}),
        ("2.11", {"triton.cudagraphs": False, "emulate_precision_casts": True, "triton.enable_pdl": True,
                  "eager_numerics.division_rounding": True}),
        ("2.14", {"triton.cudagraphs": False, "emulate_precision_casts": True, "triton.enable_pdl": True,
                  "eager_numerics.division_rounding": True}),
    ],
)
def test_inductor_options_per_version(version, expected):
    cfg = fake_inductor(version)
    opts = co.inductor_options(cfg)
    assert opts == expected
    for key in opts:  # never a key the config lacks
        resolve(cfg, key)


def test_inductor_options_prefers_new_division_name_and_drops_unknowns():
    both = ns(emulate_divison_rounding=False, eager_numerics=ns(division_rounding=False))
    assert co.inductor_options(both) == {"eager_numerics.division_rounding": True}
    assert co.inductor_options(ns()) == {}
    # a sub-config without the leaf
    assert co.inductor_options(ns(triton=ns(), eager_numerics=ns())) == {}


def test_has_option_dotted():
    cfg = fake_inductor("2.14")
    assert co.has_option(cfg, "triton.cudagraphs")
    assert co.has_option(cfg, "eager_numerics.disable_ftz")
    assert not co.has_option(cfg, "eager_numerics.nope")
    assert not co.has_option(cfg, "nope.cudagraphs")


def test_inductor_options_real_config_resolve():
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    opts = co.inductor_options(inductor_config)
    assert opts["triton.cudagraphs"] is False
    for key in opts:
        resolve(inductor_config, key)
        assert key in known, key
    # Inductor validates options when torch.compile is called (no compile happens here)
    torch.compile(lambda x: x, backend="inductor", options=opts, dynamic=False)


def test_inductor_options_real_compile_on_cpu():
    """One real Inductor compile with every option this torch has (a matmul: no C++ kernel to build)."""
    import torch._inductor.config as inductor_config

    opts = co.inductor_options(inductor_config)
    fn = torch.compile(lambda a, b: a @ b, backend="inductor", options=opts, dynamic=False, fullgraph=True)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    torch.testing.assert_close(fn(a, b), a @ b)


def test_dynamo_limit_names():
    assert co.dynamo_limit_names(ns(recompile_limit=8, accumulated_recompile_limit=256)) == (
        "recompile_limit", "accumulated_recompile_limit")
    assert co.dynamo_limit_names(ns(recompile_limit=8)) == ("recompile_limit",)
    assert co.dynamo_limit_names(ns()) == ()
    assert co.dynamo_limit_names(dynamo_config) == ("recompile_limit", "accumulated_recompile_limit")
