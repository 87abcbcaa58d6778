"""Keep Python's garbage collector off the objects a serving process starts with, and
out of the bursts of one serving step.

A loaded engine process tracks about 210,000 objects (torch, the tokenizer, the
model's modules, FastAPI's schemas in the server); a full collection walks them
all: 110-125 ms on the 2-core CPU, twice in a 66-step SmolLM2 run there, and more
often under a server's allocation rate, each one a pause of the engine's step loop
or the server's event loop. ``gc.freeze`` moves every object alive now to a
generation the collector never scans, so later collections walk only what serving
allocates. Only for processes (or runs) that live on with what they built: frozen
objects in a reference cycle are never reclaimed until ``unfreeze_heap``.

Serving allocates in bursts that the next moment frees: the API server decodes one
engine step's outputs for 512 streams (about 9 objects each) before its stream tasks
run and drop the previous ones. At Python's default (a young collection every 700
objects allocated and not yet freed) that was 3-4 young collections per step, each
promoting the outputs in flight, so that full collections of the ~200,000 objects of
1,000 requests in flight followed every ~0.6 s (90-190 ms pauses): 7.9 of the API
process's 26.2 CPU seconds in two 512-stream runs on a 16-core host (the engine paced at
9 ms per step), while streams got the tokens of 2-3 steps per chunk. ``YOUNG_THRESHOLD``
lets a step's burst come and go without a collection (a 256-stream run on the 2-core
CPU: 98 collections and 0.2 CPU seconds instead of 2,400 and 4.0); the collector still
runs when garbage piles up, cycles included.
"""

from __future__ import annotations

import gc
from typing import Optional

# objects allocated and not yet freed before a young collection, in a process that froze its heap:
# several steps' bursts of a 512-stream server (Python's default: 700)
YOUNG_THRESHOLD = 20_000

_thresholds: Optional[tuple[int, ...]] = None  # the collector's thresholds before freeze_heap


def freeze_heap() -> int:
    """Collect once, then freeze every surviving object and raise the young generation's
    threshold to ``YOUNG_THRESHOLD``; returns how many objects are frozen."""
    global _thresholds
    gc.collect()
    gc.freeze()
    if _thresholds is None:
        _thresholds = gc.get_threshold()
    young, *older = _thresholds
    gc.set_threshold(max(young, YOUNG_THRESHOLD), *older)
    return gc.get_freeze_count()


def unfreeze_heap() -> None:
    """Give the frozen objects back to the collector and restore its thresholds (before
    dropping an engine in a process that goes on, so its reference cycles can be reclaimed)."""
    global _thresholds
    gc.unfreeze()
    if _thresholds is not None:
        gc.set_threshold(*_thresholds)
        _thresholds = None
