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

    def allocation_range(self, ptr):
        return ptr - ptr % SEGMENT, SEGMENT

    def ipc_get_handle(self, base):
        return f"handle-{base:#x}".encode()

    def ipc_open_handle(self, handle):
        self.opened.append(handle)
        return 0x7F00_0000_0000 + int(handle.decode().split("-")[1], 16) // SEGMENT * SEGMENT

    def ar_fill_rows(self, ctx, rows, ptrs):
        self.filled = (list(rows), list(ptrs))


def fake_communicator(rank, peer_exports, monkeypatch):
    ar = object.__new__(CustomAllReduce)
    ar.ext = FakeExt()
    ar.ctx = 1
    ar.state = ParallelState(rank, 2, rank, torch.device("cpu"), None, None)
    ar._pending = []
    ar._opened = []
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
    assert ar._pending == []  # rows are never reused


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


def test_opened_peer_mappings_are_remembered_for_close(monkeypatch):
    ar = fake_communicator(0, [1, [(b"handle-0x100000", 16)], None], monkeypatch)
    ar._pending = [(0, 9 * SEGMENT + 32)]
    ar.register_captured()
    assert ar._opened == [b"handle-0x100000"]


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


def test_grids_follow_the_smallest_gpu_and_architectures_must_match():
    assert agree_on_devices([(132, (9, 0)), (114, (9, 0))]) == 114
    with pytest.raises(CommError, match=r"differ in architecture \['sm_90', 'sm_100'\]"):
        agree_on_devices([(132, (9, 0)), (148, (10, 0))])


def test_config_reads_the_environment_when_made(monkeypatch):
    monkeypatch.setenv("TPGRAPH_AR_TIMEOUT_S", "7")
    monkeypatch.setenv("TPGRAPH_AR_PDL", "0")
    cfg = CustomAllReduceConfig()
    assert cfg.timeout_s == 7.0 and cfg.pdl is False
