"""The vocab-parallel embedding kernel (Triton's interpreter on CPU) against the torch sequence it replaces."""


import pytest
import torch
from tpgtest.markers import interpreted

from tpgraph.kernels.embedding import vocab_shard_embedding, vocab_shard_embedding_reference

triton = pytest.importorskip("triton")


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "hidden", "start"), [(37, 96, 0), (37, 96, 37), (50, 2100, 13)])
def test_the_kernel_copies_the_rows_in_range_and_zeros_the_rest(dtype, rows, hidden, start):
    g = torch.Generator().manual_seed(rows + start)
    weight = torch.randn(rows, hidden, generator=g).to(dtype)
    weight[3] = -0.0  # a row of -0.0 stays -0.0 where it is in range (a copy, not arithmetic)
    ids = torch.tensor([start, start + 3, start - 1, start + rows, start + rows - 1, 5, 1000, 0])
    out = vocab_shard_embedding(ids, weight, start, use_triton=True)
    ref = vocab_shard_embedding_reference(ids, weight, start)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))  # the same bits, signs of zeros included
    assert torch.equal(vocab_shard_embedding(ids[:0], weight, start, use_triton=True), ref[:0])


@interpreted
def test_ids_of_any_shape_come_out_in_that_shape_and_a_bad_weight_is_refused():
    weight = torch.randn(6, 8)
    ids = torch.tensor([[0, 5], [9, 2]])
    assert torch.equal(vocab_shard_embedding(ids, weight, 2, use_triton=True),
                       vocab_shard_embedding_reference(ids, weight, 2))
    with pytest.raises(ValueError, match="expected weight"):
        vocab_shard_embedding(ids, torch.zeros(4, 8, 2), 0, use_triton=True)
