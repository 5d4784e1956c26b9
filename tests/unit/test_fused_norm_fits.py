"""Which tensors the fused 1shot_push + add + RMSNorm kernel takes (the rest run unfused)."""

import torch

from tpgraph.comm.custom_ar import fused_norm_fits


def three(rows=2, hidden=4096, dtype=torch.bfloat16):
    return torch.zeros(rows, hidden, dtype=dtype), torch.zeros(rows, hidden, dtype=dtype), torch.ones(hidden,
                                                                                                       dtype=dtype)


def test_fits_whole_chunk_rows_up_to_32_kb():
    assert fused_norm_fits(*three())
    assert fused_norm_fits(*three(hidden=256))  # one 512-byte chunk
    assert fused_norm_fits(*three(hidden=8192, dtype=torch.float32))  # 32 KB
    assert not fused_norm_fits(*three(hidden=16384, dtype=torch.float32))  # 64 KB a row
    assert not fused_norm_fits(*three(hidden=4100))  # not whole chunks
    assert not fused_norm_fits(*three(rows=0))


def test_refuses_mixed_dtypes_shapes_and_layouts():
    x, r, w = three()
    assert not fused_norm_fits(x, r, w.float())
    assert not fused_norm_fits(x, r[:1], w)
    assert not fused_norm_fits(x, r.float(), w)
    assert not fused_norm_fits(x.t().contiguous().t(), r, w)
    assert not fused_norm_fits(x.view(-1), r.view(-1), w)
    assert not fused_norm_fits(x.to(torch.int32), r.to(torch.int32), w.to(torch.int32))
