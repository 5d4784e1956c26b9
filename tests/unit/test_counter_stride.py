"""The arrival counters' spacing (TPGRAPH_COUNTER_STRIDE, read at import): one counter a 128-byte line gives every
kernel that counts arrivals the same results, leaves the counters at zero, and holds fewer counters; other values
are refused by name. In subprocesses, since the stride is compiled into the kernels at import."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_RUN = """
import torch
from tpgraph.kernels import _counters
from tpgraph.kernels.argmax import argmax_rows
from tpgraph.kernels.decode_attention import paged_decode_attention_v2
from tpgraph.kernels.gemv import GemvConfig, linear_small_m
print("stride", _counters.STRIDE, "max", _counters.MAX_COUNTERS)
g = torch.Generator().manual_seed(0)
x, w = torch.randn(3, 300, generator=g), torch.randn(70, 300, generator=g)
y = linear_small_m(x, w, use_triton=True, config=GemvConfig(16, 64, 4, 2, 3))
torch.save(y, "gemv.pt")
rows = torch.randn(5, 1000, generator=g)
torch.save(argmax_rows(rows), "argmax.pt")
q = torch.randn(2, 4, 64, generator=g)
kc, vc = torch.randn(16, 16, 2, 64, generator=g), torch.randn(16, 16, 2, 64, generator=g)
tables = torch.arange(16, dtype=torch.int32).view(2, 8)
lens = torch.tensor([100, 128], dtype=torch.int32)
torch.save(paged_decode_attention_v2(q, kc, vc, tables, lens, 0.125, max_seq_len=128), "attn.pt")
assert not _counters.split_counters(x.device, 1).any()
"""


def _run(tmp_path, stride: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "TPGRAPH_COUNTER_STRIDE": stride}
    return subprocess.run([sys.executable, "-c", _RUN], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_spread_counters_give_the_same_results_and_reset(tmp_path):
    import torch

    (tmp_path / "packed").mkdir()
    (tmp_path / "spread").mkdir()
    packed, spread = _run(tmp_path / "packed", "1"), _run(tmp_path / "spread", "32")
    assert packed.returncode == 0, packed.stderr[-2000:]
    assert spread.returncode == 0, spread.stderr[-2000:]
    assert "stride 1 max 65536" in packed.stdout and "stride 32 max 2048" in spread.stdout
    for name in ("gemv.pt", "argmax.pt", "attn.pt"):
        assert torch.equal(torch.load(tmp_path / "packed" / name), torch.load(tmp_path / "spread" / name)), name


def test_a_stride_other_than_1_or_32_is_refused(tmp_path):
    bad = _run(tmp_path, "8")
    assert bad.returncode != 0 and "TPGRAPH_COUNTER_STRIDE must be one of 1, 32, got '8'" in bad.stderr
