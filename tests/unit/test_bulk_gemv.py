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
                                          ({"stages": 9}, "stages"), ({"stages": -1}, "stages"),
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
    from tpgraph.kernels.bulk_gemv import FILL, step_config, takes

    monkeypatch.delenv("TPGRAPH_BULK_GEMV", raising=False)
    assert step_config() is None
    monkeypatch.setenv("TPGRAPH_BULK_GEMV", "1")
    assert step_config() == BulkConfig()
    monkeypatch.setenv("TPGRAPH_BULK_GEMV", "2")
    assert step_config() == BulkConfig(stages=FILL)
    monkeypatch.setenv("TPGRAPH_BULK_GEMV", "yes")
    with pytest.raises(Exception, match="TPGRAPH_BULK_GEMV must be one of 0, 1, 2"):
        step_config()
    x, w = torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)
    assert not takes(x, w)  # CPU tensors: the Triton or dense path as before


@pytest.mark.parametrize("n,k,blocks,want", [
    (4096, 2048, 264, 4),  # o_proj: 16 rows a block, 4 a chunk: the whole slice
    (3072, 4096, 264, 6),  # qkv: 12 rows, 2 a chunk
    (4096, 7168, 264, 3),  # down: 8 chunks of 28 KiB, 3 fit 96 KiB
    (14336, 4096, 264, 6),  # gate_up: 55 rows, 6 chunks of 16 KiB fit
    (64128, 4096, 264, 6),
    (7, 8, 7, 1),
])
def test_fill_issues_the_whole_slice_where_it_fits(n, k, blocks, want):
    from tpgraph.kernels.bulk_gemv import FILL, stages_for

    assert stages_for(BulkConfig(stages=FILL), n, k, 2, blocks) == want
    assert stages_for(BulkConfig(stages=3), n, k, 2, blocks) == 3
    assert BulkConfig(stages=FILL).label.startswith("bulk b2 rauto sfill")
