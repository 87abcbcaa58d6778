"""Fault injection for spawned tensor-parallel workers: on PYTHONPATH (a test sets it) every new
interpreter runs this; with ``INGOT_TEST_LOAD_FAULT_RANK=R`` in the environment, rank R's
loading of its shard raises, as a worker whose checkpoint read fails would."""

import os

_RANK = os.environ.get("INGOT_TEST_LOAD_FAULT_RANK")
if _RANK is not None:
    import ingot.runner.tp_worker as _worker

    _load = _worker.load_checkpoint

    def _faulty_load(*args, tp, **kwargs):
        if tp.rank == int(_RANK):
            raise RuntimeError(f"injected fault on rank {tp.rank} while loading")
        return _load(*args, tp=tp, **kwargs)

    _worker.load_checkpoint = _faulty_load
