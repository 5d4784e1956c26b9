"""bench/report_allreduce.py: graph figures take each candidate's best timing method; the checks use them."""

import pytest
from tpgtest.bench_modules import load_bench_module

KB = 1 << 10


@pytest.fixture(scope="module")
def report():
    return load_bench_module("report_allreduce")


def timed(slope: float, plain: float, hidden: float, slope_key: bool) -> dict:
    """One candidate's graph figures as the bench writes them (slope_key) or as runs of a5687cb wrote them."""
    if slope_key:
        best = min(slope, plain, hidden)
        return {"graph_us": best, "graph_slope_us": slope, "graph_plain_us": plain, "graph_hidden_us": hidden}
    return {"graph_us": slope, "graph_plain_us": plain, "graph_hidden_us": hidden}


def row_8kb(auto: tuple, nccl: tuple, slope_key: bool) -> dict:
    row = {"bytes": 8 * KB, "auto_graph_algo": "1shot_push", "auto_algo": "1shot_push", "auto_eager_us": 5.0,
           "auto_eager_device_us": 2.4}
    for name, figures in (("auto", auto), ("nccl", nccl)):
        row.update({f"{name}_{k}": v for k, v in timed(*figures, slope_key=slope_key).items()})
    return row


@pytest.mark.parametrize("slope_key", [False, True])
def test_each_candidate_gets_its_lowest_method(report, slope_key):
    row = report.with_best_graph_method(row_8kb((2.3, 2.5, 2.4), (17.0, 11.5, 13.0), slope_key))
    assert (row["auto_graph_us"], row["auto_graph_method"]) == (2.3, "slope")
    assert (row["nccl_graph_us"], row["nccl_graph_method"]) == (11.5, "plain")
    assert row["nccl_graph_slope_us"] == 17.0  # kept, not overwritten by the headline
    assert report.with_best_graph_method(row) == row  # idempotent


def test_rows_without_methods_are_left_alone(report):
    row = {"bytes": 8 * KB, "auto_graph_us": 2.5, "nccl_graph_us": 11.0}
    assert report.with_best_graph_method(row) == row


@pytest.mark.parametrize(("nccl_plain", "met"), [(11.5, True), (10.0, False)])
def test_the_8kb_check_compares_best_figures(report, nccl_plain, met):
    # NCCL's slope (17) is never its figure: with plain 10.0, 2.3 / 10.0 = 0.23 > 0.22 must fail
    row = report.with_best_graph_method(row_8kb((2.3, 2.5, 2.4), (17.0, nccl_plain, 13.0), slope_key=False))
    results = {name: ok for name, ok, _ in report.checks({"rows": [row]}, p2p_gbs=380.0)}
    assert results["8 KB: auto <= 0.22x NCCL"] is met
