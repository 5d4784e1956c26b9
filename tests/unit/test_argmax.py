"""tpgraph/engine/argmax.py: the two-stage argmax gives torch.argmax's answer: first maximum, NaN as maximum."""

import pytest
import torch

from tpgraph.engine.argmax import chunks_for, row_argmax


def test_chunks_divide_the_vocabulary_into_pieces_of_at_least_64():
    assert chunks_for(128256) == 501  # Llama-3: 501 chunks of 256
    assert chunks_for(32000) == 500
    assert chunks_for(32003) == 1  # prime: the plain argmax
    assert chunks_for(100) == 1  # too short to split
    for vocab in (128256, 32000, 151936, 4096, 49152):
        c = chunks_for(vocab)
        assert vocab % c == 0 and (c == 1 or vocab // c >= 64)


@pytest.mark.parametrize("vocab", [128256, 32000, 49152, 32003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax_on_random_rows(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g).to(dtype)
    assert torch.equal(row_argmax(x, two_stage=True), x.argmax(dim=-1))


def test_ties_give_the_first_maximum_even_across_chunks():
    vocab = 32000  # 500 chunks of 64
    x = torch.zeros(4, vocab)
    x[0, [70, 63, 64, 31999]] = 5.0  # chunk 0 (63) before chunk 1 (64, 70)
    x[1, [128, 129]] = 2.0  # two in one chunk
    x[2, 31999] = 1.0  # the very last entry
    # row 3: all equal: index 0
    assert row_argmax(x, two_stage=True).tolist() == [63, 128, 31999, 0]
    assert torch.equal(row_argmax(x, two_stage=True), x.argmax(dim=-1))


def test_nan_counts_as_the_maximum_as_in_torch_argmax():
    x = torch.randn(2, 32000)
    x[0, 12345] = float("nan")
    x[1, 7] = float("inf")
    assert row_argmax(x, two_stage=True).tolist() == x.argmax(dim=-1).tolist() == [12345, 7]


def test_mistakes_are_refused():
    with pytest.raises(ValueError, match="batch, vocab"):
        row_argmax(torch.zeros(3))
    assert row_argmax(torch.zeros(0, 32000), two_stage=True).shape == (0,)
