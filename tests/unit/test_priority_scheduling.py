"""vLLM's priority scheduling (--scheduling-policy priority, a request's `priority`): the queue in (priority,
arrival) order, the lowest running sequence preempted first and queued in its place; first come first served
refuses any priority but 0."""

import pytest
from tpgtest.scheduling import run_step as run

from tpgraph import SamplingParams, TPEngine
from tpgraph.engine.kv_cache import BlockAllocator
from tpgraph.engine.limits import RequestLimits
from tpgraph.engine.scheduler import Scheduler
from tpgraph.engine.scheduler_config import SchedulerConfig
from tpgraph.engine.sequence import Sequence, Status
from tpgraph.errors import ConfigError, RequestError
from tpgraph.server.protocol import CompletionRequest


def make(blocks=100, seqs=4, tokens=64, policy="priority"):
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=64, block_size=4,
                          policy=policy)
    return Scheduler(cfg, BlockAllocator(blocks, first_block=1))


def seq(i, n, priority=0):
    return Sequence(i, list(range(1, n + 1)), 100, params=SamplingParams(priority=priority))


def test_the_queue_is_kept_in_priority_then_arrival_order():
    sched = make(seqs=1)
    a, b, c, d = seq(0, 4, 5), seq(1, 4, 1), seq(2, 4, 5), seq(3, 4, -2)
    for s in (a, b, c, d):
        sched.add(s)
    assert list(sched.waiting) == [d, b, a, c]
    assert [s for s, _ in sched.schedule().prefill] == [d]  # (one slot: the lowest priority value runs)
    fcfs = make(seqs=1, policy="fcfs")
    for s in (a, b, c, d):
        fcfs.add(s)
    assert list(fcfs.waiting) == [a, b, c, d]


def test_the_lowest_priority_is_preempted_not_the_newest_and_queues_in_its_place():
    sched = make(blocks=6)  # 24 token slots
    low, high, mid = seq(0, 8, 9), seq(1, 8, 0), seq(2, 4, 3)
    for s in (low, high, mid):
        sched.add(s)
    run(sched.schedule())  # 2 + 2 + 1 blocks: 5 of 6
    assert sched.running == [high, mid, low]  # (admitted in queue order)
    step = sched.schedule()  # two sequences need a block and one is free: the lowest priority (low) goes
    assert step.preempted == [low] and low.status is Status.WAITING and low.block_table == []
    assert sorted(s.seq_id for s in step.decode) == [1, 2]
    sched.add(later := seq(3, 2, 5))
    assert list(sched.waiting) == [later, low]  # (priority 5 before 9, whatever the arrival)


def test_first_come_first_served_takes_only_priority_zero():
    limits = RequestLimits(vocab_size=100, max_model_len=64, cache_tokens=1000)
    limits.check([1], SamplingParams(priority=0))
    with pytest.raises(RequestError, match="needs a server started with --scheduling-policy priority"):
        limits.check([1], SamplingParams(priority=3))
    RequestLimits(100, 64, 1000, priority_scheduling=True).check([1], SamplingParams(priority=-3))
    with pytest.raises(RequestError, match="priority must be an integer"):
        SamplingParams(priority=1.5)
    with pytest.raises(ConfigError, match="policy must be"):
        make(policy="lifo")
    assert CompletionRequest(model="m", prompt="p", priority=4).sampling_params(1, None).priority == 4
    with pytest.raises(ValueError, match="must be an integer"):
        CompletionRequest(model="m", prompt="p", priority=True)


def test_the_engine_serves_a_later_urgent_request_first():
    """One sequence at a time: the urgent request, queued last, gets its tokens before the two ahead of it."""
    with TPEngine(device="cpu", max_model_len=64, max_num_seqs=1, block_size=4, scheduling_policy="priority") as e:
        core, order = e.core, []

        def add(rid: str, priority: int) -> None:
            core.add_request(rid, e.encode("hello"), SamplingParams(temperature=0.0, max_tokens=3, priority=priority))

        add("a", 0)
        add("b", 0)
        order += [u.request_id for u in core.step() if u.token_id is not None]  # (a is admitted)
        add("urgent", -1)
        while core.has_work:
            order += [u.request_id for u in core.step() if u.token_id is not None and u.request_id not in order]
        assert order == ["a", "urgent", "b"]
    with pytest.raises(ConfigError, match="scheduling_policy must be one of fcfs, priority"):
        TPEngine(device="cpu", scheduling_policy="sjf")


def test_a_victim_scheduled_earlier_in_the_step_gives_its_budget_back():
    """Under priority the victim is the lowest running sequence wherever it stands, so it may already be in this
    step (FCFS's victim, the newest, never is). Its tokens must go back to the budget, as vLLM's scheduler does
    (`token_budget += num_scheduled_tokens[preempted_req.request_id]`): else the step runs short of what it may."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, block_size=4,
                                      policy="priority"), BlockAllocator(5, first_block=1))
    low = seq(0, 9, 9)
    sched.add(low)
    run(sched.schedule())  # low: 8 of its 9 prompt tokens (2 blocks)
    high, big = seq(1, 4, 0), seq(2, 20, 0)
    sched.add(high)
    sched.add(big)
    run(sched.schedule())  # low's last prompt token (3 blocks), high's prompt (1 block), big's first 3 (1 block)
    step = sched.schedule()  # low decodes (1 token), then high needs a block: low, the lowest, is preempted
    assert step.preempted == [low] and low.status is Status.WAITING and step.decode == [high]
    # 8 tokens: high's 1 and a chunk of 7 of big's prompt (2 of the 3 blocks low gave back); low's decode token, no
    # longer in the step, still held the budget: big got a chunk of 6
    assert [(s.seq_id, n) for s, n in step.prefill] == [(2, 7)], [(s.seq_id, n) for s, n in step.prefill]
    assert step.num_tokens == 8


def test_generate_takes_vllms_priority_list_one_for_each_prompt():
    """vLLM's LLM.generate(prompts, params, priority=[...]) (a TypeError here, where priority was a SamplingParams
    field alone): each prompt's priority, its list as long as the prompts; outputs stay in the prompts' order."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    with TPEngine(device="cpu", max_model_len=64, max_num_seqs=1, block_size=4, scheduling_policy="priority") as e:
        outs = e.generate(["a", "b", "c"], params, priority=[5, 0, 1])
        assert [o.prompt for o in outs] == ["a", "b", "c"]
        assert outs[1].latency_s < outs[2].latency_s < outs[0].latency_s  # (one at a time: b, then c, then a)
        with pytest.raises(RequestError, match=r"priority holds 1 value for 2 prompts"):
            e.generate(["a", "b"], params, priority=[1])
        with pytest.raises(RequestError, match=r"priority must be a list of integers, one for each prompt"):
            e.generate(["a"], params, priority=3)
    with TPEngine(device="cpu", max_model_len=64, max_num_seqs=1, block_size=4) as e:
        assert len(e.generate(["a", "b"], params, priority=[0, 0])) == 2
        with pytest.raises(RequestError, match=r"priority 2 needs .* scheduling_policy='priority'"):
            e.generate(["a", "b"], params, priority=[0, 2])


def test_a_step_that_preempts_admits_no_waiting_sequence():
    """As vLLM's scheduler (waiting requests are scheduled only `if not preempted_reqs`): the blocks a victim gives
    back are not handed to a waiting sequence in the same step, which would only make the next step preempt again."""
    sched = make(blocks=6)
    a, b = seq(0, 12, 5), seq(1, 8, 5)  # 3 + 2 blocks of 6
    for s in (a, b):
        sched.add(s)
    run(sched.schedule())
    sched.add(w := seq(2, 8, 0))  # needs 2 blocks, 1 is free: it waits
    step = sched.schedule()  # a's 13th token takes the free block, b's 9th has none: b preempts itself
    assert step.preempted == [b] and step.decode == [a]
    assert not step.prefill and w.status is Status.WAITING and list(sched.waiting) == [w, b]
    run(step)
    step = sched.schedule()  # the next step takes it
    assert [s for s, _ in step.prefill] == [w] and step.decode == [a]
