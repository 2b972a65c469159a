"""The interpreter's garbage collector in a serving process.

Once a service has loaded its models and captured its graphs, its heap holds a few hundred
thousand long-lived objects (modules, the model's parameters and buffers, graphs). Every
full collection walks all of them: about 0.1 s on a 2-core machine, during which no round
advances. `freeze_startup_heap` moves them out of the collector's sight for good, so later
collections walk only what serving allocates, and lets young objects pile up longer before
a collection (a step allocates thousands, nearly all freed by reference counting), so that
fewer collections run and fewer short-lived objects survive into the older generations.
"""
from __future__ import annotations

import atexit
import gc

# Allocations (less deallocations) between collections of the youngest generation; 700 by default.
YOUNG_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Collect once, then exempt everything alive from later collections (`gc.freeze`) until
    the interpreter exits (its last collections then free them: native extensions check that)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
