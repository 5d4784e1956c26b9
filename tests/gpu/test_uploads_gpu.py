"""Host values queued to the GPU from pinned memory: lists and numpy arrays (varlen prefill's slots are an array)."""

import numpy as np
import pytest
import torch

from tpgraph.uploads import to_device, to_device_parts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("values", [[3, 1, 4, 1, 5], np.array([3, 1, 4, 1, 5], dtype=np.int32),
                                    np.array([3, 1, 4, 1, 5], dtype=np.int64)],
                         ids=["list", "int32 array", "int64 array"])
def test_to_device_queues_lists_and_arrays_behind_gpu_work(values):
    torch.cuda._sleep(100_000_000)  # GPU work ahead of the copy, as in the overlapped loop
    out = to_device(values, torch.int64, CUDA)
    assert out.dtype == torch.int64 and out.device.type == "cuda"
    assert out.tolist() == [3, 1, 4, 1, 5]


def test_an_array_changed_after_the_upload_does_not_change_what_arrives():
    values = np.arange(6, dtype=np.int64)
    torch.cuda._sleep(200_000_000)
    out = to_device(values, torch.int64, CUDA)
    values[:] = -1  # the copy is still queued: it must read a pinned copy, not this array
    assert out.tolist() == list(range(6))


def test_to_device_parts_splits_one_upload():
    a, b = to_device_parts([np.cumsum((0, 2, 3)).tolist(), [7, 8]], torch.int32, CUDA)
    assert a.tolist() == [0, 2, 5] and b.tolist() == [7, 8] and a.dtype == torch.int32
