"""The compiled extension on real GPUs: its code runs on this arch, and CUDA IPC works across ranks."""

import pytest
import torch
from tpgtest.markers import needs_gpus
from tpgtest.spawn import run_ranks
from tpgtest.workers import ipc_roundtrip

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


@needs_gpus(2)
def test_ipc_handles_across_ranks():
    results = run_ranks(ipc_roundtrip, 2)
    assert results == [(True, 0), (True, 0)]
