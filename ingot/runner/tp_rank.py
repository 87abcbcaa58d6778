"""RankState: what every rank of a tensor-parallel group runs, in the same order.

The driver (rank 0, ``tp_runner.py``) and each worker (``tp_worker.py``) hold
one: a ``ModelRunner`` over the rank's shard and the rank's ``StepChannel``.
Steps run ``ModelRunner.run_model`` on the broadcast inputs; calls (sizing and
allocating the KV pool, capturing graphs, and whatever a tool on top runs
through ``Executor.run_on_ranks``) are a pickled function the driver sends and
every rank applies to its own runner. Any collective inside them therefore
meets its counterpart on every rank.
"""

from __future__ import annotations

from ingot.distributed.collectives import broadcast_object, min_over_ranks
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_channel import Kind, StepChannel


class RankState:
    def __init__(self, runner: ModelRunner, channel: StepChannel) -> None:
        self.runner = runner
        self.channel = channel
        self.tp = runner.tp

    def serve(self) -> None:
        """A worker's loop: mirror the driver until it says stop."""
        while True:
            kind, inputs, spans = self.channel.receive()
            if kind is Kind.STOP:
                return
            if kind is Kind.CALL:
                fn, args = broadcast_object(None, self.tp)
                fn(self.runner, *args)
            else:
                self.runner.run_model(inputs, spans)


def min_kv_blocks(runner: ModelRunner) -> int:
    """The KV blocks every rank can hold (each sizes its own pool from its own memory)."""
    return min_over_ranks(runner.num_kv_blocks(), runner.tp, runner.device)
