"""The scheduler's decisions on plain sequences: budgets, order, chunked prefill, preemption, queueing."""

import pytest
from tpgtest.scheduling import run_step as run

from tpgraph.engine.kv_cache import BlockAllocator
from tpgraph.engine.scheduler import Scheduler
from tpgraph.engine.scheduler_config import SchedulerConfig
from tpgraph.engine.sequence import Sequence, Status
from tpgraph.errors import ConfigError, RequestError


def make(blocks=100, seqs=4, tokens=16, chunked=True, max_len=64, block=4):
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=max_len, block_size=block,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, BlockAllocator(blocks, first_block=1))


def seq(i, n):
    return Sequence(i, list(range(1, n + 1)), 100)


def test_budget_chunks_and_fifo():
    sched = make(tokens=16)
    a, b, c = seq(0, 10), seq(1, 10), seq(2, 3)
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()
    assert [(s.seq_id, n) for s, n in step.prefill] == [(0, 10), (1, 6)]  # b chunked, c waits
    assert step.num_tokens == 16 and list(sched.waiting) == [c]
    run(step)
    step = sched.schedule()
    assert step.decode == [a] and [(s.seq_id, n) for s, n in step.prefill] == [(1, 4), (2, 3)]
    run(step)
    assert sorted(s.seq_id for s in sched.schedule().decode) == [0, 1, 2]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make(tokens=64, chunked=False)
    a, b = seq(0, 40), seq(1, 30)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [(s.seq_id, n) for s, n in step.prefill] == [(0, 40)] and list(sched.waiting) == [b]
    with pytest.raises(ConfigError, match="without chunked prefill"):
        make(tokens=16, chunked=False)


def test_max_num_seqs():
    sched = make(seqs=2, tokens=64)
    for i in range(3):
        sched.add(seq(i, 4))
    assert [s.seq_id for s, _ in sched.schedule().prefill] == [0, 1] and len(sched.waiting) == 1


def test_blocks_are_reserved_before_the_step():
    sched = make(tokens=64, block=4)
    a = seq(0, 9)
    sched.add(a)
    run(sched.schedule())
    assert len(a.block_table) == 3  # 9 tokens
    for _ in range(3):  # tokens 10, 11, 12 fit in block 3
        step = sched.schedule()
        assert len(a.block_table) == 3
        run(step)
    sched.schedule()
    assert len(a.block_table) == 4  # token 13 needs a fourth block


def test_preemption_takes_the_newest_and_it_goes_first_in_line():
    sched = make(blocks=6, tokens=64, block=4)  # 24 token slots
    a, b, c = seq(0, 8), seq(1, 8), seq(2, 4)
    for s in (a, b, c):
        sched.add(s)
    run(sched.schedule())  # 2 + 2 + 1 blocks: 5 of 6
    assert sched.allocator.num_free == 1
    step = sched.schedule()  # a's 9th token takes the last block; b's needs one too: c (newest) is preempted
    assert step.preempted == [c] and c.status is Status.WAITING and sched.waiting[0] is c
    assert c.block_table == [] and c.num_cached == 0 and c.num_preemptions == 1
    assert step.decode == [a, b]
    sched.add(d := seq(3, 2))
    assert list(sched.waiting) == [c, d]


def test_waiting_sequences_queue_instead_of_preempting():
    sched = make(blocks=4, tokens=64, block=4)
    a, b = seq(0, 12), seq(1, 8)
    sched.add(a)
    run(sched.schedule())
    sched.add(b)
    step = sched.schedule()
    assert step.decode == [a] and not step.prefill and not step.preempted and list(sched.waiting) == [b]


def test_outgrowing_the_whole_cache_finishes_with_length():
    sched = make(blocks=3, tokens=64, block=4)
    a = seq(0, 12)
    sched.add(a)
    run(sched.schedule())
    step = sched.schedule()
    assert step.out_of_cache == [a] and step.empty
    assert (a.status, a.finish_reason) == (Status.FINISHED, "length") and sched.allocator.num_free == 3


def test_finish_and_refusals():
    sched = make(blocks=4, tokens=64, block=4, max_len=32)
    a = seq(0, 5)
    sched.add(a)
    run(sched.schedule())
    sched.finish(a, "abort")
    assert sched.allocator.num_free == 4 and not sched.has_work and a.finish_reason == "abort"
    with pytest.raises(RequestError, match="at most 16 fit"):  # the cache holds 16 tokens
        sched.add(seq(1, 17))
    b = seq(2, 3)
    sched.add(b)
    sched.finish(b, "abort")  # finishing a waiting sequence
    assert not sched.has_work


def test_cancelling_thousands_of_waiting_requests_takes_no_quadratic_stall():
    """A burst of requests queued, then all cancelled (a benchmark client stopped with Ctrl-C): each abort takes its
    sequence out of the waiting queue, and that search compared sequences field by field (a dataclass's __eq__ builds
    two tuples of every field per comparison), so 4000 cancelled in reverse order held the engine thread for ~10 s.
    A sequence is itself alone: compared by identity, the same cancellation takes a fraction of a second."""
    import time

    sched = make(blocks=10, tokens=64, block=4, max_len=32)
    seqs = [seq(i, 3) for i in range(4000)]
    for s in seqs:
        sched.add(s)
    start = time.perf_counter()
    for s in reversed(seqs):  # (each one the last in the queue: the longest search)
        sched.finish(s, "abort")
    took = time.perf_counter() - start
    assert not sched.has_work and took < 2.0, took
    assert seq(0, 3) != seq(0, 3)  # (two sequences are never one, whatever their fields)


def counted_sequences():
    """A Sequence class whose == counts its calls, and the count: a queue that searches for the sequence it takes out
    compares it with the others."""
    calls = [0]

    class Counted(Sequence):
        def __eq__(self, other):
            calls[0] += 1
            return self is other

        __hash__ = Sequence.__hash__

    return Counted, calls


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_aborting_queued_sequences_searches_no_queue(policy):
    """Finishing a waiting sequence takes it out of the queue without a search of it: 20,000 queued requests aborted
    newest first took 3.5 s, each compared with every one queued before it. Newest first, in random order, oldest
    first: no comparison at all, and the rest stay queued in their order, the next admitted first."""
    import random

    from tpgraph import SamplingParams

    counted, calls = counted_sequences()
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, block_size=4, policy=policy)
    sched = Scheduler(cfg, BlockAllocator(100, first_block=1))
    for i in range(2000):
        sched.add(counted(i, [1, 2, 3], 100, params=SamplingParams(priority=i % 3 if policy == "priority" else 0)))
    order = list(sched.waiting)
    rng, left = random.Random(0), order[:]
    middle = left[100:1500]
    rng.shuffle(middle)
    for batch in (order[-500:][::-1], middle[:900], order[:100]):  # newest first, random, oldest first
        for s in batch:
            sched.finish(s, "abort")
        aborted = {s.seq_id for s in batch}
        left = [s for s in left if s.seq_id not in aborted]
        assert [s.seq_id for s in sched.waiting] == [s.seq_id for s in left] and len(sched.waiting) == len(left)
        assert all(s.status is Status.FINISHED and s.finish_reason == "abort" for s in batch)
    assert calls[0] == 0
    step = sched.schedule()
    assert [s.seq_id for s, _ in step.prefill] == [s.seq_id for s in left[:4]]
    assert [s.seq_id for s in sched.waiting] == [s.seq_id for s in left[4:]]


def pending(s):
    """Its last output token sampled on the GPU, not read back yet (overlapped scheduling)."""
    s.add_pending()


def test_a_pending_token_that_decides_a_sequence_keeps_it_out_of_the_step():
    sched = make(tokens=64, max_len=12)
    ends, runs, grows = Sequence(0, [1, 2, 3], 2), Sequence(1, [1, 2, 3], 100), Sequence(2, list(range(1, 11)), 100)
    for s in (ends, runs, grows):
        sched.add(s)
    run(sched.schedule())  # every prompt cached, a token each
    for s in (ends, runs, grows):
        pending(s)
        s.num_cached = len(s) - 1
    # ends: its pending token is its max_tokens-th; grows: it reaches max_model_len (12) with it
    assert sched.schedule().decode == [runs]
    for s in (ends, grows):
        s.resolve_pending(len(s.output_ids) - 1, 7)
    assert sched.schedule().decode == [ends, runs, grows]  # read back: the engine decides (here nothing stopped them)


def test_a_preempted_sequence_with_a_pending_token_waits_to_be_recomputed():
    sched = make(blocks=3, tokens=64)
    a, b = seq(0, 4), seq(1, 4)  # a block each; a's next token needs a second block, b's a second too: b goes
    sched.add(a)
    sched.add(b)
    run(sched.schedule())
    a.output_ids.append(7)
    pending(b)
    a.num_cached = b.num_cached = 5
    step = sched.schedule()
    assert step.decode == [a] and step.preempted == [b] and list(sched.waiting) == [b]
    sched.finish(a, "stop")  # room for b again
    assert sched.schedule().empty  # but b's token is still pending: it is not recomputed yet
    b.resolve_pending(len(b.output_ids) - 1, 7)
    assert [(s.seq_id, n) for s, n in sched.schedule().prefill] == [(1, 6)]


def test_a_budget_smaller_than_max_num_seqs_is_refused():
    """A step decodes a token per running sequence: with fewer tokens a step than max_num_seqs, the sequences past
    the budget were never admitted, so max_num_seqs 4 with a budget of 2 ran 2 at a time without a word. vLLM refuses
    it (max_num_batched_tokens must be >= max_num_seqs); so does the engine's config, before the weights load."""
    from tpgraph.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(2\) must be at least max_num_seqs \(4\)"):
        make(seqs=4, tokens=2)
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(2\) must be at least max_num_seqs \(4\)"):
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=2)
    make(seqs=4, tokens=4)


def test_the_default_budget_holds_a_decode_token_for_each_of_max_num_seqs():
    """The runner's default budget (at least 512 tokens) is raised to max_num_seqs where that is more."""
    from tpgraph import TPEngine

    with TPEngine(device="cpu", max_num_seqs=600, max_model_len=16, num_kv_blocks=5, block_size=4) as e:
        assert e.core.scheduler.cfg.max_num_batched_tokens == 600


def test_the_default_budget_is_one_function_for_both_prefill_modes():
    """default_token_budget, which the runner (chunked prefill) and TPEngine (without it) both read: max_model_len,
    at most 8192 with chunked prefill; at least 512 and max_num_seqs either way."""
    from tpgraph.engine.scheduler_config import default_token_budget

    assert [default_token_budget(n, 8) for n in (64, 4096, 9000)] == [512, 4096, 8192]
    assert [default_token_budget(n, 8, chunked_prefill=False) for n in (64, 4096, 9000)] == [512, 4096, 9000]
    assert default_token_budget(16, 600) == default_token_budget(16, 600, chunked_prefill=False) == 600


def test_a_one_token_chunk_with_room_in_its_block_stays_a_prefill_and_a_full_block_still_grows():
    # (running rows whose next token fits their last block skip the reservation: a prompt's one-token chunk (the
    # budget's last token) is still a prefill, and a decoding row at a block's end still gets its next block)
    sched = make(seqs=2, tokens=2, block=4)
    a, b = seq(0, 2), seq(1, 10)
    sched.add(a)
    sched.add(b)
    run(sched.schedule())  # a's prompt
    step = sched.schedule()
    assert step.decode == [a] and [(s.seq_id, n) for s, n in step.prefill] == [(1, 1)]
    run(step)
    for _ in range(3):  # b's prompt one token a step, past a block's end; a decodes past its first block's
        step = sched.schedule()
        assert step.decode == [a] and [(s.seq_id, n) for s, n in step.prefill] == [(1, 1)]
        assert len(a.block_table) * 4 >= len(a) and len(b.block_table) * 4 >= b.num_cached + 1
        run(step)
    assert len(a.block_table) == 2 and len(b.block_table) == 1 and b.num_cached == 4
    step = sched.schedule()
    assert [(s.seq_id, n) for s, n in step.prefill] == [(1, 1)] and len(b.block_table) == 2
