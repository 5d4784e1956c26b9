"""tests/tpgtest/interpreter.py's speed-ups of Triton's interpreter give the answers its own slow paths give: numpy's
bitwise reductions equal the one-element-at-a-time fold along either axis of a block, and launches after launches of a
kernel whose device functions are called many times in each (tl.sort's, from triton.language's own modules) give
torch's answer."""

import functools
import operator

import pytest
import torch

from tpgraph.kernels._settings import triton_interpreting

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="the interpreter's speed-ups")
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


@triton.jit
def _reduce_probe(x_ptr, out_ptr, AXIS: tl.constexpr, OR: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    if OR:
        y = tl.reduce_or(x, AXIS, keep_dims=True)
    else:
        y = tl.xor_sum(x, AXIS, keep_dims=True)
    if AXIS == 0:
        tl.store(out_ptr + tl.arange(0, C)[None, :], y)
    else:
        tl.store(out_ptr + tl.arange(0, R)[:, None], y)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("use_or", [False, True], ids=["xor", "or"])
def test_the_bitwise_reductions_equal_the_fold(axis, use_or):
    assert getattr(interpreter.ReduceOps.apply_impl, "bitwise_by_numpy", False)  # (installed by tests/conftest.py)
    x = torch.randint(-2**31, 2**31 - 1, (8, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    out = torch.empty(16 if axis == 0 else 8, dtype=torch.int32)
    _reduce_probe[(1,)](x, out, AXIS=axis, OR=use_or, R=8, C=16)
    fold = functools.partial(functools.reduce, operator.or_ if use_or else operator.xor)
    rows = x.numpy().T if axis == 0 else x.numpy()
    assert out.tolist() == [int(fold(list(r))) for r in rows]


@triton.jit
def _sort_probe(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.sort(tl.load(x_ptr + offs), descending=True))  # (xor reductions, device calls)


def test_sorts_in_launch_after_launch_equal_torchs():
    assert getattr(interpreter._patch_lang, "once_a_launch", False)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    out = torch.empty_like(x)
    for row in range(4):  # (a launch after a launch: each patches and restores triton.language)
        _sort_probe[(1,)](x[row], out[row], N=256)
    assert torch.equal(out, x.sort(dim=1, descending=True).values)
