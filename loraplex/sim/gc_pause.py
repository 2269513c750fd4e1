"""Pause Python's cyclic garbage collector while the twin runs.

A twin run allocates millions of short-lived, acyclic messages per step (freed at once by reference
counting) and keeps every request alive until the end. The cyclic collector's full passes rescan that
growing set of live requests and find next to nothing: about a tenth of a 64-server run. Results do
not depend on it. A finished run's servers are cyclic garbage, though (a prefix tree's nodes point
at their parents), and they sit in the oldest generation, which is collected rarely: so the outermost
block starts with a full collection, or a search that runs the twin again and again (a rate search,
the planner) would keep every earlier run's servers.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; restore what was set before on the way out."""
    was_enabled = gc.isenabled()
    if was_enabled:  # the outermost block: free what earlier runs left (nested ones find it done)
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        # Move what the run left alive into the oldest generation as it is, so the first collection
        # after the block does not trace all of it at once (freeze then unfreeze does exactly that).
        gc.freeze()
        gc.unfreeze()
        if was_enabled:
            gc.enable()
