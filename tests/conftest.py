import os

import pytest
import torch

from tpgraph.kernels._settings import triton_interpreting

# Without a GPU, Triton kernels run in its interpreter (numpy on CPU). Set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A pytest-xdist worker a core (the README's -n auto): one thread each, in the worker and in the ranks it spawns
# (they read the variable as they start). Threads of their own on cores the other workers hold made OpenMP spin
# at its barriers: the HF parity module alone took 2 min 0 s with them, 1 min 25 s without, and more under -n 2.
if "PYTEST_XDIST_WORKER" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


if triton_interpreting():  # (the project's reading of TRITON_INTERPRET, not "1" alone)
    from tpgtest.interpreter import patch_language_once_a_launch, reduce_bitwise_with_numpy

    patch_language_once_a_launch()
    reduce_bitwise_with_numpy()
