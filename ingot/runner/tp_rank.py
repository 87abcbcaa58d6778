"""RankState: what every rank of a tensor-parallel group runs, in the same order.

The driver (rank 0, ``tp_runner.py``) and each worker (``tp_worker.py``) hold
one: a ``ModelRunner`` over the rank's shard, the rank's ``StepChannel`` and
the decode-graph variants built so far. Control calls (sizing and allocating
the KV pool, capturing graphs, building or dropping a variant, choosing which
graphs serve) are methods here that the driver names in a CALL message and
every rank runs; steps run ``ModelRunner.run_model`` (or ``logits_of`` for a
variant) on the broadcast inputs. Any collective inside them therefore meets
its counterpart on every rank.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional

from ingot.config import EngineConfig
from ingot.distributed.collectives import broadcast_object, min_over_ranks
from ingot.runner.graph_runner import DecodeGraphRunner
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_channel import Kind, StepChannel

log = logging.getLogger(__name__)

ENGINE_GRAPHS = 0  # variant id of the engine's own decode graphs
RAW = -1  # "variant" id of the raw forward (no graphs)

# the control calls a driver may name (every rank runs the method of that name)
CALLS = frozenset({"num_kv_blocks", "allocate_kv_cache", "setup_decode_graphs", "decode_variant", "drop_variant", "use_graphs"})


class RankState:
    def __init__(self, runner: ModelRunner, channel: StepChannel) -> None:
        self.runner = runner
        self.channel = channel
        self.tp = runner.tp
        self.variants: dict[int, DecodeGraphRunner] = {}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ control calls
    def num_kv_blocks(self) -> int:
        """The KV blocks every rank can hold (each sizes its own pool from its own memory)."""
        return min_over_ranks(self.runner.num_kv_blocks(), self.tp, self.runner.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def setup_decode_graphs(self, max_blocks_per_seq: int) -> None:
        self.runner.setup_decode_graphs(max_blocks_per_seq)
        if self.runner.graphs is not None:
            self.variants[ENGINE_GRAPHS] = self.runner.graphs

    def decode_variant(self, config: EngineConfig, max_blocks_per_seq: int) -> int:
        vid = next(self._ids)
        self.variants[vid] = self.runner.decode_variant(config, max_blocks_per_seq)
        return vid

    def drop_variant(self, vid: int) -> None:
        graphs = self.variants.pop(vid, None)
        if graphs is not None and self.runner.graphs is graphs:
            self.runner.graphs = self.variants.get(ENGINE_GRAPHS)

    def use_graphs(self, vid: int) -> None:
        """Let engine steps replay variant ``vid`` (``RAW``: no graphs)."""
        self.runner.graphs = self.variants.get(vid)

    def variant_id(self, graphs: Optional[DecodeGraphRunner]) -> int:
        if graphs is None:
            return RAW
        for vid, g in self.variants.items():
            if g is graphs:
                return vid
        raise ValueError("these decode graphs were not built through the tensor-parallel runner")

    def call(self, method: str, args: tuple) -> Any:
        if method not in CALLS:
            raise ValueError(f"unknown tensor-parallel control call {method!r}")
        return getattr(self, method)(*args)

    # ------------------------------------------------------------------ workers
    def serve(self) -> None:
        """A worker's loop: mirror the driver until it says stop."""
        while True:
            kind, arg, inputs, spans = self.channel.receive()
            if kind is Kind.STOP:
                return
            if kind is Kind.CALL:
                method, args = broadcast_object(None, self.tp)
                self.call(method, args)
            elif kind is Kind.STEP:
                self.runner.run_model(inputs, spans)
            else:
                self.runner.logits_of(self.variants.get(arg), inputs)
