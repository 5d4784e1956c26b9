"""Overlapped scheduling on CPU with the built-in model: each step is launched before the last one's tokens are read,
the pending token reaching the next step on the device. Every output (tokens, text, finish reasons, log-probabilities)
must equal the engine's with overlap off, through stops, penalties, preemption, chunked prefill and aborts."""

import importlib.util
import os

import pytest
import torch

from tpgraph import SamplingParams, TPEngine
from tpgraph.engine import sampler as sampler_module
from tpgraph.engine.core import EngineCore
from tpgraph.engine.sequence import PENDING_TOKEN, Sequence
from tpgraph.errors import ConfigError
from tpgraph.kernels.tokens import resolve_input_ids, resolve_input_ids_reference

PROMPTS = ["The quick brown fox", "tpgraph", "a" * 30, "Hello, world! How are you today, my friend?"]


def engine(**kw):
    base = dict(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=64, block_size=4)
    return TPEngine(**{**base, **kw})


def outputs(out):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in out]


def logprobs(out):
    """Every log-probability, flat. A step may hold a row more with overlap (a sequence stopped by the token still
    being read runs once more, its token dropped), and a CPU matmul over another row count rounds differently."""
    flat = []
    for o in out:
        for c in o.outputs:
            flat += [v.logprob for entry in c.logprobs or [] for v in entry.values()]
    return flat


MIXED = [SamplingParams(temperature=0.0, max_tokens=None),  # runs until max_model_len stops it
         SamplingParams(temperature=1.0, top_p=0.9, seed=5, n=2, max_tokens=10, logprobs=2),
         SamplingParams(temperature=0.0, max_tokens=12, stop=["aaa"]),
         SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=9, min_tokens=4, repetition_penalty=1.3,
                        frequency_penalty=0.5)]


NO_PENALTIES = MIXED[:3] + [SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=9, min_tokens=4)]


def count_overlapped(e: TPEngine, monkeypatch) -> list[bool]:
    """Record, per step, whether it was launched before the previous step was read."""
    seen: list[bool] = []
    step = e.core.step

    def counted(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(e.core.timing.overlapped)
        return out

    monkeypatch.setattr(e.core, "step", counted)
    return seen


@pytest.mark.parametrize("params", [MIXED, NO_PENALTIES], ids=["penalties", "no-penalties"])
@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 17}, {"max_num_batched_tokens": 32},
                                {"max_num_seqs": 1}], ids=["plain", "preemption", "chunked", "one-at-a-time"])
def test_overlap_changes_no_output(kw, params, monkeypatch):
    with engine(overlap_scheduling=False, **kw) as e:
        plain = count_overlapped(e, monkeypatch)
        want = e.generate(PROMPTS, params)
    with engine(**kw) as e:
        overlapped = count_overlapped(e, monkeypatch)
        got = e.generate(PROMPTS, params)
        assert not e.core.has_work and e.runner.allocator.num_free == e.runner.allocator.num_blocks
        if kw.get("num_kv_blocks"):
            assert e.core.scheduler.num_preemptions > 0
    assert plain and not any(plain)
    # penalties or not, most steps overlap: not the first, nor one with nothing to launch (a sequence sitting out
    # while its last token is read), nor the last
    assert sum(overlapped) >= 0.75 * len(overlapped) and sum(overlapped) > 5
    assert outputs(got) == outputs(want)
    assert len(logprobs(got)) == len(logprobs(want)) > 0
    assert logprobs(got) == pytest.approx(logprobs(want), rel=1e-5, abs=1e-5)


def record(obj, name: str, log: list[str], entry: str, monkeypatch) -> None:
    """Append `entry` to log at each call of obj.name."""
    method = getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda *a, **k: (log.append(entry), method(*a, **k))[1])


def order_of_calls(e: TPEngine, monkeypatch) -> list[str]:
    """Record, in order, each decode launch and each read of sampled tokens."""
    log: list[str] = []
    result = sampler_module.PendingSample.result
    for name in ("decode", "decode_greedy"):  # (plain-greedy steps take decode_greedy)
        record(e.runner, name, log, "launch", monkeypatch)
    monkeypatch.setattr(sampler_module.PendingSample, "result", lambda self: (log.append("read"), result(self))[1])
    return log


def test_each_decode_step_is_launched_before_the_last_ones_tokens_are_read(monkeypatch):
    with engine() as e:
        log = order_of_calls(e, monkeypatch)
        out = e.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    # the prefill's tokens are read after the first decode is launched, and so on: launch, read, launch, read ...
    assert log[:4] == ["launch", "read", "launch", "read"] and log.count("launch") == 5 and log[-1] == "read"


def test_penalties_overlap_and_fill_each_sequence_once(monkeypatch):
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=6, presence_penalty=1.0, repetition_penalty=1.2, n=2)
    with engine(overlap_scheduling=False) as e:
        want = e.generate(PROMPTS[0], params)
    with engine() as e:
        log = order_of_calls(e, monkeypatch)
        got = e.generate(PROMPTS[0], params)
        # counted on the device from each step's ids: the host's copy of the last token is not waited for, and each
        # sequence's history is uploaded once, when it is first sampled; finished, they give their slots back
        assert e.runner.penalties.fills == 2 and e.runner.penalties.num_held == 0
        e.core.add_request("r", e.encode(PROMPTS[1]), params)
        e.core.step()
        assert e.runner.penalties.num_held == 2
        e.core.abort("r")  # aborted too
        assert e.runner.penalties.num_held == 0
        e.core.add_request("s", e.encode(PROMPTS[1]), params)
        e.core.step()
        # a new engine on the runner numbers its sequences from 0: it starts from an empty table
        assert EngineCore(e.runner, e.core.scheduler.cfg).runner.penalties.num_held == 0
    assert log[:4] == ["launch", "read", "launch", "read"] and log.count("launch") == 5 and log[-1] == "read"
    assert outputs(got) == outputs(want)


PENALIZED = [SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.5, frequency_penalty=0.6),
             SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=11, presence_penalty=0.8, min_tokens=3),
             SamplingParams(temperature=0.0, max_tokens=9),
             SamplingParams(temperature=0.7, top_k=30, seed=8, max_tokens=16, repetition_penalty=0.7,
                            presence_penalty=-0.5)]


@pytest.mark.parametrize("kw", [{}, {"num_kv_blocks": 17, "max_num_seqs": 3}, {"max_num_batched_tokens": 32}],
                         ids=["plain", "preemption", "chunked"])
def test_the_count_table_equals_counting_the_hosts_ids_each_step(kw):
    """The reference counts every penalized row from the host's ids at each step (no table, overlap off); the
    engine keeps the counts on the device and overlaps. A preempted sequence keeps its slot, with every token it
    had, through its recompute: each sequence is filled once. (Losing a slot and being filled again is
    test_penalties.py's: here a preempted sequence returns before any newcomer is admitted.)"""
    with engine(overlap_scheduling=False, **kw) as e:
        e.core.sampler.penalties = None
        want = e.generate(PROMPTS, PENALIZED)
    with engine(**kw) as e:
        got = e.generate(PROMPTS, PENALIZED)
        fills, preempted = e.runner.penalties.fills, e.core.scheduler.num_preemptions
    assert outputs(got) == outputs(want)
    assert fills == 1 + 2 + 1  # the penalized sequences
    assert preempted > 0 or not kw.get("num_kv_blocks")


def test_the_pending_token_reaches_the_next_step_on_the_device():
    with engine() as e:
        core, runner = e.core, e.runner
        core.add_request("r", e.encode(PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=8))
        core.step()  # the prefill: its token is pending
        seq = core.requests["r"].seqs[0]
        assert seq.output_ids == [PENDING_TOKEN] and seq.num_pending == 1
        pending_id = int(runner.sampled_ids[0])
        (update,) = core.step()  # the first decode is launched, then the prefill's token read
        assert update.token_id == pending_id and seq.output_ids == [pending_id, PENDING_TOKEN]
        assert int(runner.decode_in.device("input_ids")[0]) == pending_id  # the decode ran on it
        core.abort("r")
        assert seq.output_ids == [pending_id] and seq.num_pending == 0
        assert core.step() == [] and not core.has_work  # the aborted row's token is dropped
        assert runner.allocator.num_free == runner.allocator.num_blocks


def test_a_stop_drops_the_token_sampled_after_it():
    with engine() as e:
        core = e.core
        core.add_request("r", e.encode(PROMPTS[2]), SamplingParams(temperature=0.0, max_tokens=12, stop=["aaa"]))
        seq = core.requests["r"].seqs[0]
        launched_after_the_stop = False
        while core.has_work:
            updates = core.step()
            if any(u.finish_reason for u in updates):
                # the third "a" was read while the step after it ran: that step's token is not the sequence's
                flight = core._in_flight
                launched_after_the_stop = flight is not None and [s for s, _ in flight.rows] == [seq]
        assert (seq.output_ids, seq.num_pending, seq.finish_reason) == ([97] * 3, 0, "stop")
        assert launched_after_the_stop and e.runner.allocator.num_free == e.runner.allocator.num_blocks


def test_a_sequences_pending_tokens_are_resolved_in_place_or_dropped():
    seq = Sequence(0, [1, 2], 8, output_ids=[5])
    first, second = seq.add_pending(), seq.add_pending()
    assert (first, second, len(seq), seq.last_token, seq.num_pending) == (1, 2, 5, PENDING_TOKEN, 2)
    seq.resolve_pending(first, 7)
    with pytest.raises(ValueError, match="output 1 is not pending"):
        seq.resolve_pending(first, 8)
    seq.drop_pending()
    assert (seq.output_ids, seq.num_pending) == ([5, 7], 0)
    seq.add_pending()
    seq.drop_pending(keep=1)  # ended at its first output: the rest, resolved or not, goes
    assert (seq.output_ids, seq.num_pending) == ([5], 0)


def test_the_runner_refuses_a_pending_token_without_its_source():
    with engine() as e:
        runner = e.runner
        seq = Sequence(0, [1, 2, 3], 8, output_ids=[PENDING_TOKEN], num_pending=1)
        runner.reserve(seq, 4)
        seq.num_cached = 3
        with pytest.raises(ConfigError, match="1 pending tokens but token source -1"):
            runner.decode([seq])
        with pytest.raises(ConfigError, match="cannot prefill: 1 of its tokens are still being sampled"):
            runner.prefill([seq], [1])
        runner.free(seq)


def test_decode_from_a_device_token_equals_decode_from_the_host():
    with engine() as e:
        runner = e.runner
        a = Sequence(0, [5, 6, 7, 8, 9], 8)
        b = Sequence(1, [5, 6, 7, 8], 8)
        for seq in (a, b):
            runner.prefill([seq], [4])
        b.add_pending()  # its fifth token, 9, is on the device only
        runner.sampled_ids[3] = 9
        host = runner.decode([a]).clone()
        device = runner.decode([b], [3])
        torch.testing.assert_close(device, host, rtol=0, atol=0)
        for seq in (a, b):
            runner.free(seq)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")
@pytest.mark.parametrize("n", [1, 5, 33])
def test_the_resolve_kernel_equals_the_torch_sequence(n):
    g = torch.Generator().manual_seed(n)
    sampled = torch.randint(0, 1000, (40,), generator=g)
    source = torch.randint(-1, 40, (n,), generator=g)
    source[0] = -1
    ids = torch.randint(1000, 2000, (n,), generator=g)
    want, got = ids.clone(), ids.clone()
    resolve_input_ids_reference(want, source, sampled)
    resolve_input_ids(got, source, sampled, use_triton=True)
    assert torch.equal(got, want) and got[0] == ids[0]
    assert torch.equal(got[source >= 0], sampled[source[source >= 0]])
    with pytest.raises(ValueError, match="must be the same 1-D shape"):
        resolve_input_ids(ids, source[:0], sampled)


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_greedy_steps_take_the_ids_the_step_made_and_give_the_same_outputs(monkeypatch, overlap):
    """A plain-greedy decode step makes its ids in the step (ModelRunner.decode_greedy, into sampled_ids): no logits
    reach the sampler. The outputs equal the engine's with the ids taken from the logits after the step
    (TPGRAPH_GREEDY_IN_STEP=0), beside steps that sample (mixed batches), where the sampler overwrites those rows."""
    params = [SamplingParams(temperature=0.0, max_tokens=12), MIXED[1], SamplingParams(temperature=0.0, max_tokens=7)]
    runs = {}
    for in_step in ("1", "0"):
        monkeypatch.setenv("TPGRAPH_GREEDY_IN_STEP", in_step)
        with engine(overlap_scheduling=overlap) as e:
            assert e.runner.greedy_in_step == (in_step == "1")
            assert (e.runner.logits is None) == (in_step == "1")  # TP=1: the step's shard is the whole row
            calls: list[str] = []
            for name in ("decode", "decode_greedy"):
                record(e.runner, name, calls, name, monkeypatch)
            greedy_only = e.generate(PROMPTS[:3], params[0])
            mixed = e.generate(PROMPTS[:3], params)
        runs[in_step] = (outputs(greedy_only), outputs(mixed))
        assert "decode_greedy" in calls and "decode" in calls  # the mixed batch's steps take the logits
    assert runs["1"] == runs["0"]
