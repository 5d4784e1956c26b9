"""Which sequences run this step, and how many tokens each: continuous batching over the paged KV cache.

Each step spends a token budget (max_num_batched_tokens) over at most max_num_seqs sequences:

1. running sequences first, oldest first: one token for a decoding sequence, the next chunk for one still
   prefilling (chunked prefill);
2. then, unless a running one was preempted this step, waiting sequences, first come first served, while budget,
   sequence slots and free blocks last. With prefix caching (prefix_cache.py) each takes the cached blocks its
   tokens begin with, and the head of the queue waits (holding the queue, as a lack of blocks does) while a running
   sequence computes 32 or more tokens it begins with too, then shares them. A sequence that asks for prompt
   log-probabilities takes none: its prompt runs in full.

Under the priority policy (vLLM's --scheduling-policy priority) the queue is kept in (priority, arrival) order
instead, lower priorities first, and the running sequence that comes last in that order is the one preempted.

The scheduler reserves every KV block a step needs before the step runs. When a running sequence needs a block and
none is free, the most recently admitted running sequence is preempted: its blocks go back and it returns to the
front of the queue, to be recomputed (its prompt and the tokens it generated are prefilled again). Waiting sequences
never preempt running ones: they queue. A sequence that outgrows the whole cache ends with finish reason "length"
(the cache is its context limit). Nothing crashes or spins for want of blocks.

With overlapped scheduling a sequence may carry pending tokens (sampled on the GPU, not read back yet). It decodes
as usual (its input id is taken on the device), but whatever its pending tokens decide waits for them: a sequence
whose pending token ends it is not scheduled, and a preempted one is not recomputed until its tokens are known.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tpgraph.engine.kv_cache import BlockAllocator
from tpgraph.engine.scheduler_config import SchedulerConfig
from tpgraph.engine.sequence import Sequence, Status
from tpgraph.errors import RequestError


def queue_order(seq: Sequence) -> tuple[int, int]:
    """The priority policy's order: a request's priority (lower first), then arrival (sequence ids count up)."""
    return (seq.params.priority if seq.params is not None else 0, seq.seq_id)


@dataclass
class ScheduledStep:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens it runs this step)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_cache: list[Sequence] = field(default_factory=list)  # grew past the whole KV cache: finished, "length"

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class WaitQueue:
    """The waiting sequences, in order. One finished anywhere in it leaves in O(1) amortised (aborting 20,000 queued
    requests searched the queue for each: 3.5 s): one at either end is taken off; one elsewhere is only marked gone,
    and dropped when a walk from the front (an index) reaches it, or all at once when the gone outnumber the queued.
    Indices, len and iteration see the queued ones alone. Taking out one not queued, or queueing one twice, is a
    ValueError (one not queued marked gone would hide a queued one from len and indices: never admitted)."""

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()
        self._queued: set[int] = set()  # id() of the queued sequences (all in _items, which keeps them alive)
        self._gone: set[int] = set()  # id() of sequences marked gone, still in _items (which keeps them alive)
        self._clean = 0  # while some are gone: _items[:_clean] holds none of them

    def __len__(self) -> int:
        # (one read of a set changed once per call: the metrics read it from another thread, and _items less _gone
        # could be read mid-change, below zero while gone ones were dropped, where len() raised)
        return len(self._queued)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Sequence]:
        return (s for s in self._items if id(s) not in self._gone) if self._gone else iter(self._items)

    def __getitem__(self, i: int) -> Sequence:
        return self._items[self._position(i)]

    def __delitem__(self, i: int) -> None:
        at = self._position(i)
        self._queued.discard(id(self._items[at]))
        del self._items[at]
        self._clean -= 1

    def append(self, seq: Sequence) -> None:
        self._revive(seq)
        self._items.append(seq)
        self._queued.add(id(seq))

    def insert(self, i: int, seq: Sequence) -> None:
        """Queue seq at index i (len(self): last)."""
        self._revive(seq)
        at = self._position(i) if i < len(self) else len(self._items)
        self._items.insert(at, seq)
        self._queued.add(id(seq))
        self._clean += at <= self._clean

    def insort(self, seq: Sequence, key: Callable[[Sequence], tuple[int, int]]) -> None:
        """Queue seq after every one that comes before it or with it in key's order (those gone keep their place)."""
        self._revive(seq)
        at = bisect.bisect_right(self._items, key(seq), key=key)
        self._items.insert(at, seq)
        self._queued.add(id(seq))
        self._clean += at <= self._clean

    def remove(self, seq: Sequence) -> None:
        """Take a queued sequence out."""
        if id(seq) not in self._queued:
            raise ValueError(f"sequence {getattr(seq, 'seq_id', seq)} is not in the waiting queue")
        self._queued.discard(id(seq))
        if self._items[-1] is seq:
            self._items.pop()
            self._clean = min(self._clean, len(self._items))
        elif self._items[0] is seq:
            self._items.popleft()
            self._clean = max(self._clean - 1, 0)
        else:
            self._gone.add(id(seq))
            self._clean = 0  # (wherever it is)
            if len(self._gone) > len(self._items) // 2:
                self._drop_gone()

    def _position(self, i: int) -> int:
        """The position in _items of the queued sequence at index i, the gone before it dropped."""
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("waiting queue index out of range")
        if not self._gone:
            return i
        while self._clean <= i:  # (a queued one lies at or past i: the walk ends in _items)
            s = self._items[self._clean]
            if id(s) in self._gone:
                self._gone.discard(id(s))
                del self._items[self._clean]
            else:
                self._clean += 1
        return i

    def _revive(self, seq: Sequence) -> None:
        """A sequence queued again while marked gone (none is, once finished) must not come back where it was."""
        if id(seq) in self._queued:
            raise ValueError(f"sequence {getattr(seq, 'seq_id', seq)} is already in the waiting queue")
        if id(seq) in self._gone:
            self._drop_gone()

    def _drop_gone(self) -> None:
        self._items = deque(s for s in self._items if id(s) not in self._gone)
        self._gone.clear()
        self._clean = len(self._items)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.waiting = WaitQueue()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0
        # tokens of the sequences admitted so far that looked in the prefix cache, and of those, the ones found cached;
        # a preempted sequence's recompute apart (as vLLM's PrefixCacheStats: one finding its own blocks again is no
        # hit of the cache's)
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        self.preempted_queried_tokens = self.preempted_hit_tokens = 0

    # ---- requests in and out ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; refuse one that could never run (longer than the context or than the whole cache)."""
        limit = min(self.cfg.max_model_len, self.allocator.num_blocks * self.cfg.block_size)
        if len(seq) > limit:
            raise RequestError(f"the prompt has {len(seq)} tokens; at most {limit} fit (max_model_len "
                               f"{self.cfg.max_model_len}, KV cache {self.allocator.num_blocks} blocks of "
                               f"{self.cfg.block_size})")
        seq.status = Status.WAITING
        if self.cfg.policy == "priority":
            self.waiting.insort(seq, queue_order)
        else:
            self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """The sequence is done (stop, length, abort): its blocks go back at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.allocator.register(seq)  # what it computed stays cached for whoever comes next
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason, seq.finished = Status.FINISHED, reason, True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.allocator.num_blocks

    # ---- one step --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.cfg.max_num_batched_tokens
        for seq in self.running:  # blocks the last steps filled can be shared from now on
            self.allocator.register(seq)
        running, block_size = Status.RUNNING, self.cfg.block_size
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running:  # preempted earlier in this loop to make room
                continue
            if seq.num_pending and self._decided_by_pending(seq):
                continue  # its pending token ends it, or it outgrows the cache: decided once the token is read
            uncached = len(seq) - seq.num_cached
            n = 1 if uncached == 1 else min(uncached, budget)
            # (a decoding row whose last block has room needs nothing reserved: the common case, taken without calls)
            if n != 1 or not seq.next_token_fits(block_size):
                preempted = len(step.preempted)
                reserved = self._reserve_running(seq, n, step)
                if len(step.preempted) != preempted:  # (a victim scheduled earlier in this step gives its tokens back:
                    budget = self.cfg.max_num_batched_tokens - step.num_tokens  # the priority policy's may be anywhere)
                if not reserved:
                    continue  # seq itself was preempted
            budget -= n
            if uncached == 1 and seq.num_cached >= len(seq.prompt_ids):  # (a reservation changes neither)
                step.decode.append(seq)
            else:
                step.prefill.append((seq, n))
        if step.preempted:  # (as vLLM's: the blocks a victim gave back admit nobody this step, who would only make
            return step     # the next one preempt again)
        # sequences passed over while they wait for a prefix in flight keep the slots and blocks they will take:
        # arrivals behind them go in only whole (their prompt in this step) and with room to spare: the blocks every
        # running sequence's prompt still needs, and a block of growth for each sequence. (Should the running ones
        # outgrow that, the newest, an arrival that went past, is preempted; it queues behind the passed-over ones.)
        deferred_slots = deferred_blocks = 0
        i = 0
        while (i < len(self.waiting) and budget > 0
               and len(self.running) + deferred_slots < self.cfg.max_num_seqs):
            seq = self.waiting[i]
            if seq.num_pending:
                break  # preempted with a token still on the GPU: its recompute waits until the token is read
            # one asking prompt log-probabilities looks nothing up (its prompt runs in full: cached tokens would have
            # no logits), nor does any without prefix caching
            looked_up = self.allocator.shares_prefixes and not seq.needs_prompt_logprobs
            if not seq.needs_prompt_logprobs:
                if self.allocator.worth_waiting(seq, self.running):
                    # a running sequence is computing blocks this one begins with (or its request's first sample the
                    # prompt log-probabilities this one reports): it waits, then shares them
                    deferred_slots += 1
                    deferred_blocks += seq.blocks_needed(self.cfg.block_size, len(seq)) - seq.awaited_blocks + 1
                    i += 1
                    continue
                self.allocator.match(seq)  # a cached prefix: its blocks are shared, and only the rest is computed
            n = min(seq.num_uncached, budget)
            need = seq.blocks_needed(self.cfg.block_size, seq.num_cached + n)
            kept = deferred_blocks + self._room_to_grow() + 1 if deferred_slots else 0
            if ((n < seq.num_uncached and (deferred_slots or not self.cfg.enable_chunked_prefill))
                    or need + kept > self.allocator.num_free):
                self._free(seq)  # queue (waiting sequences never preempt running ones), holding no blocks
                break
            seq.block_table.extend(self.allocator.allocate(need))
            if looked_up:  # (one that never looked in the cache is no query of it, as vLLM's stats count)
                self._count_lookup(seq)
            if seq.prompt_cached is None:  # (what a request's usage reports: its first admission's, as vLLM's)
                seq.prompt_cached = min(seq.num_cached, len(seq.prompt_ids))
                seq.queue_s = time.perf_counter() - seq.queued_at
            del self.waiting[i]
            seq.status = Status.RUNNING
            self.running.append(seq)
            step.prefill.append((seq, n))
            budget -= n
        return step

    def _count_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's prefix-cache lookup: its tokens and those found cached."""
        if seq.num_preemptions:
            self.preempted_queried_tokens += len(seq)
            self.preempted_hit_tokens += seq.num_cached
        else:
            self.prefix_queried_tokens += len(seq)
            self.prefix_hit_tokens += seq.num_cached

    def _room_to_grow(self) -> int:
        """Blocks the running sequences need to finish their prompts, and one each to grow."""
        return sum(s.blocks_needed(self.cfg.block_size, len(s)) + 1 for s in self.running)

    def _decided_by_pending(self, seq: Sequence) -> bool:
        """Would this sequence's fate be decided by its pending tokens? Its last one reaches max_tokens or
        max_model_len (it finishes when read), or its next block outgrows the whole cache (finished "length", which
        must come after the pending token is delivered). Such a sequence sits out a step rather than run a row whose
        token would be thrown away."""
        if seq.reached_length(self.cfg.max_model_len):
            return True
        if seq.next_token_fits(self.cfg.block_size):
            return False  # (its next token fits its last block: no block to outgrow the cache with)
        return self._outgrows_cache(seq, seq.blocks_needed(self.cfg.block_size, seq.num_cached + 1))

    def _outgrows_cache(self, seq: Sequence, need: int) -> bool:
        """Would `need` more blocks take the sequence past the whole cache?"""
        return len(seq.block_table) + need > self.allocator.num_blocks

    def _reserve_running(self, seq: Sequence, n: int, step: ScheduledStep) -> bool:
        """Blocks for seq's next n tokens, preempting the newest other running sequences if needed. False if seq
        had to be preempted itself, or finished because it outgrew the whole cache."""
        need = seq.blocks_needed(self.cfg.block_size, seq.num_cached + n)
        if self._outgrows_cache(seq, need):  # the whole cache cannot hold it
            self.finish(seq, "length")
            step.out_of_cache.append(seq)
            return False
        while need > self.allocator.num_free:
            victim = max(self.running, key=queue_order) if self.cfg.policy == "priority" else self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        self.allocator.register(seq)  # its recompute can find what it computed, unless the room is taken first
        self._free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.cfg.policy == "priority":  # (in its place: ahead of later arrivals of its priority)
            self.waiting.insort(seq, queue_order)
        else:  # first in the queue, but behind sequences waiting for a prefix in flight (it may have gone past them),
            # never behind its own request's samples that wait for it (it would have to go in whole past them)
            at = 0
            while at < len(self.waiting) and self._waits_for_a_prefix(self.waiting[at], seq):
                at += 1
            self.waiting.insert(at, seq)
        step.preempted.append(seq)
        # a victim scheduled earlier in this step must not run
        step.prefill = [(s, n) for s, n in step.prefill if s is not seq]
        step.decode = [s for s in step.decode if s is not seq]

    def _waits_for_a_prefix(self, waiting: Sequence, preempted: Sequence) -> bool:
        """Does a waiting sequence wait for blocks a running sequence computes (a preempted one queues behind it)? Its
        awaited_blocks is what the last step that reached it found, since computed perhaps: it is asked again."""
        if waiting.prompt_logprobs_from is preempted or not waiting.awaited_blocks:
            return False
        self.allocator.worth_waiting(waiting, self.running)
        return waiting.awaited_blocks > 0

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
        seq.forget_blocks()
