"""Automatic prefix caching: full KV blocks are named by a hash of every token up to their end, so a sequence whose
tokens begin with blocks already in the cache shares them instead of computing them again (a system prompt, the
earlier turns of a chat, a resubmitted prompt, a preempted sequence coming back).

A block's name is sha256(its parent's name + its token ids): equal names mean equal token prefixes, so equal K/V.
A request's cache_salt (vLLM's) is the first block's parent: only requests of the same salt share blocks.
A cryptographic hash because a collision would hand one request another's K/V, and a weak hash can be made to
collide on purpose. Blocks are reference-counted: a block stays named while it is in a sequence's table; when the
last one lets it go it becomes idle, still named and reusable, and it is handed out again (its name forgotten) only
when no unnamed free block is left, oldest first, the tail of a sequence before the prefix it extends. Only full
blocks whose K/V are computed from known token ids are named (num_cached counts tokens whose K/V are written or
queued to be written, and any later reader runs after that on the same stream), and a shared block is never written
again: a sequence writes only past its cached tokens, and its matched blocks are full. Every rank keeps its own copy
of this state and reaches the same one, since it follows the same schedule and hashes the same ids.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from tpgraph.engine.kv_cache import BlockAllocator, OutOfBlocks
from tpgraph.engine.sequence import Sequence

# waiting costs a step: it is worth it for at least this many tokens that would otherwise be computed twice (SGLang's
# in-batch prefix check starts at 32 as well)
WAIT_MIN_TOKENS = 32


def block_name(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def _salt(seq: Sequence) -> bytes:
    """The first block's parent: its request's cache_salt, hashed as a name is (as long as any parent), else none."""
    salt = seq.params.cache_salt if seq.params is not None else None
    # (surrogatepass: a str may hold a lone surrogate, JSON's "\ud800", which strict UTF-8 refuses mid-step)
    return b"" if salt is None else hashlib.sha256(b"cache_salt:" + salt.encode("utf-8", "surrogatepass")).digest()


class PrefixCachingAllocator(BlockAllocator):
    """A BlockAllocator that names computed blocks and shares them (match) with sequences that begin the same way."""

    shares_prefixes = True

    def __init__(self, num_blocks: int, block_size: int, first_block: int = 0) -> None:
        super().__init__(num_blocks, first_block)
        self.block_size = block_size
        self._refs: dict[int, int] = {}  # block -> sequences holding it (every handed-out block)
        self._by_name: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # named, held by none: reusable, oldest first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_name)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:  # the oldest idle block: its name goes with its contents
                block, _ = self._idle.popitem(last=False)
                del self._by_name[self._name_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # a table's tail goes idle first, so it is evicted before its prefix
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._name_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def _usable(self, seq: Sequence) -> int:
        """Whole blocks of seq that may come from the cache: known ids, and never its last token (its logits are the
        step's output)."""
        return (len(seq) - max(seq.num_pending, 1)) // self.block_size

    def _names(self, seq: Sequence, count: int) -> list[bytes]:
        """The names of seq's first `count` whole blocks (count within its known ids), hashed once per sequence: its
        ids only grow (outputs dropped after a stop end it), so the list is cut to its length and extended."""
        bs, names = self.block_size, seq.block_names
        del names[len(seq) // bs:]
        for i in range(len(names), count):
            names.append(block_name(names[-1] if names else _salt(seq), seq.token_span(i * bs, (i + 1) * bs)))
        return names

    def _cached_blocks(self, names: list[bytes], usable: int) -> int:
        cached = 0
        while cached < usable and names[cached] in self._by_name:
            cached += 1
        return cached

    def match(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix. Returns the tokens matched
        (seq.num_cached)."""
        if seq.block_table or seq.num_cached:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        usable = self._usable(seq)
        names = self._names(seq, usable)
        blocks = [self._by_name[name] for name in names[:self._cached_blocks(names, usable)]]
        for block in blocks:
            if block in self._idle:
                del self._idle[block]
            self._refs[block] = self._refs.get(block, 0) + 1
        seq.block_table = blocks
        seq.num_cached = len(blocks) * self.block_size
        seq.num_registered = len(blocks)  # (named already)
        return seq.num_cached

    def worth_waiting(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Is a running sequence about to compute, from the same tokens, WAIT_MIN_TOKENS or more that seq would
        otherwise compute too (past what is cached now)? Then seq waits and shares them (SGLang's in-batch prefix
        sharing): a burst of requests with one new system prompt, or the n samples of one request, compute the
        common prefix once, while requests whose prefix is cached already, or shared with nobody, go in at once.
        A later sample of a request that asks prompt log-probabilities waits for its first sample's whatever it saves.
        Sets seq.awaited_blocks: the blocks it waits for (0 if it does not wait)."""
        bs, usable = self.block_size, self._usable(seq)
        names = self._names(seq, usable)
        cached = self._cached_blocks(names, usable)
        # once waiting, seq waits until the blocks are computed; to start, the saving must be worth a step (a later
        # sample waits for its request's prompt log-probabilities whatever it saves)
        least = 1 if seq.awaited_blocks else 0 if seq.awaits_prompt_logprobs else -(-WAIT_MIN_TOKENS // bs)
        awaited = 0
        for s in running:
            if s.num_cached >= (cached + 1) * bs:
                continue  # it computed that block already: named (so cached), or never to be
            theirs = self._names(s, len(s.prompt_ids) // bs)  # the blocks of its prompt
            if cached and (len(theirs) < cached or theirs[cached - 1] != names[cached - 1]):
                continue  # it begins otherwise (a name covers every token before it)
            shared = cached
            while shared < min(usable, len(theirs)) and theirs[shared] == names[shared]:
                shared += 1
            awaited = max(awaited, shared - cached)
        seq.awaited_blocks = awaited if awaited >= least else 0
        return seq.awaited_blocks > 0 or seq.awaits_prompt_logprobs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache: a benchmark's next run computes its prompts again),
        where no sequence holds a block; where one does, False and nothing changed (its blocks stay named)."""
        if self._refs:
            return False
        self._free.extend(self._idle)
        self._idle.clear()
        self._by_name.clear()
        self._name_of.clear()
        return True

    def register(self, seq: Sequence) -> None:
        """Name the sequence's full blocks whose K/V are computed from known ids. A block whose name another block
        already has (the same prefix computed twice at once) stays unnamed and is freed as usual."""
        full = min(seq.num_cached, len(seq) - seq.num_pending) // self.block_size
        if full <= seq.num_registered:
            return
        names = self._names(seq, full)
        for i in range(seq.num_registered, full):
            name, block = names[i], seq.block_table[i]
            if name not in self._by_name and block not in self._name_of:
                self._by_name[name] = block
                self._name_of[block] = name
        seq.num_registered = full
