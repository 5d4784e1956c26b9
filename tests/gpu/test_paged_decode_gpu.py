import pytest
import torch
from tpgtest.paged_cases import random_paged_case

from tpgraph.kernels.paged_decode import paged_decode_attention, paged_decode_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(20))
def test_triton_matches_reference_on_gpu(seed, dtype):
    q, k, v, bt, lens, scale = random_paged_case(seed, "cuda", dtype, max_batch=16, max_len=600)
    out = paged_decode_attention(q, k, v, bt, lens, scale)
    ref = paged_decode_reference(q, k, v, bt, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
