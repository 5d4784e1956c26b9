"""The Python policy takes the kernels' sizes and codes from the extension, not from copies."""

import torch

from tpgraph.comm.limits import algo_codes, dtype_codes, kernel_limits
from tpgraph.comm.thresholds import Algo


def test_limits_and_codes_come_from_the_extension():
    import tpgraph._C as ext

    from tpgraph.comm.limits import BUILT_WITH

    k = kernel_limits()
    assert vars(k) == ext.limits() == vars(BUILT_WITH)  # the fallback for extension-less installs cannot drift
    assert k.chunk_bytes == k.push_chunk_vectors * k.vector_bytes
    assert set(algo_codes()) == {a.value for a in Algo} - {"nccl"}
    assert len(set(algo_codes().values())) == 4
    assert set(dtype_codes()) == {torch.float32, torch.bfloat16, torch.float16}
