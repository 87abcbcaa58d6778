"""freeze_heap / unfreeze_heap: what the collector scans after a serving process has started."""

from __future__ import annotations

import gc
import sys
import weakref

from ingot.engine.heap import freeze_heap, unfreeze_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # reclaimable only by the cycle collector


def test_objects_alive_at_freeze_are_left_alone_until_unfrozen():
    unfreeze_heap()
    old = _Cycle()
    old_ref = weakref.ref(old)
    interval = sys.getswitchinterval()
    try:
        # no other thread runs between the freeze and the count (a thread left behind by another
        # test that drops a frozen object would shrink the count in between)
        sys.setswitchinterval(60.0)
        try:
            frozen = freeze_heap()
            assert frozen == gc.get_freeze_count() > 0
        finally:
            sys.setswitchinterval(interval)
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


def test_young_threshold_is_raised_while_frozen_and_restored_after():
    """A serving step's burst of outputs (thousands of objects freed soon after) must not
    trigger young collections: the threshold is YOUNG_THRESHOLD while the heap is frozen, and
    whatever it was before once unfrozen."""
    from ingot.engine.heap import YOUNG_THRESHOLD

    unfreeze_heap()
    before = gc.get_threshold()
    gc.set_threshold(123, *before[1:])
    try:
        freeze_heap()
        freeze_heap()  # twice (a bench run after a server start): still restored to 123 below
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert YOUNG_THRESHOLD >= 9 * 512 * 2  # two steps' outputs of 512 streams, ~9 objects each
        unfreeze_heap()
        assert gc.get_threshold() == (123, *before[1:])
    finally:
        unfreeze_heap()
        gc.set_threshold(*before)
