"""bench/bench_pdl_boundary.py off the GPU: the hop kernel under Triton's interpreter carries every row K hops (what
the bench checks before it times), the reference, the table, and the modes it refuses."""

import os
from pathlib import Path

import pytest
import torch
from tpgtest.bench_modules import load_bench_module
from tpgtest.markers import interpreted


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("triton")
    return load_bench_module("bench_pdl_boundary")


def test_the_reference_moves_each_row_k_places_and_adds_k(bench):
    start = torch.arange(5.0)[:, None].expand(5, 3)
    assert torch.equal(bench.hops_reference(start, 7), start[[2, 3, 4, 0, 1]] + 7)
    assert torch.equal(bench.hops_reference(start, 0), start)


@interpreted
@pytest.mark.parametrize(("mode", "grid", "hops"), [("plain", 1, 3), ("plain", 5, 4), ("plain", 6, 7),
                                                    ("barrier", 1, 5), ("barrier", 1, 4)])
def test_the_hops_carry_every_row(bench, mode, grid, hops):
    """(The interpreter runs programs one after another: a barrier of more than one program would never pass.)"""
    chain = bench.BoundaryChain(mode, grid, hops, torch.device("cpu"))
    bench.check(chain)  # raises where a row was not carried
    bench.check(chain)  # and again: the barrier's counts carry over from the pass before
    broken = bench.BoundaryChain(mode, grid, hops, torch.device("cpu"))
    broken.run = lambda: None  # no hop runs: the rows stay where they were
    with pytest.raises(AssertionError, match="did not carry"):
        bench.check(broken)


@pytest.mark.parametrize("late", [False, True])
def test_the_kernels_compile_for_sm90(monkeypatch, late):
    """Ahead of time, without a GPU: a PDL hop waits before its load and lets the next one in before or after its
    store; the barrier has its block barrier, its acq_rel count and its acquire poll."""
    from tpgtest.ptx import sm90_ptx

    pytest.importorskip("triton")
    bench_dir = str(Path(__file__).resolve().parents[2] / "bench")  # the compile runs in a subprocess
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [bench_dir, os.environ.get("PYTHONPATH")])))
    hop = sm90_ptx("bench_pdl_boundary", "_hop", {"src": "*fp32", "dst": "*fp32"}, ["G"],
                   {"WIDTH": 128, "PDL": True, "LATE": late}, num_warps=1)
    wait, trigger = hop.index("griddepcontrol.wait"), hop.index("griddepcontrol.launch_dependents")
    assert wait < hop.index("ld.global")
    assert (trigger > hop.index("st.global")) == late
    barrier = sm90_ptx("bench_pdl_boundary", "_hops_with_barriers",
                       {"a": "*fp32", "b": "*fp32", "counts": "*i32", "failed": "*i32"}, ["G", "HOPS", "SPIN_LIMIT"],
                       {"WIDTH": 128}, num_warps=1)
    # the block barrier, the count, and the poll (Triton makes an acquire add of 0 an acquire load)
    assert "bar.sync" in barrier and "atom.global.gpu.acq_rel.add" in barrier and "ld.global.gpu.acquire" in barrier


def test_modes_without_a_gpu_are_refused(bench):
    with pytest.raises(ValueError, match="mode must be one of"):
        bench.BoundaryChain("fast", 4, 2, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="pdl needs a GPU"):
        bench.BoundaryChain("pdl", 4, 2, torch.device("cpu"))


def test_the_table_has_a_row_per_grid_and_a_column_per_mode(bench):
    rows = [{"grid": g, "mode": m, "us_per_hop": g / 10 + i} for g in (132, 1) for i, m in enumerate(("plain", "pdl"))]
    assert bench.table(rows, ["plain", "pdl"]).splitlines()[2:] == ["| 1 | 0.10 | 1.10 |", "| 132 | 13.20 | 14.20 |"]
