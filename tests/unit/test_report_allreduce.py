"""bench/report_allreduce.py: the checks of issue 10 on synthetic benchmark rows (they must be able to fail)."""

import pytest
from tpgtest.bench_modules import load_bench_module

KB, MB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def report():
    return load_bench_module("report_allreduce")


def row(nbytes, auto, push, pull1, pull2, nccl, symm=(99.0, 99.0), auto_eager=None):
    r = {"bytes": nbytes, "auto_graph_algo": "1shot_push", "auto_algo": "1shot_push"}
    for mode, scale in (("graph", 1.0), ("eager", 2.0)):
        for name, us in (("auto", auto if mode == "graph" or auto_eager is None else auto_eager / scale),
                         ("1shot_push", push), ("1shot_pull", pull1), ("2shot_pull", pull2), ("nccl", nccl),
                         ("symm_1shot", symm[0]), ("symm_2shot", symm[1])):
            r[f"{name}_{mode}_us"] = us * scale
    return r



def test_auto_at_the_best_forced_passes_and_a_miss_fails(report):
    good = {"rows": [row(8 * KB, 2.2, 2.2, 3.0, 4.0, 17.0), row(64 * MB, 193, 200, 210, 195, 264, symm=(369.0, 212.0))],
            "in_layer": {"8KB": {"auto": 3.2}}}
    checks = {n: ok for n, ok, _ in report.checks(good, 400.0)}
    assert all(ok for n, ok in checks.items() if "within 5%" in n or "best peer" in n or "in a layer" in n)
    bad = {"rows": [row(8 * KB, 2.5, 2.2, 3.0, 4.0, 17.0)], "in_layer": {"8KB": {"auto": 3.5}}}
    checks = {n: ok for n, ok, _ in report.checks(bad, 400.0)}
    assert checks["graph: auto within 5% of the best forced algorithm at every size"] is False  # 2.5 / 2.2
    assert [ok for n, ok in checks.items() if "in a layer" in n] == [False]  # 3.5 > 0.7 x 4.77


def test_eager_is_checked_on_its_own(report):
    doc = {"rows": [row(8 * KB, 2.2, 2.2, 3.0, 4.0, 17.0, auto_eager=5.0)]}  # eager push 4.4, auto 5.0: +14%
    checks = {n: ok for n, ok, _ in report.checks(doc, None)}
    assert checks["eager: auto within 5% of the best forced algorithm at every size"] is False
    assert checks["graph: auto within 5% of the best forced algorithm at every size"] is True


def test_a_peer_faster_than_auto_fails(report):
    doc = {"rows": [row(2 * MB, 14.0, 14.0, 15.0, 16.0, 45.0, symm=(18.7, 13.3))]}
    checks = {n: ok for n, ok, _ in report.checks(doc, None)}
    assert checks["graph: auto <= 1.0x the best peer at every size"] is False
    assert "2 MB" in report.table(doc["rows"])


def test_forced_push_beyond_the_products_slot_is_not_a_choice(report):
    # at 32 MB forced push (from a 64 MB workspace) is fastest, but the product caps push at 16 MB
    doc = {"rows": [row(32 * MB, 100.0, 90.0, 99.0, 98.0, 150.0, symm=(300.0, 120.0))], "push_cap_bytes": 16 * MB}
    checks = {n: ok for n, ok, _ in report.checks(doc, None)}
    assert checks["graph: auto within 5% of the best forced algorithm at every size"] is True
    doc.pop("push_cap_bytes")
    checks = {n: ok for n, ok, _ in report.checks(doc, None)}
    assert checks["graph: auto within 5% of the best forced algorithm at every size"] is False
