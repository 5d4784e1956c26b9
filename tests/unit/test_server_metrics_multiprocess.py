"""Several HTTP front ends (--api-server-count): each records its requests' metrics in prometheus-client's
multiprocess mode, in a directory they share, and any one's /metrics reports them all, named and labelled as one
front end's."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tpgtest.metrics_front_ends import record, record_requests
from tpgtest.spawn import run_ranks

from tpgraph.server.metrics import ServerMetrics

MAX_MODEL_LEN = 600
REQUESTS = [[("a0", 4, 16, 3, "stop"), ("a1", 9, 16, 16, "length")],  # (front end 0's)
            [("b0", 5, 32, 2, "stop")]]  # (front end 1's)


def families(exposition: bytes) -> dict[str, tuple[str, str, dict]]:
    """{family name: (type, HELP, {(sample name, sorted labels): value})}."""
    return {f.name: (f.type, f.documentation, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(exposition.decode())}


def test_each_front_ends_metrics_expose_the_sum_of_all_front_ends(tmp_path):
    """Two front ends' processes record their requests in one directory; after both have, each one's exposition
    holds both's: the counters and histograms summed, with the same families, HELP, TYPE, samples and labels as one
    front end that took all the requests, the finish reasons none ended with at 0 among them. Only times differ:
    the latency histograms' counts are compared, and each series' creation time (its `_created` gauge, which
    prometheus-client's files do not keep) is one of this test's."""
    started = time.time()
    expositions = run_ranks(record_requests, 2, str(tmp_path), REQUESTS, MAX_MODEL_LEN, timeout_s=60)
    alone = ServerMetrics(max_model_len=MAX_MODEL_LEN)
    record(alone, REQUESTS[0] + REQUESTS[1])
    expected = families(alone.exposition())
    for exposition in expositions:
        got = families(exposition)
        assert got.keys() == expected.keys()
        for name, (kind, doc, samples) in expected.items():
            assert got[name][:2] == (kind, doc), name
            assert got[name][2].keys() == samples.keys(), name
            for key, value in samples.items():
                if name.endswith("_created"):
                    assert started <= got[name][2][key] <= time.time(), key
                elif not name.endswith("_seconds") or key[0].endswith("_count"):
                    assert got[name][2][key] == value, key
    success = families(expositions[1])["vllm:request_success"][2]
    labels = (("engine", "0"), ("finished_reason", "stop"), ("model_name", "tpgraph"))
    assert success[("vllm:request_success_total", labels)] == 2
    assert success[("vllm:request_success_total", (labels[0], ("finished_reason", "abort"), labels[2]))] == 0


def test_a_front_end_whose_prometheus_client_is_not_in_multiprocess_mode_refuses_to_start(tmp_path, monkeypatch):
    """prometheus-client picks where a metric's value lives (in the process, or in the shared directory's files) as
    it is imported, from PROMETHEUS_MULTIPROC_DIR: imported before the variable named the directory, every front
    end's metrics would silently stay its own, and each /metrics report a share of the requests."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        ServerMetrics(multiprocess_dir=str(tmp_path))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # (named, but after the import: still refused)
    with pytest.raises(RuntimeError, match="imported"):
        ServerMetrics(multiprocess_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())
