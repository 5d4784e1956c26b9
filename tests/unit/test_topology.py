import logging
import os

import pytest
import torch

from tpgraph.comm import TPCommunicator
from tpgraph.comm.topology import p2p_env_reason, physical_device_ids, unexportable_allocator
from tpgraph.distributed import ParallelState


def test_nccl_p2p_disable_gates_the_custom_path():
    assert p2p_env_reason({}) is None
    assert p2p_env_reason({"NCCL_P2P_DISABLE": "0"}) is None
    assert "NCCL_P2P_DISABLE=1" in p2p_env_reason({"NCCL_P2P_DISABLE": "1"})


@pytest.mark.parametrize(("conf", "reason"), [
    ({}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_CUDA_ALLOC_CONF sets expandable_segments"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, "sets expandable_segments"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_ALLOC_CONF sets expandable_segments"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "sets backend:cudaMallocAsync"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}, None),
])
def test_allocators_whose_memory_cuda_ipc_cannot_export_are_named(conf, reason):
    got = unexportable_allocator(conf)
    assert got is None if reason is None else reason in got


def test_the_live_allocator_backend_counts_beside_the_environment():
    """A program can choose cudaMallocAsync in code, with no variable set: the live backend is read too."""
    assert "backend is cudaMallocAsync" in unexportable_allocator({}, backend="cudaMallocAsync")
    assert unexportable_allocator({}, backend="native") is None


def test_physical_ids_follow_cuda_visible_devices():
    assert physical_device_ids(None, 2) == ["0", "1"]
    assert physical_device_ids("3,1", 2) == ["3", "1"]
    assert physical_device_ids("GPU-aaa,GPU-bbb", 1) == ["GPU-aaa"]
    with pytest.raises(ValueError, match="names 1 devices, 2 are in use"):
        physical_device_ids("2", 2)


def test_communicator_says_why_it_uses_nccl_on_cpu():
    state = ParallelState(0, 2, 0, torch.device("cpu"), None, None)
    assert TPCommunicator(state).custom_reason == "not on CUDA"
    assert TPCommunicator(state, use_custom_allreduce=False).custom_reason == "disabled by the caller"


def test_a_communicator_built_without_the_custom_all_reduce_never_sets_it_up_and_says_so_once(monkeypatch, caplog):
    """--disable-custom-all-reduce: no set-up (a fake one fails if reached), no push channel, every all-reduce
    through torch.distributed; rank 0 alone logs it, naming the flag."""
    from tpgraph.comm import communicator

    monkeypatch.setattr(communicator, "_try_custom_allreduce",
                        lambda *a: pytest.fail("the custom all-reduce was set up"))
    lines = []
    for rank in (0, 1):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tpgraph.comm.communicator"):
            comm = TPCommunicator(ParallelState(rank, 2, rank, torch.device("cpu"), None, None),
                                  use_custom_allreduce=False, disabled_by="--disable-custom-all-reduce")
        lines.append([r.getMessage() for r in caplog.records])
        assert comm.custom is None and comm.push_channel(torch.zeros(1, 8, dtype=torch.bfloat16)) is None
        assert comm.custom_reason == "disabled by --disable-custom-all-reduce"
    assert lines == [["custom all-reduce disabled (--disable-custom-all-reduce): NCCL"], []]


def test_shared_gpu_switch_is_0_or_1_and_gives_each_rank_its_own_nccl_host(monkeypatch):
    from tpgraph.distributed import SHARED_GPU_ENV, nccl_as_separate_hosts, shared_gpu
    from tpgraph.errors import ConfigError

    monkeypatch.delenv(SHARED_GPU_ENV, raising=False)
    assert shared_gpu() is False
    monkeypatch.setenv(SHARED_GPU_ENV, "0")
    assert shared_gpu() is False
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    assert shared_gpu() is True
    monkeypatch.setenv(SHARED_GPU_ENV, "yes")
    with pytest.raises(ConfigError, match="TPGRAPH_SHARED_GPU must be 0 or 1, got 'yes'"):
        shared_gpu()
    # NCCL refuses two ranks on one device of one host: distinct host ids, over sockets on loopback
    hosts = [nccl_as_separate_hosts(r) for r in range(4)]
    assert len({h["NCCL_HOSTID"] for h in hosts}) == 4
    assert all(h["NCCL_NET"] == "Socket" and h["NCCL_SOCKET_IFNAME"] == "lo" for h in hosts)


def test_shared_gpu_puts_every_rank_on_device_0_and_keeps_the_users_nccl_settings(monkeypatch):
    """init_distributed's shared branch, with CUDA and the process group stood in for (no GPU here)."""
    import tpgraph.distributed as td
    from tpgraph.errors import ConfigError

    seen = {}
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what init_distributed sets goes with the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    monkeypatch.setattr(td.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(td.dist, "init_process_group", lambda **kw: seen.update(
        nccl={k: os.environ.get(k) for k in ("NCCL_HOSTID", "NCCL_NET", "NCCL_SOCKET_IFNAME")}, **kw))
    monkeypatch.setattr(td.dist, "new_group", lambda **kw: "cpu group")
    # (the ranks' start check before the group forms, and a failed start's report to the others: no peers here)
    monkeypatch.setattr(td, "agree_to_start", lambda *args: td.dist.HashStore())
    monkeypatch.setattr(td, "report_start_failure", lambda error, *args: seen.setdefault("reported", []).append(error))
    for name in ("NCCL_HOSTID", "NCCL_NET", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update({"NCCL_SOCKET_IFNAME": "eth7", td.SHARED_GPU_ENV: "1"})  # the user's own NCCL setting stays
    state = td.init_distributed("cuda", rank=1, world_size=2, init_method="file:///nowhere")
    assert state.device == torch.device("cuda", 0) and seen["device"] == 0 and state.local_rank == 1
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 0)
    assert seen["nccl"] == {"NCCL_HOSTID": "tpgraph-shared-gpu-rank1", "NCCL_NET": "Socket",
                            "NCCL_SOCKET_IFNAME": "eth7"}
    assert "reported" not in seen
    # a rank started by another rank's process (TPEngine's followers) inherits that rank's host id, which tpgraph set
    # at its own start: it takes its own (else a second start's NCCL finds both ranks on one host's GPU 0)
    os.environ["NCCL_HOSTID"] = "tpgraph-shared-gpu-rank0"
    td.init_distributed("cuda", rank=1, world_size=2, init_method="file:///nowhere")
    assert seen["nccl"]["NCCL_HOSTID"] == "tpgraph-shared-gpu-rank1"
    os.environ["NCCL_HOSTID"] = "users-own"  # (the user's own stays)
    td.init_distributed("cuda", rank=1, world_size=2, init_method="file:///nowhere")
    assert seen["nccl"]["NCCL_HOSTID"] == "users-own"
    # without the switch, rank 1 needs a second GPU
    os.environ[td.SHARED_GPU_ENV] = "0"
    with pytest.raises(ConfigError, match="local rank 1 has no GPU: only 1 visible.*TPGRAPH_SHARED_GPU=1"):
        td.init_distributed("cuda", rank=1, world_size=2, init_method="file:///nowhere")
    # one host only: ranks spread over hosts cannot share one GPU
    os.environ.update({td.SHARED_GPU_ENV: "1", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="one GPU of one host, but 4 ranks run 2 to a host"):
        td.init_distributed("cuda", rank=1, world_size=4, init_method="file:///nowhere")
    assert [type(e).__name__ for e in seen["reported"]] == ["ConfigError", "ConfigError"]  # (told to the others)


def test_only_cuda_errors_of_the_machine_count_as_the_custom_all_reduce_being_unavailable():
    from tpgraph.comm.topology import unavailable_cuda_error
    from tpgraph.errors import CommError

    assert unavailable_cuda_error(RuntimeError(
        "CUDA error cudaErrorMapBufferObjectFailed (mapping of buffer object failed) in `cudaIpcOpenMemHandle(...)`"
    )) == "cudaErrorMapBufferObjectFailed"
    assert unavailable_cuda_error(RuntimeError("CUDA error cudaErrorMemoryAllocation (out of memory) in `cudaMalloc`"))
    for error in (RuntimeError("CUDA error cudaErrorIllegalAddress (an illegal memory access was encountered)"),
                  RuntimeError("peer access unsupported"),  # (no CUDA error named)
                  ValueError("CUDA error cudaErrorPeerAccessUnsupported"),  # (not how the extension raises one)
                  CommError("CUDA error cudaErrorPeerAccessUnsupported")):  # (tpgraph's own: AllReduceUnavailable)
        assert unavailable_cuda_error(error) is None


def test_the_start_check_returns_the_groups_store_on_ok_and_nothing_once_a_failure_is_posted(tmp_path):
    """agree_to_start: "ok" returns the store the process group meets in (under this start's prefix); a failed start
    (report_start_failure's) posts its error and returns nothing, no store for a group that will not form."""
    import torch.distributed as dist

    import tpgraph.distributed as td
    from tpgraph.errors import ConfigError

    failed = td.agree_to_start(ConfigError("no GPU"), 0, 1, f"file://{tmp_path}/failed", 5.0)
    assert failed is None
    store = td.agree_to_start(None, 0, 1, f"file://{tmp_path}/ok", 5.0)
    assert isinstance(store, dist.PrefixStore)


@pytest.mark.parametrize("value", ["false", "no", "off", "00", "0x0", " 0"])
def test_nccl_p2p_disable_set_to_a_clear_no_leaves_the_custom_path_on(value):
    """NCCL_P2P_DISABLE=false (or no, off, 00) keeps NCCL's own P2P on (NCCL disables it only where the value reads
    as 1), but anything but "0" turned the custom all-reduce off, logging that the variable forbids P2P. A disable
    switch is read as the multicast gate reads its own: any value but a clear no disables."""
    assert p2p_env_reason({"NCCL_P2P_DISABLE": value}) is None


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "2"])
def test_nccl_p2p_disable_set_to_anything_else_still_turns_the_custom_path_off(value):
    assert f"NCCL_P2P_DISABLE={value}" in p2p_env_reason({"NCCL_P2P_DISABLE": value})


def test_a_gpu_the_extension_has_no_kernels_for_falls_back_to_nccl():
    """tpgraph._C is built for sm_90a and sm_100a by default: on another GPU (an A100, an L40S, sm_103) the set-up's
    first kernel fails with cudaErrorNoKernelImageForDevice, which was raised as a bug on every rank, so that TP >= 2
    did not start there at all (the "other" table is for those GPUs). It is a property of the machine: NCCL instead."""
    from tpgraph.comm.communicator import _verdict
    from tpgraph.comm.topology import unavailable_cuda_error

    error = RuntimeError("CUDA error cudaErrorNoKernelImageForDevice (no kernel image is available for execution on "
                         "the device) in `cudaGetLastError()` at csrc/device.cu:84")
    assert unavailable_cuda_error(error) == "cudaErrorNoKernelImageForDevice"
    assert _verdict(error)[0] == "unavailable"


@pytest.mark.parametrize("name", ["cudaErrorInsufficientDriver", "cudaErrorCallRequiresNewerDriver",
                                  "cudaErrorUnsupportedPtxVersion"])
def test_an_extension_built_for_a_newer_driver_falls_back_to_nccl(name):
    """tpgraph._C links the CUDA runtime of the nvcc that built it: with a driver older than that toolkit (a CUDA 13
    nvcc in the image, a 12.x driver on the host, under a torch built for 12.x that runs there) its first CUDA call
    in the set-up fails with cudaErrorInsufficientDriver, which was raised as a bug on every rank, so TP >= 2 did not
    start at all where NCCL would have run. Like a GPU it has no kernels for, a property of the machine: NCCL."""
    from tpgraph.comm.communicator import _verdict
    from tpgraph.comm.topology import unavailable_cuda_error
    from tpgraph.tune.cli import set_up_refused

    error = RuntimeError(f"CUDA error {name} (CUDA driver version is insufficient for CUDA runtime version) in "
                         "`cudaGetDeviceProperties(&prop, device)` at csrc/device.cu:40")
    assert unavailable_cuda_error(error) == name
    assert _verdict(error)[0] == "unavailable" and set_up_refused(error)
