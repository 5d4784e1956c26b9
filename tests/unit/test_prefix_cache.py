"""Automatic prefix caching: the allocator's naming, sharing, reference counts and eviction, and the engine's tokens
with it on equal to those with it off (repeated prompts, shared prefixes, chunks, preemption, sampling, n > 1, a
chat's next turn)."""

import pytest
import torch
from tpgtest.copies import CountedIds
from tpgtest.prefix_engines import BS, engine, prefill_tokens

from tpgraph import SamplingParams
from tpgraph.engine.prefix_cache import PrefixCachingAllocator, block_name
from tpgraph.engine.sequence import PENDING_TOKEN, Sequence


def seq(tokens, seq_id=0, outputs=()):
    return Sequence(seq_id, list(tokens), 16, output_ids=list(outputs))


def computed(alloc, s):
    """Admit s (its cached prefix, then blocks for the rest) as if its whole K/V had been computed."""
    alloc.match(s)
    s.block_table += alloc.allocate(s.blocks_needed(BS, len(s)))
    s.num_cached = len(s)
    alloc.register(s)
    return s


def release(alloc, s):
    alloc.free(s.block_table)
    s.forget_blocks()


def test_a_repeated_prompt_shares_its_full_blocks_and_computes_its_last_token():
    alloc = PrefixCachingAllocator(16, BS)
    a = computed(alloc, seq(range(10)))  # blocks [0-3] [4-7] named, [8-9] partial
    assert alloc.num_cached_blocks == 2
    b = seq(range(10), seq_id=1)
    assert alloc.match(b) == 8 and b.block_table == a.block_table[:2]
    exact = seq(range(8), seq_id=2)  # two whole blocks: the second is left to compute (its logits are the output)
    assert alloc.match(exact) == 4 and exact.block_table == a.block_table[:1]


def test_a_name_covers_the_whole_prefix():
    alloc = PrefixCachingAllocator(16, BS)
    computed(alloc, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert alloc.match(seq([1, 2, 3, 4, 0, 6, 7, 8, 9])) == 4  # differs in block 2: block 1 only
    assert alloc.match(seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0  # block 2's tokens alone are not enough
    assert block_name(b"", [1, 2]) != block_name(block_name(b"", [0]), [1, 2])


def test_shared_blocks_are_counted_and_idle_ones_are_reused_oldest_tail_first():
    alloc = PrefixCachingAllocator(6, BS)
    a = computed(alloc, seq(range(12)))  # 3 blocks, all named
    b = seq(range(13), seq_id=1)
    alloc.match(b)
    assert b.block_table == a.block_table and alloc.num_free == 3
    table = list(a.block_table)
    release(alloc, a)
    assert alloc.num_free == 3, "b still holds every block a named"
    release(alloc, b)
    assert alloc.num_free == 6 and alloc.num_cached_blocks == 3, "idle blocks stay named and count as free"
    fresh = alloc.allocate(4)  # the 3 never-named blocks, then the oldest idle one: a's tail
    assert table[2] in fresh and not set(table[:2]) & set(fresh)
    assert alloc.num_cached_blocks == 2
    assert alloc.match(seq(range(12), seq_id=2)) == 8, "the prefix survives its tail's eviction"


def test_pending_and_uncomputed_tokens_are_never_named():
    alloc = PrefixCachingAllocator(16, BS)
    s = seq(range(6), outputs=[6, PENDING_TOKEN, PENDING_TOKEN])
    s.num_pending = 2
    s.block_table = alloc.allocate(3)
    s.num_cached = 9  # (the device computed the pending tokens' K/V; their ids are not on the host yet)
    alloc.register(s)
    assert alloc.num_cached_blocks == 1 and s.num_registered == 1  # tokens 0-3; block 2 holds a pending id
    s.num_cached = 3
    t = seq(range(12), seq_id=1)
    t.block_table = alloc.allocate(3)
    t.num_cached = 7  # K/V computed for 7 tokens: one full block
    alloc.register(t)
    assert t.num_registered == 1


def test_the_same_prefix_computed_twice_at_once_names_one_block():
    alloc = PrefixCachingAllocator(8, BS)
    a, b = seq(range(8)), seq(range(8), seq_id=1)
    for s in (a, b):  # both admitted before either is computed: no match
        s.block_table = alloc.allocate(2)
        s.num_cached = 8
    alloc.register(a)
    alloc.register(b)
    assert alloc.num_cached_blocks == 2
    release(alloc, b)
    assert alloc.num_free == 6 and len(alloc._free) == 6, "b's copies were never named: plain free blocks"
    with pytest.raises(ValueError, match="already holds blocks"):
        alloc.match(a)


# ---- the engine, on CPU: tokens with prefix caching equal those without ------------------------------------------
SHARED = "You are a helpful assistant. Answer briefly and well. "


def run(caching, batches, **kw):
    """Each batch of (prompt, params) through one engine in turn; the tokens, and the tokens found cached."""
    with engine(caching, **kw) as e:
        out = [[[c.token_ids for c in o.outputs] for o in e.generate([p for p, _ in b], [q for _, q in b])]
               for b in batches]
        return out, e.core.scheduler.prefix_hit_tokens, e.core.scheduler.num_preemptions


GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, n=2)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_engine_tokens_equal_without_caching_and_prefixes_are_found(kw):
    batches = [[(SHARED + "What is 2+2?", GREEDY), (SHARED + "Name a colour.", SAMPLED)],
               [(SHARED + "What is 2+2?", GREEDY), (SHARED + "Name a fruit.", GREEDY)],
               [(SHARED + "Name a colour.", SAMPLED)]]
    off, none, _ = run(False, batches, **kw)
    on, hits, _ = run(True, batches, **kw)
    assert none == 0
    assert on == off
    assert hits >= 4 * (len(SHARED) // 4 * 4), "the later batches found the shared prefix cached"


def test_preempted_sequences_come_back_through_the_cache_with_the_same_tokens():
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    batches = [[(SHARED + f"request {i}", long) for i in range(4)]]
    kw = dict(num_kv_blocks=40)  # 4 x 94 tokens do not fit 160: the newest are preempted and recomputed
    off, _, preempted_off = run(False, batches, **kw)
    on, hits, preempted_on = run(True, batches, **kw)
    assert preempted_off and preempted_on
    assert on == off and hits > 0


def test_a_chat_turn_reuses_the_last_turn_and_its_answer():
    with engine(True) as e:
        first = e.generate(SHARED + "Hi", GREEDY)[0].outputs[0]
        turn = e.encode(SHARED + "Hi") + first.token_ids + e.encode(" And then?")
        before = e.core.scheduler.prefix_hit_tokens
        e.generate([turn], GREEDY)
        found = e.core.scheduler.prefix_hit_tokens - before
        assert found >= (len(e.encode(SHARED + "Hi")) + len(first.token_ids) - 1) // 4 * 4 - 4
    with engine(False) as e:
        want = e.generate([turn], GREEDY)[0].outputs[0].token_ids
    with engine(True) as e:
        e.generate(SHARED + "Hi", GREEDY)
        assert e.generate([turn], GREEDY)[0].outputs[0].token_ids == want


def test_later_samples_wait_for_the_first_to_compute_the_prompt_and_share_it():
    """n = 4: the prompt is computed once; each later sample computes only what lies past the prompt's last full
    block (its last partial block, or its last token)."""
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=6)
    prompt = SHARED + "Tell me a story."  # 70 tokens: 17 full blocks, the 18th partial
    with engine(False, max_num_batched_tokens=256) as e:  # (room for all four in one step: they would go together)
        want = [c.token_ids for c in e.generate(prompt, params)[0].outputs]
        plain = prefill_tokens(e)
    with engine(True, max_num_batched_tokens=256) as e:
        n = len(e.encode(prompt))
        got = [c.token_ids for c in e.generate(prompt, params)[0].outputs]
        shared = prefill_tokens(e)
    assert got == want
    assert plain == 4 * n
    assert shared == n + 3 * (n - (n - 1) // 4 * 4)


def burst(e, prompts):
    """Queue every prompt at once (one token each) and step until done: the prompt tokens computed."""
    before = prefill_tokens(e)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.core.add_request(f"burst-{i}-{before}", e.encode(p), params)
    while e.core.has_work:
        e.core.step()
    return prefill_tokens(e) - before


def test_a_burst_computes_a_new_common_prefix_once_and_a_cached_one_not_at_all():
    questions = [SHARED * 2 + q for q in ("Why?", "How so?", "What then?", "Who?")]
    with engine(True, max_model_len=160, max_num_batched_tokens=64) as e:
        n_shared = len(e.encode(SHARED * 2))
        own = sum(len(e.encode(q)) - n_shared for q in questions)
        first = burst(e, questions)
        assert first <= n_shared + own + 3 * 4, "the first computes the common prefix, the others wait and share it"
        again = burst(e, [SHARED * 2 + q for q in ("And?", "So?", "Then?", "Else?")])
        assert again <= 4 * (4 + 8), "the common prefix is cached: each computes its own tail only"
    with engine(False, max_model_len=160, max_num_batched_tokens=64) as e:
        assert burst(e, questions) == sum(len(e.encode(q)) for q in questions)


def test_requests_sharing_a_cached_prefix_prefill_together():
    """Waiting is only for blocks in flight: with the common prefix cached, a burst's prefills run in one step."""
    with engine(True, max_model_len=160, max_num_batched_tokens=256) as e:
        e.generate(SHARED * 2 + "warm", SamplingParams(temperature=0.0, max_tokens=1))
        for i, q in enumerate(("Why?", "How so?", "What then?", "Who?")):
            e.core.add_request(f"q{i}", e.encode(SHARED * 2 + q), SamplingParams(temperature=0.0, max_tokens=1))
        e.core.step()
        admitted = e.core.scheduler.running
        assert len(admitted) == 4 and all(s.num_cached >= len(e.encode(SHARED * 2)) // 4 * 4 for s in admitted)


def test_waiting_starts_for_enough_shared_tokens_and_lasts_until_they_are_computed():
    alloc = PrefixCachingAllocator(32, BS)
    s = seq(range(40))  # running, computing its prompt
    s.block_table = alloc.allocate(10)
    few = seq([*range(12), 99, 98, 97], seq_id=1)  # 3 blocks in common with s: 12 < 32 tokens, not worth a step
    many = seq([*range(36), 99], seq_id=2)  # 9 blocks in common
    assert not alloc.worth_waiting(few, [s]) and not few.awaited_blocks
    assert alloc.worth_waiting(many, [s]) and many.awaited_blocks == 9
    s.num_cached = 28
    alloc.register(s)  # 7 blocks computed and named: 2 left in common, which many still waits for
    assert alloc.worth_waiting(many, [s])
    fresh = seq([*range(36), 99], seq_id=3)  # ... while a newcomer would not start waiting for 2 blocks
    assert not alloc.worth_waiting(fresh, [s])
    s.num_cached = 40
    alloc.register(s)
    assert not alloc.worth_waiting(many, [s]) and not many.awaited_blocks
    assert alloc.match(many) == 36
    assert not alloc.worth_waiting(seq(range(40), seq_id=4), [])


def test_each_request_reports_its_prompt_tokens_found_cached():
    """GenerationOutput.num_cached_tokens (the server's usage.prompt_tokens_details.cached_tokens): the prompt
    tokens its first sample found in the prefix cache when first admitted; none without caching."""
    prompt = SHARED + "What is 2+2?"
    with engine(True) as e:
        first = e.generate(prompt, GREEDY)[0]
        again = e.generate(prompt, GREEDY)[0]
        other = e.generate(SHARED + "Name a colour.", GREEDY)[0]
        n = len(e.encode(prompt))
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == (n - 1) // BS * BS  # (its whole blocks; the last token is computed)
        assert 0 < other.num_cached_tokens <= len(e.encode(SHARED)) // BS * BS + BS
    with engine(False) as e:
        assert e.generate(prompt, GREEDY)[0].num_cached_tokens == 0



def test_reset_prefix_cache_forgets_every_prefix_only_where_no_block_is_held():
    """vLLM's reset_prefix_cache (LLM.reset_prefix_cache: a benchmark's cold runs): idle named blocks become plain free
    ones; while a sequence holds blocks, False and nothing changes. It did not exist."""
    alloc = PrefixCachingAllocator(6, BS)
    a = computed(alloc, seq(range(12)))
    assert not alloc.reset_prefix_cache() and alloc.num_cached_blocks == 3  # (a holds them)
    release(alloc, a)
    assert alloc.reset_prefix_cache() and alloc.num_cached_blocks == 0 and alloc.num_free == 6
    assert alloc.match(seq(range(12), seq_id=1)) == 0
    assert sorted(alloc.allocate(6)) == list(range(6))  # (every block handed out once)
    with engine(True) as e:
        prompt = SHARED + "What is 2+2?"
        first = e.generate(prompt, GREEDY)[0]
        again = e.generate(prompt, GREEDY)[0]
        assert e.reset_prefix_cache()
        cold = e.generate(prompt, GREEDY)[0]
        e.core.add_request("running", e.encode(prompt), GREEDY)
        e.core.step()
        assert not e.reset_prefix_cache()  # (a request runs: refused, with a warning)
    assert again.num_cached_tokens > 0 and cold.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == cold.outputs[0].token_ids


def _decode_as_new_owner(runner, owner, prompt, params, template):
    """The log-probabilities (the engine) or logits (greedy_generate) of prompt's decode steps, by a new owner of the
    runner whose sequence ids start from 0."""
    from tpgraph.engine.core import EngineCore
    from tpgraph.engine.greedy import greedy_generate

    if owner == "greedy":
        return greedy_generate(runner, [prompt], params.max_tokens, keep_logits=True).step_logits
    core = EngineCore(runner, template.scheduler.cfg, eos_ids=template.eos_ids, tokenizer=template.tokenizer)
    core.add_request("r", prompt, params)
    got = []
    while core.has_work:
        got += [torch.tensor(u.logprob) for u in core.step() if u.token_id is not None]
    return got


@pytest.mark.parametrize("owner", ["engine", "greedy"])
def test_a_new_owner_of_the_runner_decodes_over_its_own_blocks(owner):
    """An EngineCore (or greedy_generate) made on a runner that served another numbers its sequences from 0 again,
    as the penalty table expects. The runner kept each decode row's block table keyed by (sequence id, preemptions,
    table length), so the new owner's sequence 0 found the old one's row 'unchanged' and attended over the old
    sequence's blocks: with prefix caching (its idle named blocks are not handed out first) its log-probabilities
    were not a fresh engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    first, second = list(range(1, 11)), list(range(50, 60))  # (the same length: the same decode rows' keys)
    with engine(True) as e:
        want = _decode_as_new_owner(e.runner, owner, second, params, e.core)
    with engine(True) as e:
        # sequence 0 decodes once: row 0 keeps its table, under the key the next owner's sequence 0 will have
        e.generate([first], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        got = _decode_as_new_owner(e.runner, owner, second, params, e.core)
    assert len(got) == len(want) and all(torch.allclose(g, w, atol=1e-4) for g, w in zip(got, want, strict=True))


def test_reset_prefix_cache_after_an_interrupted_generate_resets_it(monkeypatch):
    """A Ctrl-C aborts the call's requests, but its last step stayed in flight (its rows all dropped), so
    reset_prefix_cache answered False, warning that requests were running though none was, and the next cold run
    read the cache."""
    import contextlib
    import threading

    from tpgraph.engine import tp_engine

    @contextlib.contextmanager
    def pressed():
        flag = threading.Event()
        flag.set()  # (Ctrl-C before the first step ends)
        yield flag

    short = SamplingParams(temperature=0.0, max_tokens=2)
    with engine(True) as e:
        prompt = SHARED + "What is 2+2?"
        monkeypatch.setattr(tp_engine, "deferred_interrupt", pressed)
        with pytest.raises(KeyboardInterrupt):
            e.generate(prompt, short)
        monkeypatch.undo()
        assert e.core.scheduler.allocator.num_cached_blocks > 0  # (the interrupted call's prompt)
        assert e.reset_prefix_cache() and e.core.scheduler.allocator.num_cached_blocks == 0
        assert e.generate(prompt, short)[0].num_cached_tokens == 0


def test_naming_a_decoding_sequences_blocks_copies_each_id_a_bounded_number_of_times():
    """Each block a decode filled was named from seq.token_ids, the prompt and outputs copied whole: a reply of L
    tokens copied L * L / block_size ids in all. A block's name now reads only its own ids."""
    alloc = PrefixCachingAllocator(4096, BS)
    prompt, length = CountedIds(range(40)), 40 + 2000
    s = computed(alloc, Sequence(0, prompt, 4096, output_ids=CountedIds()))
    CountedIds.copied = 0
    while len(s) < length:
        s.output_ids.append(len(s))
        s.block_table += alloc.allocate(s.blocks_needed(BS, len(s)))
        s.num_cached = len(s)
        alloc.register(s)
    assert s.num_registered == length // BS
    assert CountedIds.copied <= 2 * length, CountedIds.copied


def test_a_preempted_sequences_lookup_is_counted_apart_from_new_requests():
    """As vLLM's PrefixCacheStats: a recomputed sequence finding its own blocks again is no hit of the prefix cache's
    queries (vllm:prefix_cache_queries / hits); it is counted apart."""
    from tpgtest.scheduling import run_step

    from tpgraph.engine.scheduler import Scheduler
    from tpgraph.engine.scheduler_config import SchedulerConfig

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS),
                      PrefixCachingAllocator(6, BS, 1))
    a, b = seq(range(1, 9), 0), seq(range(20, 28), 1)  # 2 blocks each, the third as they grow
    for s in (a, b):
        sched.add(s)
    run_step(sched.schedule())
    assert (sched.prefix_queried_tokens, sched.prefix_hit_tokens) == (16, 0)
    for _ in range(4):
        run_step(sched.schedule())  # 12 tokens each: 3 blocks each, all 6
    step = sched.schedule()  # a's 13th token needs a block: b (newest) is preempted, its 2 full blocks named
    assert step.preempted == [b]
    run_step(step)
    sched.finish(a, "stop")  # room for b again: it finds its own blocks (but the tail one a took)
    sched.schedule()
    assert b.status.value == "running" and b.num_cached == 2 * BS
    assert (sched.prefix_queried_tokens, sched.prefix_hit_tokens) == (16, 0)
    assert (sched.preempted_queried_tokens, sched.preempted_hit_tokens) == (13, 2 * BS)


def test_a_sequence_that_never_looks_in_the_prefix_cache_is_no_query_of_it():
    """As vLLM's KVCacheManager.record_prefix_cache_stats ("don't count a request that skipped the cache lookup"):
    with prefix caching off, or for a prompt that runs in full for its prompt log-probabilities, nothing is looked up,
    so nothing is counted in vllm:prefix_cache_queries. Both were counted as lookups that missed: a server with the
    cache off reported a hit rate of 0 rather than none, and evaluation requests (echo with logprobs) pulled the hit
    rate of the others down."""
    from tpgraph.engine.kv_cache import BlockAllocator
    from tpgraph.engine.scheduler import Scheduler
    from tpgraph.engine.scheduler_config import SchedulerConfig

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS)
    off = Scheduler(cfg, BlockAllocator(8, 1))
    off.add(seq(range(1, 9)))
    off.schedule()
    assert (off.prefix_queried_tokens, off.prefix_hit_tokens) == (0, 0)

    on = Scheduler(cfg, PrefixCachingAllocator(8, BS, 1))
    whole = Sequence(0, list(range(1, 9)), 16, params=SamplingParams(prompt_logprobs=1))
    plain = seq(range(20, 25), 1)
    for s in (whole, plain):
        on.add(s)
    on.schedule()
    assert whole.num_cached == 0 and (on.prefix_queried_tokens, on.prefix_hit_tokens) == (5, 0)


def salted(tokens, salt, seq_id=0):
    return Sequence(seq_id, list(tokens), 16, params=SamplingParams(cache_salt=salt))


def test_a_cache_salt_shares_blocks_only_with_its_own_salt():
    """vLLM's cache_salt: the first block's parent, so a salted prompt's blocks are found only by the same salt (a
    tenant's prompts neither reused by nor timed from another's), and unsalted ones only unsalted."""
    alloc = PrefixCachingAllocator(32, BS)
    computed(alloc, salted(range(12), "tenant-a"))
    assert alloc.match(salted(range(12), "tenant-a", seq_id=1)) == 8
    assert alloc.match(salted(range(12), "tenant-b", seq_id=2)) == 0
    assert alloc.match(seq(range(12), seq_id=3)) == 0
    computed(alloc, seq(range(12), seq_id=4))
    assert alloc.match(seq(range(12), seq_id=5)) == 8
    assert alloc.match(salted(range(12), "tenant-c", seq_id=6)) == 0


def test_a_salted_request_waits_only_for_a_prefix_of_its_own_salt():
    """In-batch sharing (worth_waiting) follows the salt: a burst of one prompt under two salts computes it twice."""
    alloc = PrefixCachingAllocator(64, BS)
    running = salted(range(40), "a")
    running.block_table = alloc.allocate(running.blocks_needed(BS, len(running)))
    assert alloc.worth_waiting(salted(range(40), "a", seq_id=1), [running])
    assert not alloc.worth_waiting(salted(range(40), "b", seq_id=2), [running])


def test_a_cache_salt_with_a_lone_surrogate_names_blocks_of_its_own():
    """A Python str salt holding a lone surrogate (a JSON "\\ud800" read by json.loads) names blocks as any salt does,
    apart from other salts: no UnicodeEncodeError out of the scheduler's step (where it failed the whole batch)."""
    alloc = PrefixCachingAllocator(32, BS)
    computed(alloc, salted(range(12), "a\ud800"))
    assert alloc.match(salted(range(12), "a\ud800", seq_id=1)) == 8
    assert alloc.match(salted(range(12), "a\udc00", seq_id=2)) == 0
    assert alloc.match(seq(range(12), seq_id=3)) == 0


@pytest.mark.parametrize("salt", ["", 7, b"x"])
def test_a_cache_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt=salt)


def test_the_engine_reports_cached_prompt_tokens_only_under_the_same_salt():
    prompt = SHARED + "What is 2+2?"
    with engine(True) as e:
        first = e.generate(prompt, SamplingParams(temperature=0, max_tokens=4, cache_salt="a"))[0]
        other = e.generate(prompt, SamplingParams(temperature=0, max_tokens=4, cache_salt="b"))[0]
        same = e.generate(prompt, SamplingParams(temperature=0, max_tokens=4, cache_salt="a"))[0]
        unsalted = e.generate(prompt, GREEDY)[0]
        assert first.num_cached_tokens == other.num_cached_tokens == unsalted.num_cached_tokens == 0
        assert same.num_cached_tokens > 0
        assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids


def test_a_vllm_prompt_dicts_cache_salt_salts_that_prompt_as_vllms():
    """vLLM gives a cache salt in the prompt dict ({"prompt": ..., "cache_salt": ...}: its SamplingParams has no such
    field), which was refused here though the engine salts its prefix cache: it is now that prompt's cache_salt."""
    prompt = SHARED + "What is 2+2?"
    with engine(True) as e:
        first = e.generate({"prompt": prompt, "cache_salt": "a"}, GREEDY)[0]
        other, same, unsalted = e.generate([{"prompt": prompt, "cache_salt": "b"},
                                            {"prompt_token_ids": first.prompt_token_ids, "cache_salt": "a"}, prompt],
                                           GREEDY)
        assert first.num_cached_tokens == other.num_cached_tokens == unsalted.num_cached_tokens == 0
        assert same.num_cached_tokens > 0 and same.prompt is None and first.prompt == prompt
        with pytest.raises(ValueError, match="prompt 1 was refused: cache_salt must be a non-empty string"):
            e.generate([prompt, {"prompt": prompt, "cache_salt": ""}], GREEDY)
