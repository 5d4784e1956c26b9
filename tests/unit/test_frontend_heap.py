"""The front-end process freezes what startup left alive, so that full collections while it serves do not walk it."""

import gc
import weakref

from tpgraph.server.frontend import freeze_startup_heap


class Node:
    pass


def test_startup_garbage_is_collected_and_what_lives_is_frozen_out_of_collections():
    garbage = Node()
    garbage.me = garbage  # (a cycle: only the collector frees it)
    gone = weakref.ref(garbage)
    del garbage
    kept = Node()
    try:
        freeze_startup_heap()
        assert gone() is None  # (collected first, not frozen for good)
        assert gc.get_freeze_count() > 0
        assert all(o is not kept for o in gc.get_objects())  # (no generation holds it: no collection walks it)
    finally:
        gc.unfreeze()
