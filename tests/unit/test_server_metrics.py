"""/metrics as a scraper reads it: the exposition text of ServerMetrics (the HTTP front end's request metrics) and
EngineMetrics (the engine's), held to vLLM's v1 metrics (vllm/v1/metrics/loggers.py, PrometheusStatLogger; the
request phases' definitions in vllm/v1/metrics/stats.py): names, labels, buckets and what each measures."""

import contextlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tpgraph.server.metrics import ServerMetrics

LABELS = {"model_name": "tpgraph", "engine": "0"}  # (ServerMetrics' default model_name)

# vLLM's buckets (PrometheusStatLogger), written out: the test holds ours to them, not to our own constants
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_TOKEN_GAPS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0]
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                        480.0, 960.0, 1920.0, 7680.0]


def scrape(exposition: bytes) -> dict[str, dict]:
    """The exposition's histograms and counters by name: {"type", "bounds" (a histogram's finite `le`s),
    "samples" ({(sample name, sorted labels without le): value} and each bucket's under its le)}."""
    out = {}
    for family in text_string_to_metric_families(exposition.decode()):
        samples, bounds = {}, []
        for s in family.samples:
            labels = tuple(sorted(s.labels.items()))
            samples[(s.name, labels)] = s.value
            if s.name == family.name + "_bucket" and s.labels["le"] != "+Inf":
                bounds.append(float(s.labels["le"]))
        out[family.name] = {"type": family.type, "bounds": bounds, "samples": samples}
    return out


def value(scraped: dict, family: str, sample: str, **labels: str) -> float | None:
    return scraped[family]["samples"].get((sample, tuple(sorted({**LABELS, **labels}.items()))))


@pytest.mark.parametrize(("name", "bounds"), [
    ("vllm:time_to_first_token_seconds", VLLM_TTFT),
    ("vllm:inter_token_latency_seconds", VLLM_TOKEN_GAPS),
    ("vllm:request_time_per_output_token_seconds", VLLM_TOKEN_GAPS),
    ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_LATENCY),
    ("vllm:request_queue_time_seconds", VLLM_REQUEST_LATENCY),
])
def test_the_request_histograms_have_vllms_buckets(name, bounds):
    """vLLM's buckets, so that a dashboard's histogram_quantile or heatmap built on vLLM's reads ours alike: ours
    were powers of two from 1 ms (TTFT, queue and end-to-end latency to 2621 s, the token gaps to 20 s)."""
    scraped = scrape(ServerMetrics().exposition())
    assert scraped[name]["type"] == "histogram"
    assert scraped[name]["bounds"] == bounds


def test_a_samples_prefill_decode_and_inference_phases_are_vllms(monkeypatch):
    """vLLM's vllm:request_prefill_time_seconds (first admission to first token), request_decode_time_seconds (first
    token to last) and request_inference_time_seconds (first admission to last token), per finished sample, in its
    request-latency buckets; a sample that never had a token is left out of them, as vLLM leaves out a request
    that generated none. They were not exported. Sample 0: admitted 0.25 s before its first token (the engine's
    prefill_s), tokens delivered at 1.0, 1.5 and 2.0 s; sample 1 is aborted before its first token."""
    from tpgraph.engine.updates import StepUpdate
    from tpgraph.server import metrics as server_metrics

    monkeypatch.setattr(server_metrics.time, "perf_counter", lambda: 0.0)  # (the arrival)
    metrics = ServerMetrics()
    metrics.arrived("r", 4, 2)
    metrics.observe(StepUpdate("r", 0, 7, "x", queue_s=0.5, prefill_s=0.25), 1.0)
    metrics.observe(StepUpdate("r", 0, 7, "x"), 1.5)
    metrics.observe(StepUpdate("r", 0, 7, "x", "stop"), 2.0)
    metrics.finished("r", "abort", 3.0)
    scraped = scrape(metrics.exposition())
    for name, observed in (("vllm:request_prefill_time_seconds", 0.25), ("vllm:request_decode_time_seconds", 1.0),
                           ("vllm:request_inference_time_seconds", 1.25)):
        assert scraped[name]["type"] == "histogram"
        assert scraped[name]["bounds"] == VLLM_REQUEST_LATENCY
        assert value(scraped, name, name + "_count") == 1
        assert value(scraped, name, name + "_sum") == pytest.approx(observed)
    assert value(scraped, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1


def test_a_requests_n_max_tokens_and_longest_sample_are_vllms_histograms(monkeypatch):
    """vLLM's vllm:request_params_n (buckets 1, 2, 5, 10, 20) and vllm:request_max_num_generation_tokens (the most
    tokens one of a request's samples generated), once per request when all its samples are over, and
    vllm:request_params_max_tokens per finished sample (where the request set none, the room its prompt left, as
    vLLM's server fills it in), in 1-2-5 buckets up to max_model_len. They were not exported. A request of n = 3
    and no max_tokens, 4 prompt tokens: its samples generate 3, 1 and no tokens before it is aborted; one of n = 1
    and max_tokens 16 generates 1; a refused one counts in none."""
    from tpgraph.engine.updates import REFUSED, StepUpdate

    metrics = ServerMetrics(max_model_len=600)
    metrics.arrived("r", 4, 3)
    for sample, tokens in ((0, 3), (1, 1)):
        for _ in range(tokens):
            metrics.observe(StepUpdate("r", sample, 7, "x"))
    metrics.finished("r", "abort")
    metrics.arrived("q", 4, 1, 16)
    metrics.observe(StepUpdate("q", 0, 7, "x", "length"))
    metrics.finished("q", "length")
    metrics.arrived("x", 4, 2, 8)
    metrics.finished("x", REFUSED)
    scraped = scrape(metrics.exposition())
    one_two_five = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
    for name, bounds, count, total in (("vllm:request_params_n", [1.0, 2.0, 5.0, 10.0, 20.0], 2, 3 + 1),
                                       ("vllm:request_max_num_generation_tokens", one_two_five, 2, 3 + 1),
                                       ("vllm:request_params_max_tokens", one_two_five, 4, 3 * (600 - 4) + 16)):
        assert scraped[name]["type"] == "histogram"
        assert scraped[name]["bounds"] == bounds
        assert (value(scraped, name, name + "_count"), value(scraped, name, name + "_sum")) == (count, total)


def test_the_server_hands_the_metrics_each_requests_max_tokens():
    """Api.run gives the metrics the request's max_tokens (vllm:request_params_max_tokens)."""
    import asyncio

    pytest.importorskip("fastapi")
    from tpgtest.server_stubs import ScriptedClient

    from tpgraph.engine.sampling_params import SamplingParams
    from tpgraph.server import app as server_app

    class Request:
        async def is_disconnected(self) -> bool:
            return False

    metrics = ServerMetrics()

    async def main() -> None:
        async for _ in server_app.Api(ScriptedClient(["a", "b"]), metrics, "m").run(
                Request(), [[1, 2]], SamplingParams(n=2, max_tokens=7)):
            pass

    asyncio.run(main())
    scraped = scrape(metrics.exposition())
    name = "vllm:request_params_max_tokens"
    assert (value(scraped, name, name + "_count"), value(scraped, name, name + "_sum")) == (2, 14)


def test_a_steps_tokens_are_vllms_iteration_tokens_histogram():
    """vLLM's vllm:iteration_tokens_total, in its buckets (1, 8, ... 16384): the tokens of each step that returned
    updates (vLLM observes only an iteration with outputs: a step that computed a prompt's chunk alone is not one).
    It was not exported."""
    from types import SimpleNamespace

    from tpgraph.engine.core import StepTiming
    from tpgraph.graphs.stats import GraphStats
    from tpgraph.server.metrics import EngineMetrics

    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=[], kv_usage=0.0,
                                num_preemptions=0)
    metrics = EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=GraphStats())))
    metrics.step_done(StepTiming(tokens=70), 0.01, 0.001, updates=3)  # (a 64-token prompt's first token, 6 decodes)
    metrics.step_done(StepTiming(tokens=4), 0.01, 0.001, updates=4)
    metrics.step_done(StepTiming(), 0.01, 0.001, updates=0)  # (a prompt's chunk alone)
    scraped = scrape(metrics.exposition())
    name = "vllm:iteration_tokens_total"
    assert scraped[name]["type"] == "histogram"
    assert scraped[name]["bounds"] == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert (value(scraped, name, name + "_count"), value(scraped, name, name + "_sum")) == (2, 74)
    assert value(scraped, name, name + "_bucket", le="64.0") == 1


def test_each_finish_reasons_request_count_is_exported_from_the_start():
    """vLLM creates vllm:request_success_total's series for every finish reason when it starts, at 0: a scrape before
    any request finished showed the family with no series at all, and a reason's first finished request was lost to
    rate() and increase(), which need a series' earlier sample to count from."""
    scraped = scrape(ServerMetrics().exposition())
    name = "vllm:request_success"
    for reason in ("stop", "length", "abort", "error"):
        assert value(scraped, name, name + "_total", finished_reason=reason) == 0, reason


def test_the_engine_logs_vllms_periodic_stats_line(caplog):
    """vLLM's server logs a line of engine stats every 10 s (its LoggingStatLogger), unless --disable-log-stats: the
    prompt and generation throughput since the last line, the running and waiting sequences, the KV cache's use and
    the prefix cache's hit rate; at debug level while idle (no tokens since the last line nor in the one before), so
    that an idle server's log stays quiet. The server logged nothing of the kind (and took --disable-log-stats for a
    flag with nothing to turn off). 10 s after the last line: a 64-token prompt's first token (70 tokens: the prompt,
    and 6 generated in all), then 4 generated; 16 of the 64 prompt tokens were found cached."""
    import logging
    from types import SimpleNamespace

    from tpgraph.engine.core import StepTiming
    from tpgraph.graphs.stats import GraphStats
    from tpgraph.server.metrics import EngineMetrics, StatsLog

    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[1, 2, 3], waiting=[4],
                                kv_usage=0.25, num_preemptions=0)
    metrics = EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=GraphStats())))
    stats = StatsLog(metrics, now=100.0)
    metrics.step_done(StepTiming(tokens=70), 0.01, 0.001, updates=6, generated=6)
    metrics.step_done(StepTiming(tokens=4), 0.01, 0.001, updates=4, generated=4)
    scheduler.prefix_queried_tokens, scheduler.prefix_hit_tokens = 64, 16
    caplog.set_level(logging.DEBUG, logger="tpgraph.server.metrics")
    stats.maybe_log(109.0)  # (not yet: the interval is 10 s)
    assert not caplog.records
    for now in (110.0, 120.0, 130.0):
        stats.maybe_log(now)
    busy, just_idle, idle = caplog.records
    assert busy.levelno == just_idle.levelno == logging.INFO and idle.levelno == logging.DEBUG
    assert busy.getMessage() == ("Engine 000: Avg prompt throughput: 6.4 tokens/s, Avg generation throughput: "
                                 "1.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, "
                                 "Prefix cache hit rate: 25.0%")
    assert just_idle.getMessage().startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                             "throughput: 0.0 tokens/s")


@pytest.mark.parametrize("interval,first_line_at", [("2", 102.0), ("0.5", 100.5), ("0", 110.0), ("-3", 110.0),
                                                    ("", 110.0)])
def test_the_stats_lines_interval_is_vllms_log_stats_interval(interval, first_line_at, monkeypatch, caplog):
    """vLLM logs its stats line every VLLM_LOG_STATS_INTERVAL seconds (10 where unset, or not positive): the server
    logged it every 10 s whatever the variable said."""
    import logging
    from types import SimpleNamespace

    from tpgraph.graphs.stats import GraphStats
    from tpgraph.server.metrics import EngineMetrics, StatsLog

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", interval)
    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=[], kv_usage=0.0,
                                num_preemptions=0)
    stats = StatsLog(EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=GraphStats()))),
                     now=100.0)
    caplog.set_level(logging.DEBUG, logger="tpgraph.server.metrics")
    stats.maybe_log(first_line_at - 0.01)
    assert not caplog.records
    stats.maybe_log(first_line_at)
    assert len(caplog.records) == 1


def test_the_kv_caches_configuration_is_vllms_cache_config_info():
    """vLLM exports its KV cache's configuration as vllm:cache_config_info, a gauge of 1 whose labels hold it
    (block_size, num_gpu_blocks, ...): what a router or autoscaler built on vLLM's metrics reads to turn
    vllm:kv_cache_usage_perc into tokens. It was not exported."""
    from types import SimpleNamespace

    from tpgraph.engine.runner import RunnerConfig
    from tpgraph.graphs.stats import GraphStats
    from tpgraph.server.metrics import EngineMetrics, cache_config_info

    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=[], kv_usage=0.0,
                                num_preemptions=0, allocator=SimpleNamespace(num_blocks=4096, shares_prefixes=True))
    runner = SimpleNamespace(stats=GraphStats(), cfg=RunnerConfig(block_size=16, gpu_memory_utilization=0.85))
    core = SimpleNamespace(scheduler=scheduler, runner=runner)
    scraped = scrape(EngineMetrics(core, cache=cache_config_info(core)).exposition())
    (labels,) = [dict(labels) for (sample, labels) in scraped["vllm:cache_config_info"]["samples"]
                 if sample == "vllm:cache_config_info"]
    assert scraped["vllm:cache_config_info"]["type"] == "gauge"
    assert labels == {"engine": "0", "block_size": "16", "num_gpu_blocks": "4096", "num_gpu_blocks_override": "None",
                      "gpu_memory_utilization": "0.85", "enable_prefix_caching": "True"}
    assert scraped["vllm:cache_config_info"]["samples"][("vllm:cache_config_info", tuple(sorted(labels.items())))] == 1


def test_the_prefix_cache_queries_help_says_what_is_counted():
    """The scheduler leaves a preempted sequence's recompute out of vllm:prefix_cache_queries (as vLLM's
    PrefixCacheStats), but its HELP text said a recomputed sequence counted again: a reader of /metrics was told the
    hit rate included recomputes."""
    from types import SimpleNamespace

    from tpgraph.graphs.stats import GraphStats
    from tpgraph.server.metrics import EngineMetrics

    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=[], kv_usage=0.0,
                                num_preemptions=0)
    metrics = EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=GraphStats())))
    exposition = metrics.exposition().decode()
    (doc,) = [f.documentation for f in text_string_to_metric_families(exposition)
              if f.name == "vllm:prefix_cache_queries"]
    assert "recomputed one again" not in doc and "preempted one's recompute not counted" in doc


def test_scrapes_at_once_through_several_front_ends_count_the_engines_totals_once():
    """With --api-server-count, each front end's pipe has its own reader thread on rank 0, and two scrapes at once
    (two Prometheus servers, a dashboard beside one) ran EngineMetrics.exposition together: both read the totals last
    exported before either stored the new ones, and the prefix cache's queries (hits, preemptions) were added twice."""
    import threading
    from types import SimpleNamespace

    from tpgraph.graphs.stats import GraphStats
    from tpgraph.server.metrics import EngineMetrics

    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=[], kv_usage=0.0,
                                num_preemptions=0)
    metrics = EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=GraphStats())))
    scheduler.prefix_queried_tokens, scheduler.prefix_hit_tokens, scheduler.num_preemptions = 64, 16, 1
    together, counter = threading.Barrier(2), metrics.prefix_queries

    class Meeting:  # (the two scrapes meet as they add to the counter, where they can)
        @staticmethod
        def inc(amount: float) -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait(timeout=0.5)
            counter.inc(amount)

    metrics.prefix_queries = Meeting()
    scrapes = [threading.Thread(target=metrics.exposition) for _ in range(2)]
    for scrape_ in scrapes:
        scrape_.start()
    for scrape_ in scrapes:
        scrape_.join(5)
    scraped = scrape(metrics.exposition())
    assert value(scraped, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 64
    assert value(scraped, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 16
    assert value(scraped, "vllm:num_preemptions", "vllm:num_preemptions_total") == 1
