import pytest
import torch

from tpgraph.errors import CaptureError, ConfigError
from tpgraph.graphs.buffers import ALIGN, Pad, PersistentBuffers

STEP1 = [10, 11, 12, 13, 14]  # n=5, padded=8
STEP2 = [20, 21]  # n=2, padded=4


def run_two_steps(pad, init=0):
    bufs = PersistentBuffers(8, "cpu")
    bufs.add("x", torch.int64, pad)
    host = bufs.host_np("x")
    host[:5] = STEP1
    bufs.commit(5, 8)
    after1 = bufs.device("x").tolist()
    host[:2] = STEP2
    bufs.commit(2, 4)
    return after1, bufs.device("x").tolist(), bufs


def test_keep_copies_stale_host_rows():
    after1, after2, _ = run_two_steps(Pad.KEEP)
    assert after1 == [10, 11, 12, 13, 14, 0, 0, 0]
    # rows 2, 3 of step 2 are step 1's rows, copied as the host held them; row 4+ is past padded, not copied
    assert after2 == [20, 21, 12, 13, 14, 0, 0, 0]


def test_zero_zeroes_the_tail():
    after1, after2, bufs = run_two_steps(Pad.ZERO)
    assert after1 == [10, 11, 12, 13, 14, 0, 0, 0]
    assert after2 == [20, 21, 0, 0, 14, 0, 0, 0]
    assert bufs.host("x").tolist() == [20, 21, 0, 0, 14, 0, 0, 0]


def test_fill_sentinel():
    after1, after2, _ = run_two_steps(Pad.fill(-1))
    assert after1 == [10, 11, 12, 13, 14, -1, -1, -1]
    assert after2 == [20, 21, -1, -1, 14, -1, -1, -1]


def test_copy_head_only_leaves_device_tail_untouched():
    after1, after2, bufs = run_two_steps(Pad.COPY_HEAD_ONLY)
    assert after1 == [10, 11, 12, 13, 14, 0, 0, 0]
    # rows 2, 3 still hold step 1's device contents; no copy touched them
    assert after2 == [20, 21, 12, 13, 14, 0, 0, 0]
    # a host row written past n never reaches the device
    bufs.host_np("x")[:4] = [1, 2, 99, 99]
    assert bufs.commit(2, 8) == 2 * 8
    assert bufs.device("x").tolist() == [1, 2, 12, 13, 14, 0, 0, 0]


def test_fill_once_restores_only_rows_an_earlier_step_wrote():
    after1, after2, bufs = run_two_steps(Pad.fill_once(-1))
    assert after1 == [10, 11, 12, 13, 14, -1, -1, -1]
    # rows 2, 3 were written by step 1 and are restored; row 4 is past padded and keeps step 1's value
    assert after2 == [20, 21, -1, -1, 14, -1, -1, -1]
    # a larger padded size restores row 4 too; rows 5..7 were never written, so they are not copied at all
    bufs.host_np("x")[:2] = [30, 31]
    bufs.host_np("x")[6] = 99  # never a real row: not copied, the device keeps the fill value
    assert bufs.commit(2, 8) == 5 * 8  # rows 0..4
    assert bufs.device("x").tolist() == [30, 31, -1, -1, -1, -1, -1, -1]
    # steady state: the same batch size copies only its own rows and fills nothing
    bufs.host_np("x")[:2] = [40, 41]
    assert bufs.commit(2, 8) == 2 * 8
    assert bufs.device("x").tolist() == [40, 41, -1, -1, -1, -1, -1, -1]
    assert bufs.host("x").tolist()[:6] == [40, 41, -1, -1, -1, -1]


def test_fill_once_starts_filled():
    bufs = PersistentBuffers(4, "cpu")
    bufs.add("slots", torch.int32, Pad.fill_once(-7))
    assert bufs.device("slots").tolist() == [-7] * 4
    assert bufs.host("slots").tolist() == [-7] * 4


def test_rows_and_mixed_buffers():
    bufs = PersistentBuffers(4, "cpu")
    bufs.add("seq_lens", torch.int32, Pad.fill(0))
    bufs.add("h", torch.bfloat16, Pad.ZERO, row_shape=(2,))
    bufs.add("block_tables", torch.int32, Pad.COPY_HEAD_ONLY, row_shape=(3,))  # wide, tail never read: last
    bt, seq, emb = (bufs.device(name) for name in ("block_tables", "seq_lens", "h"))
    assert bt.shape == (4, 3) and seq.shape == (4,) and emb.shape == (4, 2)
    bufs.host_np("block_tables")[:3] = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    bufs.host_np("seq_lens")[:3] = [5, 6, 7]
    bufs.host("h")[:3] = 1.5
    copied = bufs.commit(3, 4)
    assert copied == 2 * ALIGN + 3 * 3 * 4  # one copy: the two small buffers whole, then 3 block-table rows
    bufs.host_np("seq_lens")[:1] = [9]
    bufs.host("h")[:1] = 2.0
    bufs.commit(1, 2)
    assert bt.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]]
    assert seq.tolist() == [9, 0, 7, 0]
    assert emb.tolist() == [[2.0, 2.0], [0.0, 0.0], [1.5, 1.5], [0.0, 0.0]]
    assert bufs.names == ("seq_lens", "h", "block_tables")
    assert bufs.nbytes == 3 * ALIGN  # each buffer 256-byte aligned in one arena
    assert [bufs.device(name).data_ptr() - seq.data_ptr() for name in bufs.names] == [0, ALIGN, 2 * ALIGN]
    with pytest.raises(ConfigError, match="numpy cannot view"):
        bufs.host_np("h")


def test_device_views_share_storage():
    bufs = PersistentBuffers(8, "cpu")
    bufs.add("ids", torch.int64, Pad.ZERO)
    full = bufs.device("ids")
    view = bufs.device("ids", 3)
    assert view.shape == (3,)
    assert view.data_ptr() == full.data_ptr()
    assert bufs.device("ids") is full
    bufs.host_np("ids")[:3] = [7, 8, 9]
    bufs.commit(3, 3)
    assert view.tolist() == [7, 8, 9]
    assert bufs.device("ids").data_ptr() == full.data_ptr()  # commit writes in place, never reallocates
    assert bufs.host_np("ids").ctypes.data == bufs.host("ids").data_ptr()  # numpy view, not a copy


def test_commit_zero_rows_pads_everything():
    bufs = PersistentBuffers(4, "cpu")
    bufs.add("x", torch.int32, Pad.fill(-1))
    bufs.host_np("x")[:] = 5
    bufs.commit(0, 4)
    assert bufs.device("x").tolist() == [-1] * 4


def test_pinning_defaults_off_on_cpu():
    bufs = PersistentBuffers(2, torch.device("cpu"))
    bufs.add("x", torch.int32, Pad.ZERO)
    assert not bufs.host("x").is_pinned()


def test_errors():
    bufs = PersistentBuffers(8, "cpu")
    bufs.add("x", torch.int32, Pad.ZERO)
    with pytest.raises(ConfigError, match="declared twice"):
        bufs.add("x", torch.int32, Pad.ZERO)
    with pytest.raises(ConfigError, match="row_shape"):
        bufs.add("z", torch.int32, Pad.ZERO, row_shape=(0,))
    with pytest.raises(ConfigError, match="must be a Pad"):
        bufs.add("z", torch.int32, "zero")
    with pytest.raises(CaptureError, match="n <= padded"):
        bufs.commit(5, 4)
    with pytest.raises(CaptureError, match="exceeds the buffers' 8 rows"):
        bufs.commit(4, 9)
    with pytest.raises(CaptureError, match="cannot view 9"):
        bufs.device("x", 9)
    with pytest.raises(ConfigError, match="no persistent buffer 'y'; declared: x"):
        bufs.host("y")
    with pytest.raises(ConfigError, match="max_rows"):
        PersistentBuffers(0, "cpu")
    bufs.host("x")  # first use lays the buffers out: no more declarations
    with pytest.raises(ConfigError, match="declared after the buffers were laid out"):
        bufs.add("late", torch.int32, Pad.ZERO)


def test_span_copy_carries_earlier_buffers_rows_as_the_host_holds_them():
    """One copy per commit: a COPY_HEAD_ONLY buffer declared before a buffer that needs rows rides along in the span,
    which is safe because host rows past n still equal what the device got when they were written."""
    bufs = PersistentBuffers(4, "cpu")
    bufs.add("head", torch.int64, Pad.COPY_HEAD_ONLY)
    bufs.add("tail", torch.int64, Pad.fill(-1))
    bufs.host_np("head")[:4] = [1, 2, 3, 4]
    bufs.host_np("tail")[:4] = [5, 6, 7, 8]
    bufs.commit(4, 4)
    bufs.host_np("head")[:1] = [9]
    bufs.host_np("tail")[:1] = [10]
    assert bufs.commit(1, 2) == ALIGN + 2 * 8
    assert bufs.device("head").tolist() == [9, 2, 3, 4]
    assert bufs.device("tail").tolist() == [10, -1, 7, 8]


def test_pad_validation():
    assert Pad.fill(3) == Pad("fill", 3)
    with pytest.raises(ConfigError, match="unknown padding policy"):
        Pad("sometimes")
    with pytest.raises(ConfigError, match="needs a numeric fill value"):
        Pad("fill")
    with pytest.raises(ConfigError, match="needs a numeric fill value"):
        Pad.fill_once(None)
    with pytest.raises(ConfigError, match="takes no value"):
        Pad("zero", 1)


def test_first_use_under_inference_mode_still_commits_outside_it():
    bufs = PersistentBuffers(4, "cpu")
    bufs.add("x", torch.int64, Pad.ZERO)
    with torch.inference_mode():
        bufs.host_np("x")[:2] = [1, 2]  # lays the buffers out here
        bufs.commit(2, 2)
    bufs.host_np("x")[:2] = [3, 4]
    bufs.commit(2, 4)
    assert bufs.device("x").tolist() == [3, 4, 0, 0]
