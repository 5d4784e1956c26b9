"""Gates for the custom all-reduce: environment, allocator mode, NVLink topology. Each returns a reason string
when the custom path must not be used (None when it may), so the log can say why."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

from tpgraph.comm.multicast import disable_switch_set

# CUDA errors (as the extension names them: "CUDA error <name> (...) in `<call>`") that say this machine cannot share
# device memory between the ranks' processes, or has no room for the workspace: P2P unsupported or not enabled
# between the GPUs, CUDA IPC refused (containers without a shared IPC namespace, exclusive-process compute mode, MIG,
# too many peers), a GPU tpgraph._C holds no kernels for (built for other architectures: TPGRAPH_CUDA_ARCHS), or a
# driver older than the CUDA toolkit tpgraph._C was built with (its static runtime, or its PTX, needs a newer one;
# PyTorch's own CUDA, and so NCCL, may well run on it). They are reasons to use NCCL. Any other error in the set-up
# (a kernel fault, an argument refused) is a bug, not a property of the machine, and is raised.
UNAVAILABLE_CUDA_ERRORS = frozenset({
    "cudaErrorPeerAccessUnsupported",
    "cudaErrorPeerAccessNotEnabled",
    "cudaErrorTooManyPeers",
    "cudaErrorMapBufferObjectFailed",
    "cudaErrorInvalidResourceHandle",
    "cudaErrorDevicesUnavailable",
    "cudaErrorOperatingSystem",
    "cudaErrorNotSupported",
    "cudaErrorMemoryAllocation",
    "cudaErrorNoKernelImageForDevice",
    "cudaErrorInsufficientDriver",
    "cudaErrorCallRequiresNewerDriver",
    "cudaErrorUnsupportedPtxVersion",
})
_CUDA_ERROR_NAME = re.compile(r"\bCUDA error (cudaError\w+)")


def unavailable_cuda_error(exc: BaseException) -> str | None:
    """The CUDA error's name where `exc` is one of UNAVAILABLE_CUDA_ERRORS raised by the extension (a RuntimeError),
    else None."""
    if type(exc) is not RuntimeError:  # (the extension raises plain RuntimeErrors; tpgraph's own errors are others)
        return None
    m = _CUDA_ERROR_NAME.search(str(exc))
    return m.group(1) if m and m.group(1) in UNAVAILABLE_CUDA_ERRORS else None


def host_identity() -> str:
    """What tells this machine from another: its kernel's boot id (shared by every container on one host, where CUDA
    IPC can work between them), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"boot {boot}" if boot else f"host {socket.gethostname()}"


def hosts_reason(hosts: list[str]) -> str | None:
    """Why ranks on these hosts (host_identity, rank order) cannot share a custom all-reduce, or None: CUDA IPC maps
    memory within one machine, so a group that spans machines uses NCCL (as vLLM's custom all-reduce does)."""
    distinct = list(dict.fromkeys(hosts))
    if len(distinct) < 2:
        return None
    first_away = next(r for r, h in enumerate(hosts) if h != hosts[0])
    return (f"the ranks run on {len(distinct)} machines (rank 0 and rank {first_away} do not share one), and CUDA IPC "
            "shares GPU memory within one machine")


def p2p_env_reason(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    # (read as the multicast gate reads its disable switches: NCCL_P2P_DISABLE=false keeps NCCL's own P2P on)
    if disable_switch_set(env.get("NCCL_P2P_DISABLE", "")):
        return f"NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']} forbids peer-to-peer traffic"
    return None


def unexportable_allocator(env: Mapping[str, str] | None = None, backend: str | None = None) -> str | None:
    """Why PyTorch's allocator hands out memory that cudaIpcGetMemHandle cannot export, or None: VMM-backed
    (expandable_segments) or stream-ordered (the cudaMallocAsync backend, whose pools are not made for IPC).
    `backend`: the live allocator's (torch.cuda.get_allocator_backend()), which a program may have chosen in code."""
    if backend == "cudaMallocAsync":
        return "PyTorch's CUDA allocator backend is cudaMallocAsync"
    env = os.environ if env is None else env
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "expandable_segments" and value.lower() in ("true", "1"):
                return f"{var} sets expandable_segments"
            if key == "backend" and value == "cudaMallocAsync":
                return f"{var} sets backend:cudaMallocAsync"
    return None


def physical_device_ids(visible: str | None, count: int) -> list[str]:
    """NVML identifiers (index or UUID) of CUDA devices 0..count-1 under CUDA_VISIBLE_DEVICES."""
    if not visible:
        return [str(i) for i in range(count)]
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if len(ids) < count:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names {len(ids)} devices, {count} are in use")
    return ids[:count]


def nvlink_reason(local_devices: list[int]) -> str | None:
    """None if every pair of the given CUDA devices is linked by NVLink (checked through NVML by physical id);
    otherwise why not, or why it could not be checked."""
    try:
        import pynvml
    except ImportError:
        return ("NVML (nvidia-ml-py) is not installed, so NVLink connectivity cannot be checked "
                "(pip install nvidia-ml-py, or tpgraph[gpu])")
    ids = physical_device_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), max(local_devices) + 1)
    try:
        pynvml.nvmlInit()
        try:
            handles = []
            for d in local_devices:
                ident = ids[d]
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(ident) if ident.startswith(("GPU-", "MIG-"))
                               else pynvml.nvmlDeviceGetHandleByIndex(int(ident)))
            for i, a in enumerate(handles):
                for j, b in enumerate(handles):
                    if i < j:
                        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                        if status != pynvml.NVML_P2P_STATUS_OK:
                            return f"GPUs {ids[local_devices[i]]} and {ids[local_devices[j]]} are not linked by NVLink"
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        return f"NVML query failed: {exc}"
    return None
