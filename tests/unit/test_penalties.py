"""Penalties from the device-side count table: equal to a per-token reference over the host's ids, step after step,
as sequences come and go, lose their rows and get them back."""

import os
import random
from collections import Counter

import pytest
import torch

from tpgraph.engine.penalties import PenaltyTable
from tpgraph.engine.sampler import Sampler, SampleRow, penalize
from tpgraph.engine.sampling_params import SamplingParams


def reference_penalties(x, row):
    x = x.clone()
    p = row.params
    for t in set(row.prompt_ids) | set(row.output_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(row.output_ids).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def test_penalties_match_a_per_token_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 30, generator=g)
    batch = [SampleRow(SamplingParams(repetition_penalty=1.3), [1, 2, 2, 5], [7, 7, 8]),
             SampleRow(SamplingParams(frequency_penalty=0.5, presence_penalty=-0.25), [3], [4, 4, 4, 9]),
             SampleRow(SamplingParams(), [1], [])]
    got = penalize(x, batch, None)[0]
    for i, row in enumerate(batch):
        torch.testing.assert_close(got[i], reference_penalties(x[i], row))


def test_penalties_refuse_a_pending_token_and_other_rows_ignore_theirs():
    logits = torch.zeros(2, 4)
    assert penalize(logits, [SampleRow(SamplingParams(), [1], [2, -1])], None)[0] is logits  # none penalized
    plain = SampleRow(SamplingParams(temperature=0.0), [1], [2, -1])  # its last token pending (overlap): unused
    penalized = SampleRow(SamplingParams(temperature=0.0, presence_penalty=1.0), [1], [2, 3])
    out = penalize(logits, [plain, penalized], None)[0]
    assert torch.equal(out[0], logits[0]) and out[1].tolist() == [0.0, 0.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="one is still pending"):
        penalize(logits, [SampleRow(penalized.params, [1], [2, -1])], None)[0]


PARAMS = [SamplingParams(repetition_penalty=1.4), SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
          SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4), SamplingParams(temperature=0.0)]


fused_on_cpu = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=fused_on_cpu)], ids=["torch", "triton"])
def test_counts_kept_between_steps_match_the_reference_as_sequences_come_and_go(fused):
    """Seven sequences, three slots: each step samples up to three of them, in any order, the table counting the
    step's ids on its side while the host appends them to its own lists. Sequences that sit out lose their slots to
    newcomers and are filled again on return; every step's penalized logits equal the reference's on the host's
    ids, and plain rows stay as they were. With the torch ops, and with kernels/penalties.py's launches."""
    if fused:
        pytest.importorskip("triton")
    vocab, table = 40, PenaltyTable(3, 40, "cpu", fused=fused)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    prompts = {s: [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for s in range(7)}
    outputs: dict[int, list[int]] = {s: [] for s in prompts}
    for _ in range(40):
        seqs = rng.sample(sorted(prompts), rng.randrange(1, 4))
        if all(s % 4 == 3 for s in seqs):  # none penalized: the sampler would not call penalize
            continue
        rows = [SampleRow(PARAMS[s % 4], prompts[s], list(outputs[s]), seq_id=s) for s in seqs]
        x = torch.randn(len(rows), vocab, generator=gen)
        got, counted = penalize(x, rows, table)
        for i, row in enumerate(rows):
            torch.testing.assert_close(got[i], reference_penalties(x[i], row) if row.params.has_penalties else x[i])
        ids = torch.randint(vocab, (len(rows),), generator=gen)
        table.count(counted.slots, ids if counted.positions is None else ids[counted.positions])
        for s, t in zip(seqs, ids.tolist(), strict=True):
            outputs[s].append(t)
    assert table.fills > 7  # slots were lost and filled again, and the counts still held


def test_a_step_never_takes_a_slot_from_its_own_sequences_and_a_finished_one_gives_its_slot_back():
    table = PenaltyTable(2, 10, "cpu")
    p = PARAMS[0]
    first = table.slots_for([SampleRow(p, [1], [], seq_id=0), SampleRow(p, [2], [], seq_id=1)])
    # sequence 0 was used least recently, but is in this step: sequence 1's slot goes to the newcomer
    again = table.slots_for([SampleRow(p, [3], [], seq_id=2), SampleRow(p, [1], [], seq_id=0)])
    assert again == [first[1], first[0]] and table.fills == 3
    table.release(2)  # finished: its slot is free, so sequence 3 takes it and sequence 0 keeps its own
    assert table.slots_for([SampleRow(p, [4], [], seq_id=3)]) == [first[1]]
    assert table.slots_for([SampleRow(p, [1], [], seq_id=0)]) == [first[0]] and table.fills == 4
    with pytest.raises(ValueError, match="the penalty table holds 2"):
        table.slots_for([SampleRow(p, [1], [], seq_id=s) for s in range(3)])
    with pytest.raises(ValueError, match="appears twice"):
        table.slots_for([SampleRow(p, [1], [], seq_id=0), SampleRow(p, [1], [], seq_id=0)])
    # a new sequence whose history still has a pending token is refused before any slot changes hands
    with pytest.raises(ValueError, match="still pending"):
        table.slots_for([SampleRow(p, [1], [2, -1], seq_id=9)])
    assert 9 not in table._slots and table.slots_for([SampleRow(p, [4], [], seq_id=3)]) == [first[1]]
    # a fill that fails (an id past the vocabulary) leaves no sequence holding a slot it was not filled into
    table.release(0)
    with pytest.raises(IndexError):
        table.slots_for([SampleRow(p, [1], [10], seq_id=5)])
    assert table.num_held == 1 and table.slots_for([SampleRow(p, [1], [], seq_id=6)]) == [first[0]]


def test_rows_without_an_id_are_filled_for_their_call_only():
    table = PenaltyTable(3, 10, "cpu")
    p = SamplingParams(presence_penalty=1.0)
    rows = [SampleRow(p, [1], [2]), SampleRow(p, [1], [3])]
    taken = table.slots_for(rows)
    assert len(set(taken)) == 2  # two in one call never share a row
    x = torch.zeros(2, 10)
    got = penalize(x, rows, table)[0]
    assert got[0, 2] == -1.0 and got[0, 3] == 0.0 and got[1, 3] == -1.0 and got[1, 2] == 0.0
    assert table.fills == 4  # filled again on every call


def test_the_sampler_counts_its_ids_into_its_table():
    table = PenaltyTable(2, 6, "cpu")
    sampler = Sampler("cpu", penalties=table)
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    plain = SampleRow(SamplingParams(temperature=0.0), [0], [], seq_id=9)
    first = sampler.sample(logits, [SampleRow(p, [0], [], seq_id=4), plain]).token_ids
    # the host never tells the table what was sampled: the second step's row holds the first's id already
    second = sampler.sample(logits[:1], [SampleRow(p, [0], [-1], seq_id=4)]).token_ids
    assert first == [1, 3] and second == [2]
    assert table.counts.sum().item() == 2 and table.fills == 1
    with pytest.raises(ValueError, match="logits of 5 tokens"):
        sampler.sample(logits[:1, :5], [SampleRow(p, [0], [1, 2], seq_id=4)])
    table.clear()  # (an engine clears its table when it starts: its sequence ids start from 0)
    assert sampler.sample(logits[:1], [SampleRow(p, [0], [1, 2], seq_id=4)]).token_ids == [1]


@fused_on_cpu
def test_the_fused_count_adds_repeats_and_skips_ids_outside_the_vocabulary():
    """kernels/penalties.count_rows: a slot's repeated id counted each time (atomic adds), and an id outside the
    vocabulary left out where index_put_ would stop the device."""
    pytest.importorskip("triton")
    table = PenaltyTable(2, 50, "cpu", fused=True)
    table.count(torch.tensor([1, 1, 0, 1, 0]), torch.tensor([7, 7, 3, 49, 50]))
    assert table.counts[1].nonzero().flatten().tolist() == [7, 49] and table.counts[1, 7] == 2
    assert table.counts[0].nonzero().flatten().tolist() == [3] and int(table.counts.sum()) == 4
