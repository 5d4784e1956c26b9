"""The bulk-copy projection's launch choices and input checks (CPU: the kernel itself is tested on the GPU)."""

import pytest
import torch

from tpgraph.kernels.bulk_gemv import CHUNK_BYTES, BulkConfig, bulk_linear, rows_per_chunk


@pytest.mark.parametrize("k,elem,want", [(4096, 2, 2), (2048, 2, 4), (7168, 2, 2), (1024, 2, 8), (14336, 2, 1),
                                         (16384, 2, 1), (64, 2, 8)])
def test_rows_per_chunk_reaches_the_chunk_while_x_fits_a_lane(k, elem, want):
    rows = rows_per_chunk(k, elem, BulkConfig())
    assert rows == want
    vectors_a_lane = -(-k * elem // 16 // (32 * (8 // rows)))
    assert vectors_a_lane <= 8
    assert rows == 8 or rows * k * elem >= CHUNK_BYTES or vectors_a_lane * 2 > 8


def test_rows_per_chunk_taken_from_the_config():
    assert rows_per_chunk(4096, 2, BulkConfig(rows_per_chunk=8)) == 8


@pytest.mark.parametrize("fields,match", [({"blocks_per_sm": 0}, "blocks_per_sm"), ({"rows_per_chunk": 3}, "1, 2, 4"),
                                          ({"stages": 9}, "stages"), ({"stages": 0}, "stages"),
                                          ({"trigger": "late"}, "trigger")])
def test_config_refuses_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        BulkConfig(**fields)


def test_label_names_every_field():
    assert BulkConfig(blocks_per_sm=2, stages=6, trigger="issued", evict_first=True).label == \
        "bulk b2 rauto s6 issued evict"


@pytest.mark.parametrize("x,w,match", [
    (torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 16, dtype=torch.bfloat16), r"x \[M, K\] and w \[N, K\]"),
    (torch.ones(1, 8), torch.ones(4, 8), "bfloat16 or float16"),
    (torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.float16), "of one dtype"),
    (torch.ones(5, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16), "1-4 rows"),
    (torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16), "one CUDA device"),
])
def test_inputs_refused_with_the_reason(x, w, match):
    with pytest.raises(ValueError, match=match):
        bulk_linear(x, w)


def test_the_projections_take_it_only_when_asked(monkeypatch):
    from tpgraph.kernels.bulk_gemv import takes

    x, w = torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)
    monkeypatch.delenv("TPGRAPH_BULK_GEMV", raising=False)
    assert not takes(x, w)
    monkeypatch.setenv("TPGRAPH_BULK_GEMV", "1")
    assert not takes(x, w)  # CPU tensors: the Triton or dense path as before
    monkeypatch.setenv("TPGRAPH_BULK_GEMV", "yes")
    with pytest.raises(Exception, match="TPGRAPH_BULK_GEMV must be 0 or 1"):
        takes(x, w)
