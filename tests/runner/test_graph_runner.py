"""Decode graph runner on CPU through the fake-capture path (padding, buffers, laziness)."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.runner import graph_runner
from ingot.runner.graph_runner import capture_sizes, default_buckets, verify_buckets
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("g") / "qwen3", "qwen3")


def make(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=8, **kw)


PROMPTS = ["hello world", "the quick brown fox jumps", "def f(x): return", "Hello", "lazy dog. The quick"]


def test_default_buckets():
    assert default_buckets(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert default_buckets(3) == [1, 2, 3]
    assert default_buckets(300)[-3:] == [256, 288, 300]
    assert default_buckets(512)[-9:] == [256, 288, 320, 352, 384, 416, 448, 480, 512]
    assert capture_sizes(EngineConfig(max_num_seqs=16, cudagraph_capture_sizes=(4, 32))) == [4]
    assert capture_sizes(EngineConfig(max_num_seqs=16, cudagraph_capture_sizes=(32,))) == [16]


def test_verify_buckets():
    assert verify_buckets(2) == [2]
    assert verify_buckets(20) == [2, 3, 4, 6, 8, 12, 16, 20]
    assert verify_buckets(160) == [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160]
    assert verify_buckets(192)[-3:] == [96, 128, 192]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    assert EngineConfig(max_num_seqs=256, speculative_config=spec).max_verify_rows == 32 * 5  # disable_by_batch_size
    assert EngineConfig(max_num_seqs=3, speculative_config=spec).max_verify_rows == 15
    assert EngineConfig(max_num_seqs=3).max_verify_rows == 0


def test_verify_graphs_only_with_speculation_and_in_the_decode_graphs_pool(tiny, cpu_buckets, monkeypatch):
    """Verify graphs are a set of their own, made with speculative decoding only; the set with
    the largest bucket captures first and the other captures into its pool."""
    assert make(tiny).engine.executor.verify_graphs is None
    order = []
    real = graph_runner.DecodeGraphRunner.capture_all

    def capture_all(self):
        order.append((self.store_first, self.pool))
        real(self)
        self.pool = f"pool of {'verify' if self.store_first else 'decode'}"  # (CPU: no pool of its own)

    monkeypatch.setattr(graph_runner.DecodeGraphRunner, "capture_all", capture_all)
    runner = make(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 2}).engine.executor
    assert runner.graphs.buckets == [1, 2, 4, 8] and runner.verify_graphs.buckets == [2, 3, 4, 6, 8, 12, 16, 24]
    assert runner.verify_graphs.store_first and not runner.graphs.store_first
    assert order == [(True, None), (False, "pool of verify")]  # 24 verify rows > 8 decode rows


def test_no_graphs_on_cpu_without_fake(tiny, monkeypatch):
    llm = make(tiny)
    assert llm.engine.executor.graphs is None
    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
    assert make(tiny, eager_mode=True).engine.executor.graphs is None


def test_fake_capture_padded_path_matches_unpadded(tiny, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in make(tiny, eager_mode=True).generate(PROMPTS, params)]
    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
    llm = make(tiny)
    runner = llm.engine.executor.graphs
    assert runner is not None and runner.buckets == [1, 2, 4, 8]
    calls = []
    real_run = runner.run
    monkeypatch.setattr(runner, "run", lambda inputs: calls.append(inputs.num_seqs) or real_run(inputs))
    padded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert padded == eager
    assert calls and set(calls) == {5}, "decode steps of 5 sequences ran the bucket-8 padded path"


def test_padding_rows_only_touch_the_dummy_block(tiny, cpu_buckets):
    llm = make(tiny, num_kv_blocks=64)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    used_blocks = llm.engine.executor.kv.block_usage().nonzero().flatten().tolist()
    # 3 prompts of < 16 tokens + 8 outputs: at most 2 blocks each, handed out from 1 upwards
    assert max(used_blocks) <= 6
    assert 0 in used_blocks, "padded rows wrote their K/V into the dummy block"


def test_compiled_forward_built_lazily_once_and_never_for_prefill(tiny, monkeypatch, cpu_buckets):
    built = []
    calls = []

    def fake_build(forward, config, device):
        built.append(config.decode_compile)

        def spy(*args):
            calls.append(args[0].shape[0])
            return forward(*args)

        spy.compiled = True
        return spy

    monkeypatch.setattr(graph_runner.decode_compile, "build_decode_forward", fake_build)
    llm = make(tiny, decode_compile=True)
    assert built == [True], "built once, at capture"
    assert sorted(calls) == sorted([1, 1, 2, 2, 4, 4, 8, 8]), "two warm-up calls per bucket"
    calls.clear()
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert calls == [2] * 4, "only the 4 decode steps (the first token comes from prefill)"
    assert built == [True]


def test_lazy_build_not_called_without_graphs(tiny, monkeypatch):
    monkeypatch.setattr(graph_runner.decode_compile, "build_decode_forward", lambda *a: pytest.fail("built"))
    make(tiny, decode_compile=True)  # CPU, no fake capture: the raw model only


def test_fake_capture_of_every_default_bucket_runs_no_warm_up_forward(tiny, monkeypatch, cpu_buckets):
    """Fake capture on CPU with the default 35 buckets (up to 256 rows) must not
    run each bucket's forward: there is no graph to capture, so start-up stays quick."""
    calls = []
    real = graph_runner.make_decode_forward

    def counting(model, policy, store_first=False, logits=True):
        forward = real(model, policy, store_first, logits)
        return lambda *args: calls.append(args[0].shape[0]) or forward(*args)

    monkeypatch.setattr(graph_runner, "make_decode_forward", counting)
    llm = LLM(str(tiny), dtype="float32", device="cpu", show_progress=False)
    assert len(llm.engine.executor.graphs.entries) == len(default_buckets(256)) and calls == []
    out = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert calls == [4, 4, 4] and all(len(o.outputs[0].token_ids) == 4 for o in out)  # the bucket of 3 rows
    llm.shutdown()
