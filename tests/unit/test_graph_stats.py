import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from tpgraph.errors import ConfigError
from tpgraph.graphs.dispatcher import GraphMode
from tpgraph.graphs.modes import Downgrade
from tpgraph.graphs.stats import GraphStats


def sample(stats, name, **labels):
    return stats.registry.get_sample_value(name, labels)


def recorded():
    stats = GraphStats()
    for _ in range(3):
        stats.record("decode", 9, 12, GraphMode.FULL)
    stats.record("decode", 1, 1, GraphMode.FULL)
    stats.record("decode", 300, 300, GraphMode.NONE)
    stats.record("prefill", 20, 32, GraphMode.PIECEWISE)
    stats.record("prefill", 20, 32, GraphMode.PIECEWISE)
    return stats


def test_frequency_table_sorted_by_count():
    assert recorded().frequency_table() == [
        ("decode", "full", 9, 12, 3),
        ("prefill", "piecewise", 20, 32, 2),
        ("decode", "full", 1, 1, 1),
        ("decode", "none", 300, 300, 1),
    ]


def test_padding_ratio():
    stats = recorded()
    decode_real, decode_padded = 3 * 9 + 1 + 300, 3 * 12 + 1 + 300
    assert stats.padding_ratio("decode") == pytest.approx(decode_padded / decode_real - 1)
    assert stats.padding_ratio("prefill") == pytest.approx(64 / 40 - 1)
    assert stats.padding_ratio() == pytest.approx((decode_padded + 64) / (decode_real + 40) - 1)
    assert stats.padding_ratio("unknown") == 0.0
    assert GraphStats().padding_ratio() == 0.0


def test_prometheus_counters():
    stats = recorded()
    assert sample(stats, "tpgraph_graph_steps_total", phase="decode", mode="full") == 4
    assert sample(stats, "tpgraph_graph_padded_tokens_total", phase="decode", mode="full") == 3 * 12 + 1
    assert sample(stats, "tpgraph_graph_real_tokens_total", phase="decode", mode="full") == 3 * 9 + 1
    assert sample(stats, "tpgraph_graph_steps_total", phase="decode", mode="none") == 1
    assert sample(stats, "tpgraph_graph_padded_tokens_total", phase="prefill", mode="piecewise") == 64
    assert sample(stats, "tpgraph_graph_real_tokens_total", phase="prefill", mode="piecewise") == 40
    assert sample(stats, "tpgraph_graph_steps_total", phase="prefill", mode="full") is None


def test_own_registry_never_the_global_one():
    a, b = GraphStats(), GraphStats()  # two in one process do not collide
    a.record("decode", 1, 2, GraphMode.FULL)
    assert b.registry is not a.registry
    assert sample(b, "tpgraph_graph_steps_total", phase="decode", mode="full") is None
    assert REGISTRY.get_sample_value("tpgraph_graph_steps_total", {"phase": "decode", "mode": "full"}) is None


def test_given_registry_used_and_not_shared_twice():
    registry = CollectorRegistry()
    stats = GraphStats(registry)
    assert stats.registry is registry
    stats.record("decode", 3, 4, GraphMode.PIECEWISE)
    assert registry.get_sample_value("tpgraph_graph_steps_total", {"phase": "decode", "mode": "piecewise"}) == 1
    with pytest.raises(ConfigError, match="its own registry"):
        GraphStats(registry)


def test_record_downgrade():
    stats = GraphStats()
    stats.record_downgrade("decode", "full", "piecewise", "backend X")
    labels = dict(phase="decode", requested="full", resolved="piecewise", reason="backend X")
    assert sample(stats, "tpgraph_graph_mode_downgrade", **labels) == 1
    assert stats.downgrades == (Downgrade("decode", "full", "piecewise", "backend X"),)
    assert "decode: full -> piecewise (backend X)" in stats.summary()


def test_summary_table():
    text = recorded().summary()
    lines = text.splitlines()
    assert lines[0].split() == ["phase", "mode", "unpadded", "padded", "count"]
    assert lines[2].split() == ["decode", "full", "9", "12", "3"]
    assert lines[5].split() == ["decode", "none", "300", "300", "1"]
    assert "decode padding: 2.7% extra tokens" in text
    assert "prefill padding: 60.0% extra tokens" in text
    assert GraphStats().summary() == "graph steps: none recorded"


@pytest.mark.parametrize("unpadded, padded", [(0, 4), (5, 4)])
def test_record_refuses_impossible_steps(unpadded, padded):
    with pytest.raises(ConfigError, match="unpadded <= padded"):
        GraphStats().record("decode", unpadded, padded, GraphMode.FULL)


def test_metrics_count_graph_steps_from_the_end_of_the_warm_up():
    """serve.py warms up (TPEngine.warm_up: dozens of steps at 1, 3, 16 and max_num_seqs rows), then makes its
    EngineMetrics: /metrics reported those steps and their padding as served ones before any request came (the prefix
    cache counters start there already). The downgrades, start-up facts, stay."""
    from types import SimpleNamespace

    from tpgraph.server.metrics import EngineMetrics

    stats = recorded()
    stats.record_downgrade("decode", "full", "none", "r")
    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=[], kv_usage=0.0,
                                num_preemptions=0)
    metrics = EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=stats)))
    text = metrics.exposition().decode()
    assert "tpgraph_graph_steps_total{" not in text and "tpgraph_graph_mode_downgrade{" in text
    stats.record("decode", 3, 4, GraphMode.FULL)
    assert sample(stats, "tpgraph_graph_steps_total", phase="decode", mode="full") == 1
    assert sample(stats, "tpgraph_graph_padded_tokens_total", phase="decode", mode="full") == 4
    assert stats.frequency_table() == [("decode", "full", 3, 4, 1)]


def test_metrics_count_preemptions_from_the_end_of_the_warm_up():
    """TPEngine.warm_up runs max_num_seqs prompts and one of max_num_batched_tokens at once, which preempts where the
    KV cache is small; the scheduler's total, warm-up's included, was exported as served preemptions (the prefix
    cache counters and graph steps start after the warm-up already)."""
    from types import SimpleNamespace

    from tpgraph.server.metrics import EngineMetrics

    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=[], kv_usage=0.0,
                                num_preemptions=2)
    metrics = EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=GraphStats())))
    labels = {"model_name": "tpgraph", "engine": "0"}  # (vLLM's name and labels; EngineMetrics' default model_name)
    metrics.exposition()
    assert metrics.registry.get_sample_value("vllm:num_preemptions_total", labels) == 0
    scheduler.num_preemptions = 5
    metrics.exposition()
    assert metrics.registry.get_sample_value("vllm:num_preemptions_total", labels) == 3
