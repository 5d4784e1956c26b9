"""Markers the kernel tests share."""

import os

import pytest
import torch

# kernels on CPU tensors run only under Triton's interpreter; on a GPU machine without it they are skipped
interpreted = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")
