"""The ring GEMV's launch arithmetic and its refusals (tpgraph/kernels/gemv_ring.py); the kernel itself runs in
tests/gpu/test_gemv_ring_gpu.py."""

import pytest
import torch

from tpgraph.kernels.gemv_ring import MAX_STAGES, RingConfig, gemv_ring, ring_launch


def test_chunks_are_whole_rows_near_the_chunk_bytes():
    launch = ring_launch(4096, 2048, RingConfig(chunk_bytes=16 << 10, ring_bytes=96 << 10), sms=132)
    assert (launch.grid, launch.rows_per_chunk, launch.stages) == (132, 4, 6)  # 4 KB rows, 16 KB chunks


def test_a_row_longer_than_the_chunk_is_one_chunk_and_stages_stay_in_range():
    launch = ring_launch(4096, 7168, RingConfig(chunk_bytes=8 << 10, ring_bytes=8 << 10), sms=132)
    assert (launch.rows_per_chunk, launch.stages) == (1, 2)  # at least double-buffered
    launch = ring_launch(4096, 64, RingConfig(chunk_bytes=128, ring_bytes=1 << 20), sms=132)
    assert launch.stages == MAX_STAGES


def test_the_grid_never_exceeds_the_rows():
    assert ring_launch(100, 4096, RingConfig(per_sm=2), sms=132).grid == 100
    assert ring_launch(4096, 4096, RingConfig(per_sm=2), sms=132).grid == 264


@pytest.mark.parametrize("k", [0, 4100, 2052])
def test_k_must_be_a_multiple_of_eight(k):
    with pytest.raises(ValueError, match="multiple of 8"):
        ring_launch(64, k, RingConfig(), sms=132)


def test_k_beyond_what_the_threads_keep_names_the_fix():
    with pytest.raises(ValueError, match="take more threads"):
        ring_launch(64, 8 * 8 * 128 + 8, RingConfig(threads=128), sms=132)
    ring_launch(64, 8 * 8 * 128, RingConfig(threads=128), sms=132)


@pytest.mark.parametrize("bad", [dict(threads=64), dict(chunk_bytes=0), dict(chunk_bytes=2, ring_bytes=1),
                                 dict(per_sm=0)])
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError, match="RingConfig"):
        RingConfig(**bad)


def test_bad_inputs_are_refused_before_any_launch():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        gemv_ring(torch.zeros(1, 16), w)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv_ring(torch.zeros(2, 16, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv_ring(torch.zeros(1, 32, dtype=torch.bfloat16)[:, ::2], w)
    with pytest.raises(ValueError, match="sm_90"):
        gemv_ring(torch.zeros(1, 16, dtype=torch.bfloat16), w)


def test_the_decode_path_takes_the_ring_only_when_asked_and_only_on_a_gpu(monkeypatch):
    from tpgraph.kernels.gemv_ring import ring_applies

    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    monkeypatch.delenv("TPGRAPH_RING_GEMV", raising=False)
    assert not ring_applies(x, w)
    monkeypatch.setenv("TPGRAPH_RING_GEMV", "1")
    assert not ring_applies(x, w)  # a CPU tensor
