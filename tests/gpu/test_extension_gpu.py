"""The compiled extension on real GPUs: its code runs on this arch, and CUDA IPC works across ranks."""

import pytest
import torch

from tests.dist.spawn import run_ranks
from tpgraph._ext import load_ext

pytestmark = pytest.mark.gpu


def test_kernel_runs_on_this_gpu():
    ext = load_ext()
    major, minor = torch.cuda.get_device_capability()
    archs = ext.build_info().archs.split(",")
    assert f"{major}{minor}a" in archs or f"{major}{minor}" in archs, (archs, major, minor)
    buf = torch.zeros(1000, dtype=torch.int32, device="cuda")
    ext.fill_u32(buf.data_ptr(), 0x12345678, buf.numel(), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.all(buf == 0x12345678)


def test_device_properties_match_torch():
    ext = load_ext()
    props = ext.device_properties(0)
    tprops = torch.cuda.get_device_properties(0)
    assert props.sm_count == tprops.multi_processor_count
    assert (props.major, props.minor) == (tprops.major, tprops.minor)
    assert props.uuid.startswith("GPU-")


def _ipc_worker(rank, world_size, init):
    import torch.distributed as dist

    from tpgraph.distributed import destroy_distributed, gather_objects, init_distributed

    state = init_distributed("cuda", rank, world_size, init)
    ext = load_ext()
    try:
        mine = torch.arange(4096, dtype=torch.int32, device=state.device) + 1000 * rank
        torch.cuda.synchronize()
        handles = gather_objects(state, ext.ipc_get_handle(mine.data_ptr()))
        peer = (rank + 1) % world_size
        ptr = ext.ipc_open_handle(handles[peer])
        assert ext.ipc_open_handle(handles[peer]) == ptr  # cached: one mapping
        assert ext.ipc_open_count() == 1
        got = torch.empty_like(mine)
        stream = torch.cuda.current_stream().cuda_stream
        ext.memcpy_async(got.data_ptr(), ptr, got.numel() * 4, stream)
        ext.stream_synchronize(stream)
        ok = torch.equal(got.cpu(), torch.arange(4096, dtype=torch.int32) + 1000 * peer)
        ext.ipc_close_handle(handles[peer])
        ext.ipc_close_handle(handles[peer])
        dist.barrier(group=state.cpu_group)
        return ok, ext.ipc_open_count()
    finally:
        destroy_distributed(state)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ipc_handles_across_ranks():
    results = run_ranks(_ipc_worker, 2)
    assert results == [(True, 0), (True, 0)]
