"""Persistent inputs on the GPU: a host write waits for the last asynchronous copy out of the pinned twin."""

import pytest
import torch

from tpgraph.graphs.buffers import Pad, PersistentBuffers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_a_host_write_waits_for_the_copy_still_queued_behind_gpu_work():
    bufs = PersistentBuffers(64, "cuda")
    bufs.add("x", torch.int64, Pad.KEEP)
    bufs.host_np("x")[:] = 1
    torch.cuda._sleep(200_000_000)  # the GPU spins (~0.1 s) ahead of the copy, which stays queued behind it
    bufs.commit(64, 64)
    bufs.host_np("x")[:] = 2  # without the wait, the copy would read these
    torch.cuda.synchronize()
    assert bufs.device("x").tolist() == [1] * 64
    bufs.commit(64, 64, non_blocking=False)
    assert bufs.device("x").tolist() == [2] * 64
