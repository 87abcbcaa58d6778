"""`ingot bench decode --compare-hf` on CPU: the HF static-cache decode loop, model building and CLI wiring."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from ingot.loading import dummy
from ingot.bench import decode_cli, hf_compare
from ingot.bench.decode import BucketTiming
from ingot.bench.decode_cli import DecodeBench
from ingot.bench.floor import ModelBytes
from ingot.cli import build_parser
from tests.helpers import TINY, write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")


def _transformers():
    """The module hf_compare imports now: transformers can swap its lazy module in sys.modules after first use."""
    return hf_compare.require_transformers()
FAKE_SHAPE = "tiny-qwen2-test"
FAKE_FIELDS = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2")
    return hf_compare.build_hf_model(str(path), None, torch.float32, CPU)


@pytest.fixture
def fake_shape(monkeypatch):
    monkeypatch.setitem(dummy.SHAPES, FAKE_SHAPE, FAKE_FIELDS)
    return FAKE_SHAPE


def _full_forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# ---------------------------------------------------------------------- the decode loop
@pytest.mark.parametrize("prefill_tokens", [hf_compare.PREFILL_TOKENS, 6])  # one prefill call; chunks of 3 tokens x 2 rows
def test_decode_logits_match_full_forward(tiny_qwen2, prefill_tokens):
    """Every decode step's logits equal the last position of a no-cache forward over the same tokens:
    the cache positions advance correctly (also across a chunked prefill)."""
    torch.manual_seed(0)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 7))
    tokens = torch.randint(0, TINY["vocab_size"], (2, 4))
    steps = hf_compare.hf_decode_logits(tiny_qwen2, prompt, tokens, prefill_tokens=prefill_tokens)
    assert steps.shape == (4, 2, TINY["vocab_size"])
    full = _full_forward_logits(tiny_qwen2, torch.cat([prompt, tokens], 1))
    for i in range(4):
        ref = _full_forward_logits(tiny_qwen2, torch.cat([prompt, tokens[:, :i + 1]], 1))[:, -1]
        torch.testing.assert_close(steps[i], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(steps[i], full[:, 7 + i], atol=1e-4, rtol=1e-4)


def test_decode_logits_compiled_matches(tiny_qwen2):
    """compile=True on CPU: the eager dynamo backend, fullgraph, so the forward traces as one graph."""
    torch.manual_seed(1)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5))
    tokens = torch.randint(0, TINY["vocab_size"], (2, 3))
    try:
        compiled = hf_compare.hf_decode_logits(tiny_qwen2, prompt, tokens, compile=True)
    finally:
        torch._dynamo.reset()
    eager = hf_compare.hf_decode_logits(tiny_qwen2, prompt, tokens, compile=False)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_decoder_refuses_positions_past_the_cache(tiny_qwen2):
    dec = hf_compare.HFDecoder(tiny_qwen2, batch=1, max_cache_len=4)
    dec.prefill(torch.tensor([[3, 4, 5]]))
    dec.step(torch.tensor([6]))
    assert dec.pos == 4
    with pytest.raises(hf_compare.HFCompareError, match="past the static cache"):
        dec.step(torch.tensor([7]))


def test_hf_decode_ms_positive(tiny_qwen2):
    ms = hf_compare.hf_decode_ms(tiny_qwen2, batch=2, context_len=8, iters=3, compile=False)
    assert isinstance(ms, float) and ms > 0
    t = hf_compare.time_hf_decode(tiny_qwen2, 1, 4, 2, compile=False, warmup=1)
    assert t.ms > 0 and t.warmup_s >= 0


# ---------------------------------------------------------------------- static cache / forward signatures
class _OldStaticCache:
    """The pre-4.56 signature: batch size, device and dtype up front."""

    def __init__(self, config, max_batch_size, max_cache_len, device=None, dtype=None):
        self.args = dict(config=config, max_batch_size=max_batch_size, max_cache_len=max_cache_len, device=device, dtype=dtype)


def test_make_static_cache_old_signature(monkeypatch):
    monkeypatch.setattr(_transformers(), "StaticCache", _OldStaticCache)
    model = SimpleNamespace(config="cfg")
    cache = hf_compare.make_static_cache(model, 8, 100, CPU, torch.bfloat16)
    assert cache.args == dict(config="cfg", max_batch_size=8, max_cache_len=100, device=CPU, dtype=torch.bfloat16)


def test_make_static_cache_installed_signature(tiny_qwen2):
    cache = hf_compare.make_static_cache(tiny_qwen2, 2, 32, CPU, torch.float32)
    assert isinstance(cache, _transformers().StaticCache)


class _OldApiModel(torch.nn.Module):
    """A forward with past_key_values + cache_position, as transformers had before its cache kept the position."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace()
        self.calls = []

    def forward(self, input_ids=None, past_key_values=None, cache_position=None, use_cache=None, logits_to_keep=0):
        self.calls.append((input_ids.shape[1], cache_position.tolist(), logits_to_keep))
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], 5))


def test_decoder_passes_cache_positions_on_old_api(monkeypatch):
    monkeypatch.setattr(_transformers(), "StaticCache", _OldStaticCache)
    model = _OldApiModel()
    dec = hf_compare.HFDecoder(model, batch=2, max_cache_len=10, prefill_tokens=6)
    assert dec.cache_kw == "past_key_values" and dec.explicit_positions and dec.keep_kw == "logits_to_keep"
    dec.prefill(torch.zeros(2, 5, dtype=torch.long))
    dec.step(torch.zeros(2, dtype=torch.long))
    dec.step(torch.zeros(2, dtype=torch.long))
    assert model.calls == [(3, [0, 1, 2], 1), (2, [3, 4], 1), (1, [5], 0), (1, [6], 0)]


# ---------------------------------------------------------------------- building the model
def test_model_type_for():
    assert hf_compare.model_type_for("Qwen2ForCausalLM") == "qwen2"
    assert hf_compare.model_type_for("LlamaForCausalLM") == "llama"
    with pytest.raises(hf_compare.HFCompareError):
        hf_compare.model_type_for("NoSuchForCausalLM")


def test_build_hf_model_for_shape(fake_shape):
    model = hf_compare.build_hf_model(None, fake_shape, torch.float32, CPU)
    cfg = model.config
    assert cfg.model_type == "qwen2" and type(model).__name__ == "Qwen2ForCausalLM"
    for key, value in FAKE_FIELDS.items():
        if key == "rope_theta" and hasattr(cfg, "rope_parameters"):  # transformers 5 keeps it in rope_parameters
            assert cfg.rope_parameters["rope_theta"] == value
        elif key != "architectures":
            assert getattr(cfg, key) == value, key
    assert model.model.embed_tokens.weight.shape == (320, 64)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert next(model.parameters()).dtype == torch.float32 and not model.training


def test_build_hf_model_shape_for_every_benchmark_shape():
    """The real shapes map to transformers configs (no model is built: that takes GBs)."""
    for shape, fields in dummy.SHAPES.items():
        cfg = hf_compare.hf_config_for_shape(shape)
        assert cfg.hidden_size == fields["hidden_size"] and cfg.num_hidden_layers == fields["num_hidden_layers"], shape


def test_build_hf_model_gguf_path(tmp_path, monkeypatch):
    gguf = tmp_path / "m.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    seen = {}

    class _Model(torch.nn.Linear):
        pass

    def fake_from_pretrained(src, **kw):
        seen.update(src=src, **kw)
        return _Model(2, 2)

    monkeypatch.setattr(_transformers().AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    hf_compare.build_hf_model(str(gguf), None, torch.float32, CPU)
    assert seen["src"] == str(tmp_path) and seen["gguf_file"] == gguf.name and seen["dtype"] == torch.float32


def test_missing_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(hf_compare.HFCompareError, match="pip install transformers"):
        hf_compare.require_transformers()


# ---------------------------------------------------------------------- CLI wiring
def test_parser_accepts_compare_hf():
    assert build_parser().parse_args(["bench", "decode"]).compare_hf is False
    args = build_parser().parse_args(["bench", "decode", "--shape", "qwen2.5-7b", "--compare-hf"])
    assert args.compare_hf is True and args.shape == "qwen2.5-7b"


def _bench(batches):
    return DecodeBench(
        source="test", dtype="float32", context_len=8, iters=2, decode_compile="off", modes=["eager", "graph"],
        bandwidth=1e12, model_bytes=ModelBytes(1000, 2, 2, 16, 4),
        rows=[BucketTiming(b, ms={"eager": 2.0, "graph": 1.0}) for b in batches],
    )


def test_add_hf_mode_adds_a_mode(fake_shape):
    bench = _bench([1, 2])
    args = SimpleNamespace(model=None, shape=fake_shape, context_len=8, iters=2)
    try:
        assert hf_compare.add_hf_mode(bench, args, CPU, torch.float32)
    finally:
        torch._dynamo.reset()
    assert bench.modes == ["eager", "graph", hf_compare.HF_MODE]
    for row in bench.rows:
        assert row.ms[hf_compare.HF_MODE] > 0 and row.warmup_s[hf_compare.HF_MODE] >= 0
    assert bench.env["transformers"] == transformers.__version__
    summary = decode_cli.summarize(bench)
    m = summary[0]["modes"][hf_compare.HF_MODE]
    assert m["speedup_vs_graph"] == pytest.approx(1.0 / m["ms"])  # the vs-graph column covers it
    assert hf_compare.HF_MODE in decode_cli.to_json(bench)["modes"]


def test_add_hf_mode_warns_and_goes_on(monkeypatch, capsys):
    def boom(*a, **k):
        raise ValueError("no such model type")

    monkeypatch.setattr(hf_compare, "build_hf_model", boom)
    bench = _bench([1])
    args = SimpleNamespace(model="some/dir", shape=None, context_len=8, iters=2)
    assert not hf_compare.add_hf_mode(bench, args, CPU, torch.float32)
    assert bench.modes == ["eager", "graph"] and hf_compare.HF_MODE not in bench.rows[0].ms
    assert "warning: --compare-hf" in capsys.readouterr().err


def test_add_hf_mode_skips_a_failing_batch(monkeypatch, capsys, fake_shape):
    real = hf_compare.time_hf_decode

    def flaky(model, batch, *a, **k):
        if batch == 2:
            raise RuntimeError("CUDA out of memory")
        return real(model, batch, *a, **{**k, "compile": False})

    monkeypatch.setattr(hf_compare, "time_hf_decode", flaky)
    bench = _bench([1, 2])
    args = SimpleNamespace(model=None, shape=fake_shape, context_len=8, iters=2)
    assert hf_compare.add_hf_mode(bench, args, CPU, torch.float32)
    assert hf_compare.HF_MODE in bench.rows[0].ms and hf_compare.HF_MODE not in bench.rows[1].ms
    assert "batch 2 skipped" in capsys.readouterr().err
    decode_cli.make_table(bench)  # a missing mode in one row still renders
