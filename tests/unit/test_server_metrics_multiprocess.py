"""Several HTTP front ends (--api-server-count): each records its requests' metrics in prometheus-client's
multiprocess mode, in a directory they share, and any one's /metrics reports them all, named and labelled as one
front end's."""

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tpgtest.metrics_front_ends import record, record_requests
from tpgtest.server_stubs import builtin_codec
from tpgtest.spawn import run_ranks

from tpgraph.engine.limits import RequestLimits
from tpgraph.server.frontend import FrontendSpec, run_frontend
from tpgraph.server.metrics import ServerMetrics
from tpgraph.server.reasoning import PARSERS
from tpgraph.server.tools import ToolOptions

MAX_MODEL_LEN = 600
REQUESTS = [[("a0", 4, 16, 3, "stop"), ("a1", 9, 16, 16, "length")],  # (front end 0's)
            [("b0", 5, 32, 2, "stop"), ("b1", 3, 32, 4, None)]]  # (front end 1's; b1 still streaming)


def families(exposition: bytes) -> dict[str, tuple[str, str, dict]]:
    """{family name: (type, HELP, {(sample name, sorted labels): value})}."""
    return {f.name: (f.type, f.documentation, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(exposition.decode())}


def test_each_front_ends_metrics_expose_the_sum_of_all_front_ends(tmp_path):
    """Two front ends' processes record their requests in one directory; after both have, each one's exposition
    holds both's: the counters and histograms summed, with the same families, HELP, TYPE, samples and labels as one
    front end that took all the requests, the finish reasons none ended with at 0 among them, and the tokens of a
    stream still open as of its latest (which came 10 s after its others) counted in. Only times differ: the latency
    histograms' counts are compared. (Each series' creation time, its `_created` sample, is not there: prometheus-
    client's files do not keep it, as vLLM's several API servers report none.)"""
    expositions = run_ranks(record_requests, 2, str(tmp_path), REQUESTS, MAX_MODEL_LEN, timeout_s=60)
    alone = ServerMetrics(max_model_len=MAX_MODEL_LEN)
    record(alone, REQUESTS[0] + REQUESTS[1])
    expected = {name: family for name, family in families(alone.exposition()).items()
                if not name.endswith("_created")}
    for exposition in expositions:
        got = families(exposition)
        assert got.keys() == expected.keys()
        for name, (kind, doc, samples) in expected.items():
            assert got[name][:2] == (kind, doc), name
            assert got[name][2].keys() == samples.keys(), name
            for key, value in samples.items():
                if not name.endswith("_seconds") or key[0].endswith("_count"):
                    assert got[name][2][key] == value, key
    success = families(expositions[1])["vllm:request_success"][2]
    labels = (("engine", "0"), ("finished_reason", "stop"), ("model_name", "tpgraph"))
    assert success[("vllm:request_success_total", labels)] == 2
    assert success[("vllm:request_success_total", (labels[0], ("finished_reason", "abort"), labels[2]))] == 0


def test_a_front_ends_tokens_reach_the_files_within_a_tenth_of_a_second_and_at_each_requests_end(tmp_path,
                                                                                                   monkeypatch):
    """In multiprocess mode each streamed token's count was a write to the shared file (~0.6 us more than an
    increment in the process); they are written together, at most TOKENS_SENT_EVERY_S after the first not yet
    written, at a request's end, and before this front end's exposition. (This process's prometheus_client is not in
    multiprocess mode: what would be written is read from the metrics' own registry.)"""
    from tpgraph.engine.updates import StepUpdate
    from tpgraph.server import metrics as server_metrics

    monkeypatch.setattr(server_metrics, "check_multiprocess_mode", lambda path: None)
    metrics = ServerMetrics(multiprocess_dir=str(tmp_path))

    def written() -> float:
        (family,) = [f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                     if f.name == "vllm:generation_tokens"]
        return family.samples[0].value

    metrics.arrived("r", 4)
    metrics.arrived("q", 4)
    token = StepUpdate("r", 0, 7, "x")
    for now, count in ((100.0, 1), (100.05, 1), (100.09, 1), (100.1, 4), (100.15, 4)):
        metrics.observe(token, now)
        assert written() == count, now
    metrics.observe(StepUpdate("q", 0, 7, "x", "stop"), 100.16)
    metrics.finished("q", "stop", 100.16)
    assert written() == 6
    metrics.observe(token, 100.17)
    assert written() == 6
    metrics.exposition()
    assert written() == 7


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


def modules_of_a_spawned_front_end(tmp_path: Path, names: tuple[str, ...], serving: bool = False) -> list[str]:
    """Which of `names` a spawned front end's process holds as run_frontend starts: a fresh interpreter imports
    tpgraph.serve (the server's main module again, as multiprocessing's spawn imports it) and unpickles the call
    (run_frontend and its FrontendSpec: the codec's tokenizer, ...), and says; serving: also once it has imported
    what it serves with (the app, the engine client, the metrics, uvicorn)."""
    spec = FrontendSpec("127.0.0.1", 8000, "m", 128, RequestLimits(100, 128, 1000), builtin_codec(), "key",
                        ToolOptions("auto"), next(iter(PARSERS.values())), index=1, count=2,
                        metrics_dir=str(tmp_path))
    call = tmp_path / "call.pkl"
    call.write_bytes(pickle.dumps((run_frontend, spec)))
    code = (f"import pickle, sys; import tpgraph.serve; pickle.loads(open({str(call)!r}, 'rb').read()); "
            f"print(' '.join(name for name in {names!r} if name in sys.modules))")
    if serving:  # (and what run_frontend itself imports then, once it has named the metrics' directory)
        code += ("; import tpgraph.server.app, tpgraph.server.bridge, tpgraph.server.metrics, uvicorn; "
                 f"print(' '.join(name for name in {names!r} if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_front_ends_process_has_not_imported_prometheus_client_when_run_frontend_starts(tmp_path):
    """run_frontend names the metrics' directory to prometheus-client first, which works only where nothing the
    spawned process imported before it imported prometheus_client."""
    assert modules_of_a_spawned_front_end(tmp_path, ("prometheus_client",)) == []


def test_a_spawned_front_end_imports_no_torch_triton_or_engine(tmp_path):
    """A front end serves HTTP and needs no torch: the server's main module, which each spawned front end imports
    again, held torch and triton through its flags' constants (335 MB of each front end's memory, 2 s of its start,
    and triton's nanobind leak report at its exit)."""
    heavy = ("torch", "triton", "tpgraph.engine.core", "tpgraph.engine.runner", "tpgraph.engine.tp_engine",
             "tpgraph.engine.scheduler", "tpgraph.model", "tpgraph.kernels", "tpgraph.distributed", "tpgraph.comm")
    assert modules_of_a_spawned_front_end(tmp_path, heavy, serving=True) == []
