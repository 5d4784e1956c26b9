"""The scheduler's WaitQueue against a plain list, operation by operation: every answer the same, over random mixes
of appends, inserts, in-order inserts, removes (at either end and in the middle), indices, deletes, re-queueing and
long runs of removes; and the ids it marks gone always those of sequences it still holds."""

import bisect
import random

import pytest

from tpgraph.engine.scheduler import WaitQueue


class Item:
    """A stand-in sequence: the queue only compares identities (and, in order, keys)."""

    def __init__(self, n: int, priority: int) -> None:
        self.n, self.priority = n, priority

    def __repr__(self) -> str:
        return f"Item({self.n})"


def key(item: Item) -> tuple[int, int]:
    return item.priority, item.n


def check_same(q: WaitQueue, ref: list) -> None:
    assert len(q) == len(ref) and bool(q) == bool(ref)
    assert [x.n for x in q] == [x.n for x in ref]
    assert q._queued == {id(s) for s in ref}
    gone = q._gone
    held = [id(s) for s in q._items]
    assert gone <= set(held), "an id marked gone that the queue no longer holds (it may be reused)"
    assert sum(i in gone for i in held) == len(gone)
    assert not gone or not set(held[:q._clean]) & gone, "a gone one inside the prefix said to hold none"


def pick_queued(rng: random.Random, ref: list) -> Item:
    where = rng.random()
    if where < 0.25:
        return ref[0]
    if where < 0.5:
        return ref[-1]
    return ref[rng.randrange(len(ref))]


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_wait_queue_answers_as_a_plain_list(seed, ordered):
    """fcfs uses append/insert, the priority policy insort alone (its queue stays in key order): each mix in turn."""
    rng = random.Random(seed)
    q, ref, out, made = WaitQueue(), [], [], 0
    burst, grow = 0, 0.3
    for step in range(3000):
        if step % 300 == 0:  # phases that fill the queue, and phases that empty it
            grow = rng.choice([0.2, 0.3, 0.5, 0.7])
        # op < 0.3: queue one; then take one out (0.3-0.6), index (-0.75), delete (-0.85), index out of range (-0.9)
        op = 0.0 if rng.random() < grow else 0.3 + 0.7 * rng.random()
        if burst:  # a long run of removes (a whole batch aborted), mostly in the middle
            burst -= 1
            op = 0.5
        elif rng.random() < 0.005:
            burst = rng.randrange(10, 200)
        if not ref:
            op = 0.0
        if op < 0.3:
            if out and rng.random() < 0.4:  # queued again (a preempted sequence, or one taken off earlier)
                s = out.pop(rng.randrange(len(out)))
            else:
                s, made = Item(made, rng.randrange(3)), made + 1
            if ordered:
                q.insort(s, key)
                bisect.insort(ref, s, key=key)
            elif rng.random() < 0.5:
                q.append(s)
                ref.append(s)
            else:
                i = rng.choice([0, 0, rng.randrange(len(ref) + 1), len(ref), len(ref) + 3])
                q.insert(i, s)
                ref.insert(i, s)
        elif op < 0.6:
            s = pick_queued(rng, ref)
            q.remove(s)
            ref.remove(s)
            out.append(s)
        elif op < 0.75:
            i = rng.choice([0, -1, rng.randrange(len(ref)), -1 - rng.randrange(len(ref))])
            assert q[i] is ref[i]
        elif op < 0.85:
            i = rng.choice([0, 0, rng.randrange(len(ref)), -1])
            out.append(ref[i])
            del q[i]
            del ref[i]
        elif op < 0.9:
            for i in (len(ref), -len(ref) - 1):
                with pytest.raises(IndexError):
                    q[i]
        if len(out) > 40:
            del out[:20]  # dropped by the test: their ids may be reused (CPython frees them at once)
        check_same(q, ref)


def test_taking_out_a_sequence_not_queued_is_refused_and_changes_nothing():
    """As a list's remove: one never queued, or already taken out (from either end or the middle), is a ValueError.
    Marked gone instead, it made the queue one shorter than it is, and its last sequence was never admitted."""
    a, b, c, d, never = (Item(i, 0) for i in range(5))
    q = WaitQueue()
    for s in (a, b, c, d):
        q.append(s)
    q.remove(d)
    q.remove(b)
    for s in (never, d, b):
        with pytest.raises(ValueError):
            q.remove(s)
        check_same(q, [a, c])
    del q[0]
    with pytest.raises(ValueError):
        q.remove(a)
    assert [s.n for s in q] == [2] and len(q) == 1 and q[0] is c


def test_queueing_a_sequence_twice_is_refused():
    """A sequence queued twice would be admitted twice: refused, as the scheduler never does it."""
    a, b = Item(0, 0), Item(1, 0)
    q = WaitQueue()
    q.append(a)
    q.append(b)
    for queue_again in (lambda: q.append(a), lambda: q.insert(0, b), lambda: q.insort(a, key)):
        with pytest.raises(ValueError):
            queue_again()
        check_same(q, [a, b])


class Observed(set):
    """A set that calls `look` just before and after each change: as a thread that reads the queue at that moment."""

    look = staticmethod(lambda: None)

    def add(self, x):
        self.look()
        super().add(x)
        self.look()

    def discard(self, x):
        self.look()
        super().discard(x)
        self.look()

    def clear(self):
        self.look()
        super().clear()
        self.look()


def test_len_read_from_another_thread_mid_change_is_the_count_before_or_after():
    """The engine's metrics read len(waiting) from another thread (a scrape, the stats line): read while gone ones were
    being dropped, len was the queued less those still marked, below zero, and len() raised ValueError in the
    engine's pipe reader, which then stopped serving. Read between any two of a change's steps, it is the count
    before or after the change."""
    items = [Item(i, 0) for i in range(12)]
    q, ref = WaitQueue(), list(items)
    for s in items:
        q.append(s)
    counts = (len(ref), len(ref))
    seen = []

    def look():
        seen.append(len(q))
        assert len(q) in counts, (len(q), counts)

    q._gone = Observed()
    q._gone.look = staticmethod(look)
    for s in items[1:-1:2] + items[2:-1:2]:  # in the middle: marked gone, then all dropped at once
        counts = (len(ref), len(ref) - 1)
        q.remove(s)
        ref.remove(s)
        counts = (len(ref), len(ref))
        assert q[0] is ref[0] and list(q) == ref
    assert seen and len(q) == 2 and not q._gone
