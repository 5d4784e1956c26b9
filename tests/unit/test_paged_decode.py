"""The torch definition of paged decode attention (the Triton kernel's oracle) against dense SDPA."""

import torch
from tpgtest.paged_cases import random_paged_case

from tpgraph.kernels.paged_decode import paged_decode_reference


def test_reference_is_attention_over_the_gathered_context():
    """The reference itself against dense SDPA over the tokens that the block table names."""
    q, k, v, bt, lens, scale = random_paged_case(4, "cpu", torch.float32)
    ref = paged_decode_reference(q, k, v, bt, lens, scale)
    kvh, d = k.shape[2], k.shape[3]
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            assert torch.all(ref[b] == 0)
            continue
        kk = k[bt[b].long()].reshape(-1, kvh, d)[:n].transpose(0, 1)
        vv = v[bt[b].long()].reshape(-1, kvh, d)[:n].transpose(0, 1)
        dense = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], kk, vv, scale=scale, enable_gqa=True)
        torch.testing.assert_close(ref[b], dense[:, 0], atol=1e-5, rtol=1e-5)


def test_padded_row_gives_zeros_not_nan():
    q, k, v, bt, lens, scale = random_paged_case(0, "cpu", torch.float32)
    lens[0] = 0
    out = paged_decode_reference(q, k, v, bt, lens, scale)
    assert torch.all(out[0] == 0) and not torch.isnan(out).any()
