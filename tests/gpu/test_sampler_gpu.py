"""Sampling on CUDA queues its work without waiting for the GPU: the overlapped loop schedules the next step while
the last one's forward and sampling run, and one synchronous copy (a tensor made from a list on the device) would
make the host wait for both."""

import pytest
import torch

from tpgraph.engine.penalties import PenaltyTable
from tpgraph.engine.sampler import Sampler, SampleRow
from tpgraph.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

EVERY_OPTION = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                              frequency_penalty=0.3, presence_penalty=0.2, logprobs=2, seed=4)


def test_sampling_every_option_never_waits_for_the_gpu():
    vocab = 32000
    table = PenaltyTable(4, vocab, "cuda")
    sampler = Sampler("cuda", penalties=table)
    rows = [SampleRow(EVERY_OPTION, [1, 2, 3], [], sample_index=i, seq_id=i) for i in range(3)]
    rows.append(SampleRow(SamplingParams(temperature=0.0), [5], [], banned_ids=(7,), seq_id=3))
    logits = torch.randn(4, vocab, device="cuda")
    sampler.sample(logits, rows)  # first use: rows filled from the host, allocator and kernels warm
    torch.cuda.synchronize()
    # the next step on the slots held (its last tokens pending), and a newcomer's slot filled from its ids
    later = [SampleRow(r.params, r.prompt_ids, [-1], r.sample_index, r.banned_ids, r.seq_id) for r in rows]
    newcomer = [*later[1:], SampleRow(EVERY_OPTION, [4, 5, 6], [7, 7, 8], seq_id=10)]
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the sampling
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises, naming itself
    try:
        pending = [sampler.sample_async(logits, later), sampler.sample_async(logits, newcomer)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    still_busy = not torch.cuda.current_stream().query()
    out = [p.result() for p in pending]
    assert still_busy, "sample_async waited for the GPU"
    assert [len(o.token_ids) for o in out] == [4, 4] and table.fills == 4  # held slots took no host ids
    # the penalized rows' ids of three steps, counted on the device, and the newcomer's three output ids
    assert int(table.counts.sum()) == 3 + 3 + 3 + 3
