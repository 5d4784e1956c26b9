"""Markers the kernel tests share."""

import os

import pytest
import torch

# kernels on CPU tensors run only under Triton's interpreter; on a GPU machine without it they are skipped
interpreted = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")


def gpus_for(ranks: int) -> bool:
    """Whether `ranks` ranks can run here: a GPU each, or all of them on GPU 0 under TPGRAPH_SHARED_GPU=1 (a
    functional stand-in on one GPU, tpgraph.distributed.shared_gpu)."""
    from tpgraph.distributed import shared_gpu

    count = torch.cuda.device_count()
    return count >= ranks or (count >= 1 and shared_gpu())


def needs_gpus(ranks: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not gpus_for(ranks), reason=f"needs {ranks} GPUs (or TPGRAPH_SHARED_GPU=1 and one)")
