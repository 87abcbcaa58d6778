"""freeze_heap / unfreeze_heap: what the collector scans after a serving process has started."""

from __future__ import annotations

import gc
import weakref

from ingot.engine.heap import freeze_heap, unfreeze_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # reclaimable only by the cycle collector


def test_objects_alive_at_freeze_are_left_alone_until_unfrozen():
    unfreeze_heap()
    old = _Cycle()
    old_ref = weakref.ref(old)
    try:
        assert freeze_heap() == gc.get_freeze_count() > 0
        young = _Cycle()
        young_ref = weakref.ref(young)
        del old, young
        gc.collect()
        assert young_ref() is None  # built after the freeze: collected as usual
        assert old_ref() is not None  # frozen: never scanned, so its cycle survives
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # reclaimed once given back to the collector
