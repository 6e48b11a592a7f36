"""The cyclic garbage collector for long-lived servers: fewer, cheaper collections.

Invariants: only ever called once a process has imported what it serves with (the objects
frozen then are never collected: modules, classes, the model's tables); it changes when the
collector runs, never what it frees.
"""

from __future__ import annotations

import gc

# objects allocated between young collections: a server's per-request garbage is mostly
# freed by reference counting, so a young collection every 700 allocations is wasted work
SERVER_GC_THRESHOLD = (20_000, 20, 20)


def settle_heap() -> None:
    """Collect once, move every surviving object out of the collector's generations
    (``gc.freeze``: an old collection no longer walks the imported world), and raise the
    young-generation threshold.  For a process about to serve requests."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLD)


__all__ = ["SERVER_GC_THRESHOLD", "settle_heap"]
