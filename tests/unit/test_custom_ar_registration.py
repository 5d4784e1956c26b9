"""The capture-registration protocol of CustomAllReduce, on CPU, with a fake extension and a fake peer."""

import pytest
import torch

import tpgraph.comm.custom_ar as custom_ar
from tpgraph.comm.custom_ar import CustomAllReduce, CustomAllReduceConfig, agree_on_devices
from tpgraph.distributed import ParallelState
from tpgraph.errors import CommError

SEGMENT = 1 << 20


class FakeExt:
    """Allocations are 1 MiB segments; a handle names a segment; opening maps it at a fixed peer window."""

    def __init__(self):
        self.filled = None
        self.opened = []
        self.refs: dict[bytes, int] = {}  # open mappings and their reference counts, as ipc.cu keeps them
        self.next_row, self.free_rows, self.in_use, self.zeroed = 0, [], set(), []

    def allocation_range(self, ptr):
        return ptr - ptr % SEGMENT, SEGMENT

    def ipc_get_handle(self, base):
        return f"handle-{base:#x}".encode()

    def ipc_open_handle(self, handle):
        self.opened.append(handle)
        self.refs[handle] = self.refs.get(handle, 0) + 1
        return 0x7F00_0000_0000 + int(handle.decode().split("-")[1], 16) // SEGMENT * SEGMENT

    def ipc_close_handle(self, handle):
        self.refs[handle] -= 1
        if self.refs[handle] == 0:
            del self.refs[handle]

    def ar_fill_rows(self, ctx, rows, ptrs):
        self.filled = (list(rows), list(ptrs))

    def ar_reserve_row(self, ctx):
        row = self.free_rows.pop() if self.free_rows else self.next_row
        self.next_row = max(self.next_row, row + 1)
        self.in_use.add(row)
        return row

    def ar_release_rows(self, ctx, rows):
        assert all(r in self.in_use for r in rows), "released a row that is not in use"
        self.in_use.difference_update(rows)
        self.free_rows.extend(rows)
        self.zeroed.extend(rows)

    def ar_rows_in_use(self, ctx):
        return len(self.in_use)


def fake_communicator(rank, peer_exports, monkeypatch):
    ar = object.__new__(CustomAllReduce)
    ar.ext = FakeExt()
    ar.ctx = 1
    ar.state = ParallelState(rank, 2, rank, torch.device("cpu"), None, None)
    ar._pending = []
    ar._opened = []
    ar._registrations = []
    ar._capturing = False
    calls = iter(peer_exports)
    sent = []

    def gather(state, obj):  # what the other rank contributes to each exchange, in order
        sent.append(obj)
        peer = next(calls)
        return [obj, peer] if rank == 0 else [peer, obj]

    ar.sent = sent

    monkeypatch.setattr(custom_ar, "gather_objects", gather)
    monkeypatch.setattr(custom_ar.torch.cuda, "synchronize", lambda: None)
    return ar


def test_rows_hold_own_pointer_and_peer_base_plus_offset(monkeypatch):
    peer = [(b"handle-0x5400000", 0x40), (b"handle-0x5500000", 0x1230)]
    ar = fake_communicator(0, [2, peer, None], monkeypatch)
    ar._pending = [(7, 3 * SEGMENT + 0x100), (8, 3 * SEGMENT + 0x900)]  # two inputs in one of our segments
    ar.register_captured()
    rows, ptrs = ar.ext.filled
    assert rows == [7, 8]
    assert ptrs == [3 * SEGMENT + 0x100, 0x7F00_0000_0000 + 0x5400000 + 0x40,
                    3 * SEGMENT + 0x900, 0x7F00_0000_0000 + 0x5500000 + 0x1230]
    assert ar._pending == []


def test_rank1_puts_its_own_pointer_second(monkeypatch):
    ar = fake_communicator(1, [1, [(b"handle-0x100000", 16)], None], monkeypatch)
    ar._pending = [(0, 9 * SEGMENT + 32)]
    ar.register_captured()
    assert ar.ext.filled[1] == [0x7F00_0000_0000 + 0x100000 + 16, 9 * SEGMENT + 32]


def test_different_capture_counts_fail_loudly(monkeypatch):
    ar = fake_communicator(0, [3], monkeypatch)
    ar._pending = [(0, SEGMENT), (1, SEGMENT + 16)]
    with pytest.raises(CommError, match=r"different numbers of custom all-reduces: \[2, 3\]"):
        ar.register_captured()
    assert ar.ext.filled is None  # nothing half-registered


def test_opened_peer_mappings_belong_to_the_registration(monkeypatch):
    ar = fake_communicator(0, [1, [(b"handle-0x100000", 16)], None], monkeypatch)
    row = ar.ext.ar_reserve_row(1)
    with ar.capture() as registration:
        ar._pending.append((row, 9 * SEGMENT + 32))
    assert registration.rows == [row] and registration.handles == [b"handle-0x100000"]
    assert ar._registrations == [registration]
    ar.release_registration(registration)
    assert ar.ext.refs == {} and ar.ext.in_use == set() and ar.ext.zeroed == [row]
    assert ar._registrations == [] and registration.released
    ar.release_registration(registration)  # twice is harmless
    assert ar.ext.zeroed == [row]


def test_capture_drop_release_forty_times_leaves_nothing_open(monkeypatch):
    """The measured leak: 8 zero-copy calls per capture, dropped and re-captured 40 times. Rows come back and are
    reused, and every peer mapping the registrations opened is closed again."""
    cycles, calls = 40, 8
    exchanges = []
    for c in range(cycles):
        peer = [(f"handle-{(c * calls + i + 1) * SEGMENT:#x}".encode(), 0) for i in range(calls)]
        exchanges += [calls, peer, None]
    ar = fake_communicator(0, exchanges, monkeypatch)
    for c in range(cycles):
        with ar.capture() as registration:
            for i in range(calls):
                ar._pending.append((ar.ext.ar_reserve_row(1), (100 + c * calls + i) * SEGMENT))
        assert len(ar.ext.refs) == calls and ar.rows_in_use == calls
        ar.release_registration(registration)  # the graph was dropped
        assert ar.ext.refs == {} and ar.rows_in_use == 0
    assert ar.ext.next_row == calls  # 8 rows served all 320 captured calls


def capture_one_input(ar) -> None:
    """A capture whose one all-reduce input (a row, 9 segments in) is registered as the capture ends."""
    with ar.capture():
        ar._pending.append((ar.ext.ar_reserve_row(1), 9 * SEGMENT))


def refuse(monkeypatch, ar, call: str, cuda_error: str) -> None:
    """The fake extension's `call` fails as CUDA would, naming `cuda_error`."""
    def failing(*_):
        raise RuntimeError(f"CUDA error {cuda_error}")

    monkeypatch.setattr(ar.ext, call, failing)


def test_close_releases_live_registrations(monkeypatch):
    ar = fake_communicator(0, [1, [(b"handle-0x100000", 16)], None], monkeypatch)
    capture_one_input(ar)
    monkeypatch.setattr(ar.ext, "ar_destroy", lambda ctx: None, raising=False)
    ar._release()
    assert ar.ext.refs == {} and ar.ext.in_use == set() and ar._registrations == []


def test_a_failed_capture_returns_its_rows(monkeypatch):
    ar = fake_communicator(0, [0], monkeypatch)
    with pytest.raises(ValueError, match="boom"):
        with ar.capture():
            ar._pending.append((ar.ext.ar_reserve_row(1), SEGMENT))
            raise ValueError("boom")
    assert ar.ext.in_use == set() and ar._registrations == []


def test_a_rank_failing_inside_capture_tells_its_peers(monkeypatch):
    ar = fake_communicator(0, [0], monkeypatch)  # the peer's capture count, exchanged with our failure
    with pytest.raises(ValueError, match="boom"):
        with ar.capture():
            raise ValueError("boom")
    assert "rank 0 failed while capturing" in ar.sent[0] and "boom" in ar.sent[0]
    assert not ar._capturing and ar._pending == []


def test_the_peer_of_a_failed_capture_raises_instead_of_waiting(monkeypatch):
    ar = fake_communicator(1, ["rank 0 failed while capturing: ValueError('boom')"], monkeypatch)
    with pytest.raises(CommError, match="capture abandoned: rank 0 failed while capturing"):
        with ar.capture():
            pass
    assert ar.ext.filled is None


def test_a_rank_that_cannot_share_its_captured_inputs_tells_its_peers_in_the_exchange(monkeypatch):
    """Exporting a captured input failed on one rank alone (memory CUDA IPC cannot export): it raised before the
    handle exchange, and the peers, waiting in it, took that rank's next collective for its handles."""
    ar = fake_communicator(0, [1, [(b"handle-0x100000", 16)]], monkeypatch)

    refuse(monkeypatch, ar, "ipc_get_handle", "cudaErrorInvalidValue in `cudaIpcGetMemHandle`")
    with pytest.raises(CommError, match="cannot share a captured all-reduce input"):
        capture_one_input(ar)
    assert "rank 0 failed sharing its captured inputs" in ar.sent[1] and "cudaErrorInvalidValue" in ar.sent[1]
    assert ar.ext.in_use == set() and ar._registrations == []


def test_the_peer_of_a_rank_that_could_not_share_its_inputs_raises_naming_it(monkeypatch):
    ar = fake_communicator(1, [1, "rank 0 failed sharing its captured inputs: CommError: no"], monkeypatch)
    with pytest.raises(CommError, match="capture abandoned: rank 0 failed sharing its captured inputs"):
        capture_one_input(ar)
    assert ar.ext.filled is None and ar.ext.in_use == set() and ar.ext.refs == {}


def test_a_rank_that_cannot_map_a_peers_input_tells_its_peers_before_they_replay(monkeypatch):
    """Mapping a peer's captured input failed on one rank alone: it raised before the last exchange ("all rows
    everywhere before anyone replays"), which its peers then passed with its next collective, their rows filled and
    their graphs ready to replay against a rank that had none."""
    ar = fake_communicator(0, [1, [(b"handle-0x100000", 16)], None], monkeypatch)

    refuse(monkeypatch, ar, "ipc_open_handle", "cudaErrorTooManyPeers in `cudaIpcOpenMemHandle`")
    with pytest.raises(RuntimeError, match="cudaErrorTooManyPeers"):
        capture_one_input(ar)
    assert "rank 0 failed mapping the peers' captured inputs" in ar.sent[2]
    peer = fake_communicator(1, [1, [(b"handle-0x100000", 16)], ar.sent[2]], monkeypatch)
    with pytest.raises(CommError, match="capture abandoned: rank 0 failed mapping"):
        capture_one_input(peer)
    assert peer.ext.in_use == set() and peer.ext.refs == {}


def test_grids_follow_the_smallest_gpu_and_architectures_must_match():
    assert agree_on_devices([(132, (9, 0)), (114, (9, 0))]) == 114
    with pytest.raises(CommError, match=r"differ in architecture \['sm_90', 'sm_100'\]"):
        agree_on_devices([(132, (9, 0)), (148, (10, 0))])


def test_config_reads_the_environment_when_made(monkeypatch):
    monkeypatch.setenv("TPGRAPH_AR_TIMEOUT_S", "7")
    monkeypatch.setenv("TPGRAPH_AR_PDL", "0")
    cfg = CustomAllReduceConfig()
    assert cfg.timeout_s == 7.0 and cfg.pdl is False


def test_timeout_zero_waits_forever_and_negative_is_refused(monkeypatch):
    import pytest

    from tpgraph.errors import ConfigError

    monkeypatch.setenv("TPGRAPH_AR_TIMEOUT_S", "0")
    assert CustomAllReduceConfig().timeout_s == 0.0
    with pytest.raises(ConfigError, match="0: wait forever"):
        CustomAllReduceConfig(timeout_s=-1)
    # "inf" meaning forever (or nan, or a wait past what the kernels' 64-bit nanoseconds hold) passed here, then
    # failed as int(inf * 1e9) (OverflowError) while the workspace was being set up, or at every call
    for value in ("inf", "nan", "1e11"):
        monkeypatch.setenv("TPGRAPH_AR_TIMEOUT_S", value)
        with pytest.raises(ConfigError, match="0: wait forever"):
            CustomAllReduceConfig()
    assert CustomAllReduceConfig(timeout_s=1e9).timeout_s == 1e9


def test_a_timeout_variable_that_is_not_a_number_is_refused_by_name(monkeypatch):
    """TPGRAPH_AR_TIMEOUT_S=30s went through float() as the config's default: a ValueError traceback from the
    engine's start, which the launchers print in one line only for a TPGraphError."""
    import pytest

    from tpgraph.errors import ConfigError

    monkeypatch.setenv("TPGRAPH_AR_TIMEOUT_S", "30s")
    with pytest.raises(ConfigError, match="TPGRAPH_AR_TIMEOUT_S must be a number of seconds .* got '30s'"):
        CustomAllReduceConfig()


def test_a_timeout_variable_out_of_range_is_refused_by_name(monkeypatch):
    """TPGRAPH_AR_TIMEOUT_S=-1 (or inf, nan, 1e11) was refused as "timeout_s must be >= 0": the config field's name,
    which no user set, where a value that is no number names the variable."""
    import pytest

    from tpgraph.errors import ConfigError

    for value in ("-1", "inf", "nan", "1e11"):
        monkeypatch.setenv("TPGRAPH_AR_TIMEOUT_S", value)
        with pytest.raises(ConfigError, match=f"^TPGRAPH_AR_TIMEOUT_S must be a number of seconds .* got '{value}'"):
            CustomAllReduceConfig()


def test_a_view_that_starts_mid_vector_goes_to_nccl_not_to_an_error(monkeypatch):
    """x[1:] of a bf16 buffer is contiguous and its size a multiple of 16 bytes, but it starts 2 bytes into a 16-byte
    vector: try_all_reduce must decline it (the communicator then uses NCCL), not reach the kernel's alignment
    check. An aligned tensor of the same size still runs."""
    from tpgraph.comm.custom_ar import size_workspace
    from tpgraph.comm.thresholds import load_table_for

    ran = []

    class AlignedOnly:
        def ar_all_reduce(self, ctx, algo, dtype, inp, out, nbytes, blocks, stream, timeout, row):
            if inp % 16 or out % 16:
                raise RuntimeError("input and output must be 16-byte aligned")
            ran.append(nbytes)

    ar = object.__new__(CustomAllReduce)
    ar.ext, ar.ctx, ar.cfg = AlignedOnly(), 1, CustomAllReduceConfig()
    ar.state = ParallelState(0, 2, 0, torch.device("cpu"), None, None)
    ar._capturing, ar._plans, ar._pending, ar._device_index = False, {}, [], -1
    ar.num_sms, ar.zero_copy, ar.timeout_ns = 132, True, 0
    _, _, ar.table = size_workspace(load_table_for((9, 0)), 2, ar.cfg, True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    buf = torch.zeros(4097 + 8, dtype=torch.bfloat16)
    x = buf[1:4097]
    assert x.is_contiguous() and x.data_ptr() % 16 == 2 and ar.pick(x) is not None
    assert ar.try_all_reduce(x) is None and ran == []
    aligned = buf[8:4104] if buf[8:].data_ptr() % 16 == 0 else buf[:4096]
    assert ar.try_all_reduce(aligned) is aligned and ran == [8192]


def test_a_strided_tensor_reaches_nccl_contiguous(monkeypatch):
    """NCCL refuses a strided tensor (gloo takes one, so the multi-rank CPU tests could not show it): the
    communicator hands the collective a contiguous copy and returns it."""
    from tpgraph.comm import communicator
    from tpgraph.comm.communicator import TPCommunicator

    seen = []

    def fake_all_reduce(t, group=None):
        seen.append(t.is_contiguous())
        t.mul_(2)

    monkeypatch.setattr(communicator.dist, "all_reduce", fake_all_reduce)
    comm = object.__new__(TPCommunicator)
    comm.state, comm.world_size, comm.custom = ParallelState(0, 2, 0, torch.device("cpu"), None, None), 2, None
    x = torch.arange(6.0).view(2, 3).t()
    out = comm.all_reduce(x)
    assert seen == [True] and torch.equal(out, torch.arange(6.0).view(2, 3).t() * 2)


def test_a_peer_workspace_that_cannot_be_mapped_fails_with_its_own_error_and_frees_the_workspace(monkeypatch):
    """cudaIpcOpenMemHandle of a peer's workspace can fail (two PCIe GPUs without P2P take no NVLink check). Set-up
    then releases what it made: it must close only the mappings it opened, so that the CUDA error is what the caller
    sees and the workspace is freed (closing the unopened handle raised ValueError and skipped ar_destroy)."""
    from types import SimpleNamespace

    class SetupExt(FakeExt):
        def __init__(self):
            super().__init__()
            self.destroyed = []

        def device_properties(self, index):
            return SimpleNamespace(sm_count=132, major=9, minor=0)

        def ar_create(self, rank, ws, push, staging, pdl, channel_bytes):
            return 7

        def ar_workspace(self, ctx):
            return 5 * SEGMENT

        def ipc_open_handle(self, handle):
            raise RuntimeError("CUDA error cudaErrorPeerAccessUnsupported in `cudaIpcOpenMemHandle`")

        def ipc_close_handle(self, handle):  # as ipc.cu: a handle that is not open is refused
            if handle not in self.refs:
                raise ValueError("ipc_close_handle: handle is not open on device 0")
            super().ipc_close_handle(handle)

        def ar_destroy(self, ctx):
            self.destroyed.append(ctx)

    ext = SetupExt()
    for var in ("NCCL_P2P_DISABLE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(custom_ar, "load_ext", lambda: ext)
    # rank 1 has the same GPU and exports its workspace
    def gather(state, obj):
        return [obj, b"handle-0x9900000" if isinstance(obj, bytes) else obj]

    monkeypatch.setattr(custom_ar, "gather_objects", gather)
    monkeypatch.setattr("tpgraph.distributed.gather_objects", gather)  # (run_on_all_ranks's exchange)
    state = ParallelState(0, 2, 0, torch.device("cuda", 0), None, None)
    with pytest.raises(RuntimeError, match="cudaErrorPeerAccessUnsupported"):
        CustomAllReduce(state, CustomAllReduceConfig())
    assert ext.destroyed == [7]


def test_an_empty_timeout_variable_is_unset(monkeypatch):
    """TPGRAPH_AR_TIMEOUT_S= (set to nothing, as an env file or `export VAR=` leaves it) stopped the start as "not a
    number", where every other tpgraph variable (env_flag, env_choice, TPGRAPH_CONFIG_DIR) reads nothing as unset."""
    for value in ("", "  "):
        monkeypatch.setenv("TPGRAPH_AR_TIMEOUT_S", value)
        assert CustomAllReduceConfig().timeout_s == 30.0


def test_ranks_sharing_one_gpu_take_no_nvlink_check_between_gpus_they_do_not_use(monkeypatch):
    """TPGRAPH_SHARED_GPU=1 puts every rank on GPU 0, but from 3 ranks up the set-up checked NVLink between GPUs
    0..world_size-1: with CUDA_VISIBLE_DEVICES=0 a ValueError ("names 1 devices, 4 are in use") stopped the engine,
    and with more GPUs visible it judged GPUs that no rank uses. One GPU has no pair to link."""
    from types import SimpleNamespace

    class SetupExt(FakeExt):
        def device_properties(self, index):
            return SimpleNamespace(sm_count=132, major=9, minor=0)

        def ar_create(self, rank, ws, push, staging, pdl, channel_bytes):
            raise RuntimeError("set-up got past the gates")

    checked = []
    monkeypatch.setattr(custom_ar, "load_ext", lambda: SetupExt())
    monkeypatch.setattr(custom_ar, "nvlink_reason", lambda devices: checked.append(devices) or "not linked")
    for var in ("NCCL_P2P_DISABLE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TPGRAPH_SHARED_GPU", "1")
    gather = lambda state, obj: [obj] * state.world_size
    monkeypatch.setattr(custom_ar, "gather_objects", gather)
    monkeypatch.setattr("tpgraph.distributed.gather_objects", gather)
    state = ParallelState(0, 4, 0, torch.device("cuda", 0), None, None)
    with pytest.raises(RuntimeError, match="past the gates"):
        CustomAllReduce(state, CustomAllReduceConfig())
    assert checked == []
    monkeypatch.setenv("TPGRAPH_SHARED_GPU", "0")  # four GPUs: their pairs are checked
    with pytest.raises(CommError, match="not linked"):
        CustomAllReduce(state, CustomAllReduceConfig())
    assert checked == [[0, 1, 2, 3]]


def test_ranks_on_different_machines_fall_back_to_nccl_before_any_gpu_check(monkeypatch):
    """TP across two machines (torchrun --nnodes 2) reached the single-host set-up: from 3 ranks up the NVLink check
    judged GPUs 0..world_size-1 of this host (with CUDA_VISIBLE_DEVICES naming this host's two, a ValueError stopped
    every rank), and at 2 ranks a peer's CUDA IPC handle from another machine was opened here. vLLM's custom
    all-reduce is off where the group spans nodes; here too: AllReduceUnavailable, which the communicator reads as
    "use NCCL"."""
    from tpgraph.comm.communicator import _verdict
    from tpgraph.comm.topology import host_identity, hosts_reason
    from tpgraph.errors import AllReduceUnavailable

    class SetupExt(FakeExt):
        def device_properties(self, index):
            raise AssertionError("set-up went on past the machines' check")

    checked = []
    monkeypatch.setattr(custom_ar, "load_ext", lambda: SetupExt())
    monkeypatch.setattr(custom_ar, "nvlink_reason", lambda devices: checked.append(devices))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    hosts = ["boot a", "boot a", "boot b", "boot b"]
    gather = lambda state, obj: hosts if isinstance(obj, str) else [obj] * state.world_size
    monkeypatch.setattr(custom_ar, "gather_objects", gather)
    monkeypatch.setattr("tpgraph.distributed.gather_objects", gather)
    state = ParallelState(0, 4, 0, torch.device("cuda", 0), None, None)
    with pytest.raises(AllReduceUnavailable, match="2 machines .rank 0 and rank 2") as err:
        CustomAllReduce(state, CustomAllReduceConfig())
    assert _verdict(err.value)[0] == "unavailable" and checked == []
    assert hosts_reason(["boot a"] * 4) is None
    assert host_identity() == host_identity() and host_identity().split(" ", 1)[1]
