"""Prefix caching under stress and at its edges (from session 39's review): metrics count each admitted sequence once,
short prompts do not wait, every block comes back after an engine error, and random bursts (aborts, preemption,
n > 1, stop ids, shared prefixes, chunking and overlap on and off) give the tokens and log-probabilities of the engine
without caching, with every block back at the end; and the scheduler alone, over random schedules at tiny caches,
counts every block once each step and runs every request to its end."""

import bisect
import random

import pytest
from tpgtest.prefix_engines import BS, engine, prefill_tokens
from tpgtest.scheduling import run_step

from tpgraph import SamplingParams
from tpgraph.engine.kv_cache import BlockAllocator
from tpgraph.engine.prefix_cache import PrefixCachingAllocator
from tpgraph.engine.scheduler import Scheduler
from tpgraph.engine.scheduler_config import SchedulerConfig
from tpgraph.engine.sequence import Sequence, Status


def test_a_queued_sequence_is_counted_once_in_the_prefix_metrics():
    alloc = PrefixCachingAllocator(8, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS),
                      alloc)
    done = Sequence(0, list(range(12)), 4)  # computed and finished: 3 named idle blocks
    sched.add(done)
    sched.schedule()
    done.num_cached, done.output_ids = 12, [5]
    sched.finish(done, "stop")
    running = Sequence(1, list(range(100, 119)), 4)  # takes the 5 never-named blocks
    sched.add(running)
    sched.schedule()
    running.num_cached = 18
    queued = Sequence(2, [*range(12), 50, 51, 52, 53, 54], 4)  # 12 tokens cached, but no block for the rest
    sched.add(queued)
    before = (sched.prefix_queried_tokens, sched.prefix_hit_tokens)
    for _ in range(3):
        sched.schedule()
    assert sched.waiting[0] is queued and queued.status.value == "waiting", "never admitted"
    assert (sched.prefix_queried_tokens, sched.prefix_hit_tokens) == before, "nothing counted before admission"
    running.num_cached = 0
    sched.finish(running, "abort")  # room: now it is admitted, and counted once
    sched.schedule()
    assert (sched.prefix_queried_tokens - before[0], sched.prefix_hit_tokens - before[1]) == (17, 12)


def test_later_samples_of_a_short_prompt_do_not_wait():
    """Under WAIT_MIN_TOKENS (32) in common, one step's wait is not worth it: every sample computes the prompt."""
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=2)
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks (20 tokens) shareable
    with engine(True, max_num_batched_tokens=256) as e:
        e.generate([prompt], params)
        assert prefill_tokens(e) == 4 * 22


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_blocks_come_back_after_an_engine_error_and_the_next_call_matches(where):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    prompts = [list(range(1, 41)) + [50 + i] * 5 for i in range(3)]
    with engine(False, max_num_batched_tokens=16) as e:
        want = [o.outputs[0].token_ids for o in e.generate(prompts, params)]
    with engine(True, max_num_batched_tokens=16) as e:
        original, calls = getattr(e.runner, where), [0]

        def failing(*a, **k):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected")
            return original(*a, **k)

        setattr(e.runner, where, failing)
        with pytest.raises(RuntimeError, match="injected"):
            e.generate(prompts, params)
        setattr(e.runner, where, original)
        alloc = e.runner.allocator
        assert alloc.num_free == alloc.num_blocks
        assert [o.outputs[0].token_ids for o in e.generate(prompts, params)] == want
        assert alloc.num_free == alloc.num_blocks


def _drive(e, reqs):
    """Requests (id, prompt, params, arrival step, abort step or None) through the core; tokens and logprobs."""
    core, out, pending, aborted, step = e.core, {}, list(reqs), set(), 0
    while pending or core.has_work:
        for r in [r for r in pending if r[3] <= step]:
            core.add_request(r[0], r[1], r[2])
            pending.remove(r)
        for r in reqs:
            if r[4] == step and r[0] in core.requests:
                core.abort(r[0])
                aborted.add(r[0])
        for u in core.step():
            if u.token_id is not None:
                out.setdefault((u.request_id, u.sample_index), []).append((u.token_id, u.logprob))
        step += 1
        assert step < 2000, "no progress"
    return out, aborted


@pytest.mark.parametrize("seed", [203, 217, 227])  # preemptions, aborts, n > 1, stop ids, shared prefixes
def test_random_bursts_with_aborts_and_preemption_match_no_caching(seed):
    rng = random.Random(seed)
    base = [rng.randrange(256) for _ in range(40)]
    reqs = []
    for i in range(rng.randrange(3, 8)):
        prompt = base[:rng.choice([0, 8, 20, 33, 40])] + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.2 and reqs:
            prompt = list(reqs[-1][1])
        p = SamplingParams(temperature=1.0, seed=rng.randrange(1000), max_tokens=rng.randrange(1, 25),
                           n=rng.choice([1, 1, 2, 3]), logprobs=0, ignore_eos=True,
                           stop_token_ids=tuple(rng.sample(range(256), rng.choice([0, 0, 10]))))
        arrive = rng.randrange(12)
        reqs.append((f"r{i}", prompt, p, arrive, arrive + rng.randrange(15) if rng.random() < 0.25 else None))
    bs = rng.choice([4, 4, 8])
    chunked = rng.random() < 0.8
    kw = dict(max_num_seqs=rng.choice([2, 4]), num_kv_blocks=rng.choice([26, 40, 64]) * 4 // bs, block_size=bs,
              enable_chunked_prefill=chunked, overlap_scheduling=rng.random() < 0.7)
    if chunked and (budget := rng.choice([None, 16, 32])):
        kw["max_num_batched_tokens"] = budget
    with engine(False, **kw) as e:
        off, a_off = _drive(e, reqs)
    with engine(True, **kw) as e:
        on, a_on = _drive(e, reqs)
        assert e.runner.allocator.num_free == e.runner.allocator.num_blocks
    for key in off:
        if key[0] in a_off | a_on:
            continue
        assert [t for t, _ in on[key]] == [t for t, _ in off[key]], key
        assert max(abs(x - y) for (_, x), (_, y) in zip(on[key], off[key], strict=True)) < 1e-3, key


PREFIX = list(range(100, 140))  # 40 tokens: 10 blocks, past WAIT_MIN_TOKENS


@pytest.mark.parametrize("limit", ["slots", "blocks"])
def test_a_deferred_sequence_is_not_overtaken_by_the_queue_behind_it(limit):
    """Later arrivals do not take the slots or blocks a sequence waiting for a prefix in flight will use: had they,
    it would wait for their whole generations."""
    # slots: max_num_seqs 2, plenty of blocks; blocks: slots for all, but the unrelated one takes the free blocks
    seqs, blocks = (2, 64) if limit == "slots" else (4, 17)
    sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=128, max_model_len=128,
                                      block_size=BS), PrefixCachingAllocator(blocks, BS))
    first = Sequence(0, PREFIX + [1], 1000)  # computes the common prefix
    sample = Sequence(1, PREFIX + [2], 1000)  # waits for it (worth_waiting), to share it
    unrelated = Sequence(2, list(range(200, 200 + (5 if limit == "slots" else 20))), 1000)  # arrives last
    for s in (first, sample, unrelated):
        sched.add(s)
    step = sched.schedule()
    assert first in [s for s, _ in step.prefill] and sample.status is Status.WAITING
    run_step(step)
    for _ in range(5):  # the prefix is computed and cached: the earlier arrival should go in now
        run_step(sched.schedule())
    assert sample.status is Status.RUNNING, (
        f"the sequence that waited for a computed prefix is still queued ({limit} taken by a later arrival); "
        f"running: {[s.seq_id for s in sched.running]}")


@pytest.mark.parametrize(("blocks", "arrival"), [(18, 60), (26, 100), (34, 100), (28, 60)])
def test_a_long_arrival_does_not_go_past_a_sequence_waiting_for_a_prefix(blocks, arrival):
    """An arrival goes past a sequence waiting for a prefix only whole (its prompt in one step) and with room for
    the running prompts to finish: let in for a chunk, it ran short of blocks, was preempted, and came back ahead
    of the waiting one, which then waited for whole generations (helper-81's cases; it went in at step 46)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256, block_size=BS),
                      PrefixCachingAllocator(blocks, BS))
    first, sample = Sequence(0, PREFIX + [1], 1000), Sequence(1, PREFIX + [2], 1000)
    unrelated = Sequence(2, list(range(200, 200 + arrival)), 1000)
    for s in (first, sample, unrelated):
        sched.add(s)
    run_step(sched.schedule())
    step = sched.schedule()
    assert sample.status is Status.RUNNING and sample.num_cached == len(PREFIX), [s.seq_id for s in sched.waiting]
    assert (sample, 1) in step.prefill


def test_a_preempted_sequence_queues_behind_those_waiting_for_a_prefix():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=BS),
                      PrefixCachingAllocator(64, BS))
    first, sample = Sequence(0, PREFIX + [1], 1000), Sequence(1, PREFIX + [2], 1000)
    other = Sequence(2, [7, 8, 9], 1000)
    for s in (first, sample, other):
        sched.add(s)
    step = sched.schedule()
    assert list(sched.waiting) == [sample] and other.status is Status.RUNNING
    sched._preempt(other, step)
    assert list(sched.waiting) == [sample, other]


def test_arrivals_with_room_go_past_a_sequence_waiting_for_a_prefix():
    """A sequence waiting for a prefix in flight does not hold up unrelated arrivals while slots and blocks are
    plentiful, and it goes in, sharing the prefix, in the step after the prefix is computed."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=128,
                                      block_size=BS), PrefixCachingAllocator(64, BS))
    first = Sequence(0, PREFIX + [1], 1000)  # 41 tokens, computing the common prefix
    sample = Sequence(1, PREFIX + [2], 1000)  # waits for it
    unrelated = Sequence(2, list(range(200, 207)), 1000)  # arrives last
    for s in (first, sample, unrelated):
        sched.add(s)
    step = sched.schedule()  # the unrelated one takes the 7 tokens of budget left: its whole prompt
    assert [(s.seq_id, n) for s, n in step.prefill] == [(0, 41), (2, 7)]
    assert list(sched.waiting) == [sample] and sample.awaited_blocks == 10
    run_step(step)
    step = sched.schedule()
    assert sample.status is Status.RUNNING and sample.num_cached == len(PREFIX)  # the shared prefix: 10 blocks
    assert (sample, 1) in step.prefill


def test_a_sequence_preempted_once_the_prefix_it_computed_is_cached_queues_first():
    """The sequence computing a prefix is preempted in the step after it computed it: the one that waited for that
    prefix waits for nothing now, but its awaited_blocks, left from the last step that reached it, still said so, and
    the preempted one (older, ahead of it) queued behind it: it went in first, on the preempted one's cached blocks,
    and took the last block the preempted one needed. First come, first served: the preempted one is first in line
    (vLLM's scheduler prepends a preempted request to the waiting queue)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=BS),
                      PrefixCachingAllocator(15, BS))
    decoding = Sequence(0, list(range(500, 512)), 1000)  # 3 blocks, a 4th from its 13th token
    sched.add(decoding)
    run_step(sched.schedule())
    first, sample = Sequence(1, PREFIX + [1, 2, 3, 4], 1000), Sequence(2, PREFIX + [5], 1000)
    sched.add(first)
    sched.add(sample)
    run_step(sched.schedule())  # first's whole prompt (11 blocks: none left); sample waits for its prefix
    assert list(sched.waiting) == [sample] and sample.awaited_blocks == 10
    step = sched.schedule()  # first's 45th token needs a 12th block: first, the newest, is preempted
    assert step.preempted == [first]
    assert list(sched.waiting) == [first, sample] and sample.status is Status.WAITING


def _check_step(sched, step):
    """What every step must keep: its budget and slots, blocks reserved for what it runs, and every block counted once
    (held blocks by the sequences holding them; shared ones named; waiting sequences holding none)."""
    cfg, alloc = sched.cfg, sched.allocator
    assert step.num_tokens <= cfg.max_num_batched_tokens and len(sched.running) <= cfg.max_num_seqs
    scheduled = [s for s, _ in step.prefill] + step.decode
    assert len({id(s) for s in scheduled}) == len(scheduled)
    for s, n in step.prefill:
        assert s.status is Status.RUNNING and 1 <= n <= s.num_uncached
        assert len(s.block_table) * cfg.block_size >= s.num_cached + n
    for s in step.decode:
        assert s.num_uncached == 1 and len(s.block_table) * cfg.block_size >= len(s)
    assert all(not s.block_table and s.status is Status.WAITING for s in sched.waiting)
    held = {}
    for s in sched.running:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    if isinstance(alloc, PrefixCachingAllocator):
        assert held == alloc._refs
        assert len(alloc._free) + len(alloc._idle) + len(alloc._refs) == alloc.num_blocks
        assert all(b in alloc._name_of for b, refs in held.items() if refs > 1), "a shared block with no name"
    else:
        assert sum(held.values()) + alloc.num_free == alloc.num_blocks


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_keep_every_block_counted_and_run_every_request_to_its_end(seed):
    """The scheduler alone over random arrivals (shared prefixes, n > 1, prompt log-probabilities, priorities), aborts
    and stops, with each step's tokens pending until the next step reads them (overlapped scheduling), at tiny caches,
    budgets and block sizes: every step keeps _check_step, nothing stalls, and every block is free at the end."""
    random_schedule(seed)


class ListQueue(list):
    """The waiting queue as a plain list, searched for each sequence taken out: what the scheduler's WaitQueue (a
    finished one marked gone, dropped later) must decide as."""

    def insort(self, seq, key):
        bisect.insort(self, seq, key=key)


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_with_many_aborts_decide_as_a_plain_queue_would(seed):
    """The waiting queue takes a finished sequence out lazily (marked gone, dropped when reached): over random
    schedules with an abort most steps, every step admits, runs, preempts and leaves queued what a plain list would."""
    assert random_schedule(seed, abort_rate=0.4) == random_schedule(seed, ListQueue(), abort_rate=0.4)


def random_schedule(seed, queue=None, abort_rate=0.05):
    """The random schedule of `seed` (a whole request aborted at abort_rate a step; `queue`: the scheduler's waiting
    queue instead of its own), each step checked; each step's decisions: the sequence ids prefilled (with their
    tokens), decoded, preempted, and left queued."""
    rng = random.Random(seed)
    bs, max_len = rng.choice([1, 2, 4, 8]), rng.choice([16, 32, 48])
    num_blocks = -(-max_len // bs) + rng.randrange(12)
    seqs, chunked, caching = rng.choice([1, 2, 3, 4, 8]), rng.random() < 0.8, rng.random() < 0.8
    budget = max(seqs, rng.choice([1, 3, 5, 8, 16, 64])) if chunked else max_len
    policy = rng.choice(["fcfs", "priority"])
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len, block_size=bs,
                          enable_chunked_prefill=chunked, policy=policy)
    alloc = PrefixCachingAllocator(num_blocks, bs) if caching else BlockAllocator(num_blocks)
    sched, trace = Scheduler(cfg, alloc), []
    if queue is not None:
        sched.waiting = queue
    base, requests, in_flight, next_id = [rng.randrange(50) for _ in range(max_len)], [], [], 0
    for step_no in range(4000):
        if step_no < 200 and rng.random() < 0.3:
            size = rng.randrange(1, max_len)
            shared = rng.choice([0, size // 2, size])
            prompt = base[:shared] + [rng.randrange(50) for _ in range(size - shared)]
            asks = rng.random() < 0.2
            params = SamplingParams(n=rng.choice([1, 1, 2, 3]), temperature=1.0, prompt_logprobs=0 if asks else None,
                                    priority=rng.choice([0, 1, -1]) if policy == "priority" else 0)
            limit, first, request = rng.randrange(1, max_len - size + 1), None, []
            for i in range(params.n):
                s = Sequence(next_id, list(prompt), limit, params=params, sample_index=i,
                             prompt_logprobs_from=first if asks and caching else None)
                next_id, first = next_id + 1, first or s
                sched.add(s)
                request.append(s)
            requests.append(request)
        if requests and rng.random() < abort_rate:
            for s in requests.pop(rng.randrange(len(requests))):
                if s.status is not Status.FINISHED:
                    s.drop_pending()
                    sched.finish(s, "abort")
        step = sched.schedule()
        _check_step(sched, step)
        trace.append(([(s.seq_id, n) for s, n in step.prefill], [s.seq_id for s in step.decode],
                      [s.seq_id for s in step.preempted], [s.seq_id for s in sched.waiting]))
        rows = []
        for s, n in step.prefill:  # (the runner's and the core's bookkeeping of a launched step)
            s.num_cached += n
            if s.computes_prompt_logprobs:  # (entries up to the tokens computed, each kept once)
                entries = min(len(s.prompt_ids) - 1, s.num_cached)
                s.prompt_logprobs += [(0, 0.0, [])] * max(0, entries - len(s.prompt_logprobs))
            if s.num_uncached == 0:
                rows.append((s, s.add_pending()))
        for s in step.decode:
            s.num_cached = len(s)
            rows.append((s, s.add_pending()))
        for s, index in in_flight:  # the last step's tokens read back: a stop or the length ends the sequence
            if s.status is not Status.FINISHED:
                s.resolve_pending(index, rng.randrange(50))
                if s.reached_length(max_len, index + 1) or rng.random() < 0.03:
                    s.drop_pending(keep=index + 1)
                    sched.finish(s, "stop")
        in_flight = rows
        if step_no >= 200 and not sched.has_work and not in_flight:
            break
    assert not sched.has_work, ([s.seq_id for s in sched.waiting], [s.seq_id for s in sched.running])
    assert alloc.num_free == alloc.num_blocks
    return trace
