"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against Hugging Face's LlamaForCausalLM on the same
checkpoint: over chunked prefill, beside requests that do not ask, with the prompt's blocks already cached (it runs in
full all the same), with n > 1, and the bookkeeping that keeps a recomputed prompt's entries from doubling."""

import pytest
import torch
from tpgtest.hf_fixtures import make_checkpoint
from tpgtest.logprobs import own_logprobs, top_ids

from tpgraph import SamplingParams, TPEngine
from tpgraph.engine.core import EngineCore
from tpgraph.engine.prompt_logprobs import PASS_MIN_ROWS, PASS_ROWS, packed_logprobs, prompt_targets
from tpgraph.engine.sampler import SampleOutput
from tpgraph.engine.sequence import Sequence
from tpgraph.errors import RequestError

CASE = "llama32_tied_llama3rope_gqa"  # vocab 1001
PROMPT = [(37 * j + 11) % 1001 for j in range(45)]
OTHER = PROMPT[:20] + [5, 6, 7]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(CASE, tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def hf_reference(checkpoint) -> tuple[list[float], list[list[int]], list[int]]:
    """HF's log-probability of each PROMPT token after the ones before it (from the second on), the top-3 ids, and
    each token's rank (the ids HF finds at least as likely, itself among them)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    ranks = [int((lp[j - 1] >= lp[j - 1, PROMPT[j]]).sum()) for j in range(1, len(PROMPT))]
    return [lp[j - 1, PROMPT[j]].item() for j in range(1, len(PROMPT))], lp[:-1].topk(3).indices.tolist(), ranks


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in_turn"])
def test_prompt_logprobs_equal_hf_over_chunks_cached_blocks_and_n(checkpoint, hf_reference, overlap):
    """Overlapped, a chunk that samples nothing still sends its entries on their way with the step in flight."""
    want, top, ranks = hf_reference
    asks = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    with TPEngine(checkpoint, device="cpu", max_model_len=96, max_num_seqs=4, block_size=4, overlap_scheduling=overlap,
                  max_num_batched_tokens=16, num_kv_blocks=64) as engine:  # 45 tokens: three chunks and a bit
        first = engine.generate([PROMPT, OTHER], [asks, SamplingParams(temperature=0.0, max_tokens=2)])
        # the prompt's blocks are cached now; asked again (n = 3), it still runs in full for the first sample, whose
        # entries every sample reports, and the later two wait for them and read the prompt from the cache
        hits = engine.core.scheduler.prefix_hit_tokens
        # (top_k 1: each sample takes the likeliest token, as greedy would, which takes one sample)
        sampled = SamplingParams(temperature=1.0, top_k=1, max_tokens=2, n=3, prompt_logprobs=0)
        again = engine.generate([PROMPT], sampled)[0]
        assert engine.core.scheduler.prefix_hit_tokens == hits + 2 * 44  # (11 whole blocks each, the last token run)
        plain = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2))[0]
        assert engine.core.scheduler.prefix_hit_tokens > hits  # (one that does not ask reads them from the cache)
    out = first[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    assert own_logprobs(out.prompt_logprobs, PROMPT)[1:] == pytest.approx(want, abs=1e-4)
    assert top_ids(out.prompt_logprobs, 3)[1:] == top
    # prompt_logprobs=0: the token's own entry alone, with its rank (asked 3, a token among the top 3 ranks there)
    assert [list(e) for e in again.prompt_logprobs[1:]] == [[t] for t in PROMPT[1:]]
    assert [e[t].rank for e, t in zip(again.prompt_logprobs[1:], PROMPT[1:], strict=True)] == ranks and max(ranks) > 1
    assert [e[t].rank for e, t in zip(out.prompt_logprobs[1:], PROMPT[1:], strict=True)] == \
        [top[j].index(t) + 1 if t in top[j] else r for j, (t, r) in enumerate(zip(PROMPT[1:], ranks, strict=True))]
    assert first[1].prompt_logprobs is None  # it did not ask
    assert own_logprobs(again.prompt_logprobs, PROMPT)[1:] == pytest.approx(want, abs=1e-4)
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids == again.outputs[1].token_ids \
        == again.outputs[2].token_ids


def test_a_one_token_prompt_has_one_entry_none(checkpoint):
    with TPEngine(checkpoint, device="cpu", max_model_len=32, max_num_seqs=2, block_size=4) as engine:
        out = engine.generate([[42]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_are_checked():
    with pytest.raises(RequestError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21)


def test_a_chunk_names_only_the_prompt_tokens_after_its_positions_not_yet_read():
    seq = Sequence(0, list(range(10)), 4, params=SamplingParams(prompt_logprobs=0))
    assert prompt_targets(seq, 0, 4) == range(1, 5)  # positions 0-3 predict tokens 1-4
    assert prompt_targets(seq, 4, 6) == range(5, 10)  # the last position predicts the first output, not a prompt token
    seq.prompt_logprobs = [(1, -1.0, [])] * 6  # tokens 1-6 read back: a recompute gives only 7 on
    assert prompt_targets(seq, 0, 10) == range(7, 10) and seq.needs_prompt_logprobs
    seq.prompt_logprobs = [(1, -1.0, [])] * 9
    assert not prompt_targets(seq, 0, 10) and not seq.needs_prompt_logprobs


def test_entries_given_twice_are_kept_once_in_order():
    """A prompt recomputed after a preemption gives entries it has already: only the next in line are kept."""
    seq = Sequence(0, list(range(8)), 4, params=SamplingParams(prompt_logprobs=1))

    def chunk(first, n):
        ids = list(range(first, first + n))
        return SampleOutput(ids, [-float(t) for t in ids], [[t + 100] for t in ids], [[-0.5] for _ in ids],
                            ranks=[t + 1 for t in ids])

    EngineCore._read_prompt_logprobs(seq, 1, chunk(1, 3))
    EngineCore._read_prompt_logprobs(seq, 1, chunk(1, 5))  # (again from the start: 4 and 5 are new)
    EngineCore._read_prompt_logprobs(seq, 7, chunk(7, 1))
    assert [t for t, _, _ in seq.prompt_logprobs] == [1, 2, 3, 4, 5]  # (7 came before 6: not kept)
    assert seq.prompt_logprobs[3] == (4, -4.0, [(104, -0.5)]) and seq.prompt_ranks == [2, 3, 4, 5, 6]


def test_long_chunks_are_gathered_a_pass_at_a_time_from_the_rows_named():
    calls = []
    weight = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))

    def compute_logits(hidden):
        calls.append(len(hidden))
        return hidden @ weight

    hidden = torch.randn(PASS_ROWS + 10, 8, generator=torch.Generator().manual_seed(1))
    rows = torch.randperm(PASS_ROWS + 10, generator=torch.Generator().manual_seed(2))[:PASS_ROWS + 3]
    targets = torch.arange(PASS_ROWS + 3) % 50
    packed = packed_logprobs(compute_logits, hidden, rows, targets, 2)
    lp = (hidden[rows] @ weight).log_softmax(-1)
    assert calls == [PASS_ROWS, PASS_MIN_ROWS] and packed.shape == (PASS_ROWS + 3, 7)  # (3 rows padded: cuBLAS)
    assert torch.equal(packed[:, 0].long(), targets)
    chosen = lp.gather(1, targets[:, None])
    assert torch.allclose(packed[:, 1], chosen[:, 0].double(), atol=1e-6)
    assert torch.equal(packed[:, 2:4].long(), lp.topk(2).indices)
    assert torch.equal(packed[:, 6].long(), (lp >= chosen).sum(1))  # (each target's rank, last: ties count)


def test_preempted_and_recomputed_prompts_give_each_entry_once_as_without_preemption():
    prompts = ["The quick brown fox", "tpgraph", "a" * 30, "Hello, world! How are you today, my friend?"]
    params = [SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2 if i % 2 else 0) for i in range(4)]
    outs = []
    for blocks in (17, 200):  # 17 blocks of 4: preemption; 200: none
        with TPEngine(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=blocks, block_size=4,
                      max_num_batched_tokens=16) as engine:
            outs.append(engine.generate(prompts, params))
            assert (engine.core.scheduler.num_preemptions > 0) == (blocks == 17)
    for tight, roomy in zip(*outs, strict=True):
        assert len(tight.prompt_logprobs) == len(tight.prompt_token_ids)
        ids = tight.prompt_token_ids
        assert own_logprobs(tight.prompt_logprobs, ids)[1:] == pytest.approx(own_logprobs(roomy.prompt_logprobs,
                                                                                          ids)[1:], abs=1e-5)
        assert top_ids(tight.prompt_logprobs, 2) == top_ids(roomy.prompt_logprobs, 2)


def test_short_prompts_asking_share_one_pass_and_each_keeps_its_own_k(checkpoint):
    """An evaluation sends many short prompts: their entries come from one gathered pass (each pass is an all-gather
    at TP > 1), each sequence reading its own k of the widest k asked, the same entries as each prompt alone."""
    prompts = [PROMPT[i:i + 6 + i] for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=i % 3) for i in range(5)]
    with TPEngine(checkpoint, device="cpu", max_model_len=96, max_num_seqs=8, block_size=4,
                  enable_prefix_caching=False) as engine:
        alone = [engine.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
        calls = []
        real = engine.model.compute_logits
        engine.model.compute_logits = lambda hidden, *a, **k: calls.append(len(hidden)) or real(hidden, *a, **k)
        together = engine.generate(prompts, params)
    want_rows = sum(len(p) - 1 for p in prompts)
    assert calls == [want_rows, len(prompts)]  # one pass for every prompt's entries, then the last tokens' logits
    for got, one, q in zip(together, alone, params, strict=True):
        ids = got.prompt_token_ids
        assert own_logprobs(got.prompt_logprobs, ids)[1:] == pytest.approx(own_logprobs(one.prompt_logprobs,
                                                                                        ids)[1:], abs=1e-5)
        tops = top_ids(got.prompt_logprobs, q.prompt_logprobs)
        assert tops == top_ids(one.prompt_logprobs, q.prompt_logprobs)
        assert {len(top) for top in tops[1:]} == {q.prompt_logprobs}


@pytest.mark.parametrize("caching", [True, False], ids=["prefix_cache", "no_cache"])
def test_n_samples_compute_the_prompt_entries_once_and_each_reports_them(checkpoint, caching):
    """n = 3: with the prefix cache, the first sample's prefill computes the request's prompt entries and the other
    two wait until they are read back, then read the prompt from the cache. Without it they would wait for nothing
    to share: each computes its own. Either way every sample's first update brings the same entries."""
    with TPEngine(checkpoint, device="cpu", max_model_len=96, max_num_seqs=4, block_size=4,
                  enable_prefix_caching=caching, num_kv_blocks=64) as engine:
        core = engine.core
        computed = []
        original = core.runner._prompt_logprobs

        def spy(spans, hidden):
            computed.extend(seq.sample_index for seq, _, _ in spans if seq.computes_prompt_logprobs)
            return original(spans, hidden)

        core.runner._prompt_logprobs = spy
        core.add_request("r", PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=2, n=3, prompt_logprobs=1))
        firsts = {}
        while core.has_work:
            for u in core.step():
                if u.token_id is not None:
                    firsts.setdefault(u.sample_index, u)
    assert computed == ([0] if caching else [0, 1, 2]) and sorted(firsts) == [0, 1, 2]
    assert len(firsts[0].prompt_logprobs) == len(PROMPT) - 1
    assert all(firsts[i].prompt_logprobs == firsts[0].prompt_logprobs for i in (1, 2))
    assert all(firsts[i].prompt_ranks == firsts[0].prompt_ranks for i in (1, 2))


def test_later_samples_waiting_for_the_prompt_entries_count_the_blocks_they_will_share(checkpoint):
    """The samples that wait for the first's prompt entries will read its prompt's whole blocks from the cache: the
    room the scheduler keeps for them leaves those blocks out (it reserved their whole prompts before)."""
    with TPEngine(checkpoint, device="cpu", max_model_len=96, max_num_seqs=4, block_size=4,
                  num_kv_blocks=64) as engine:
        core = engine.core
        core.add_request("r", PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=2, n=3, prompt_logprobs=1))
        core.scheduler.schedule()
        waiting = list(core.scheduler.waiting)
    assert [s.sample_index for s in waiting] == [1, 2]
    assert all(s.awaits_prompt_logprobs for s in waiting)
    assert [s.awaited_blocks for s in waiting] == [(len(PROMPT) - 1) // 4] * 2


def test_a_first_sample_preempted_mid_prompt_queues_ahead_of_the_samples_that_wait_for_it(checkpoint):
    """The later samples wait for the first's prompt entries (awaited_blocks > 0 while it computes them). A preempted
    sequence queued behind every such waiter, so the first sample went behind its own waiters, where it may only go
    in whole (a deferred slot ahead of it), which a prompt longer than the token budget never can (helper-105; the
    read-back in flight ends the wait a step later, so it did not hang, but nothing but that timing kept it so)."""
    from tpgraph.engine.scheduler import ScheduledStep

    with TPEngine(checkpoint, device="cpu", max_model_len=96, max_num_seqs=4, block_size=4, num_kv_blocks=64,
                  max_num_batched_tokens=8) as engine:
        core, sched = engine.core, engine.core.scheduler
        core.add_request("r", PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=2, n=3, prompt_logprobs=1))
        # the first sample's last chunk leaves budget for the scheduler to reach its waiters (earlier chunks take it
        # all): then, its entries still in flight (overlapped), it is preempted
        while not (sched.waiting and all(s.awaited_blocks for s in sched.waiting)):
            core.step()
        (first,) = sched.running
        assert first.sample_index == 0 and first.needs_prompt_logprobs
        sched._preempt(first, ScheduledStep())
        assert sched.waiting[0] is first
        finished, steps = set(), 0
        while core.has_work:
            steps += 1
            assert steps < 200, "the request never finished"
            finished |= {u.sample_index for u in core.step() if u.finish_reason is not None}
    assert finished == {0, 1, 2}
