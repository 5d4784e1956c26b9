"""Prometheus metrics for /metrics (prometheus-client). The engine process keeps the step-level ones (EngineMetrics:
step and host times, decode GPU time, the control path, each step's tokens, queue lengths, KV usage, preemptions,
prefix-cache queries and hits, beside the runner's graph stats); the HTTP front-end process keeps the request-level ones
(ServerMetrics: TTFT, TPOT, inter-token latency, queue time, the prefill, decode and inference phases, end-to-end
latency, finished requests, prompt and generated tokens, each finished request's prompt and generation lengths and
max_tokens: each of a request's n samples counted as a request, as vLLM's engine runs them; and per request, its n and
its longest sample's length). /metrics serves both. Several front ends (--api-server-count) each keep theirs in
prometheus-client's multiprocess mode, in a directory they share, so that any one's /metrics reports them all.
StatsLog logs vLLM's line of engine stats every 10 s (VLLM_LOG_STATS_INTERVAL's seconds, where set).

What vLLM's server also reports carries vLLM's name and labels (`vllm:num_requests_running{model_name, engine}`, ...),
so that a dashboard or autoscaler built on vLLM's metrics reads ours; what only this engine measures (its step's
parts, the control path, graph stats) is `tpgraph_*`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from tpgraph.engine.updates import REFUSED, StepUpdate
from tpgraph.server.logs import stats_interval_s

if TYPE_CHECKING:  # (EngineMetrics, on the engine's side, reads them; a front end's process never imports the engine)
    from tpgraph.engine.core import EngineCore, StepTiming

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
# vLLM's own buckets for its request metrics (PrometheusStatLogger), so that a quantile or heatmap built on vLLM's reads
# ours alike: time to first token; the gaps between tokens (each, and a request's mean); a request's phases
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
HOST_PARTS = ("schedule", "prepare", "submit", "postprocess")
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for a request's n
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's for a step's tokens
VLLM_LABELS = ("model_name", "engine")  # vLLM's labels on its metrics: the served name, the engine's index (one here)
ENGINE_INDEX = "0"
# the finish reasons a request may end with here (vLLM's FinishReason strings): each one's count is exported from the
# start, at 0, as vLLM's are, so that rate() counts a reason's first finished request
FINISH_REASONS = ("stop", "length", "abort", "error")
DEFAULT_MODEL_NAME = "tpgraph"  # (the label where none is given: tests; the server passes the served name)
DEFAULT_MAX_MODEL_LEN = 10 ** 6  # (the token histograms' reach where none is given: tests; the server passes its own)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # (prometheus-client's: where its multiprocess mode keeps the values)
# (multiprocess mode: at most this long, while a stream runs, before the other front ends' /metrics count its tokens)
TOKENS_SENT_EVERY_S = 0.1

logger = logging.getLogger(__name__)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts (build_1_2_5_buckets): 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, scale = [], 1
    while scale <= max_model_len:
        buckets += [b for b in (scale, 2 * scale, 5 * scale) if b <= max_model_len]
        scale *= 10
    return tuple(buckets)


def vllm_metrics(model_name: str, registry: CollectorRegistry) -> Callable[..., Gauge | Counter | Histogram]:
    """A maker of vLLM's metrics in `registry`: kind (Gauge, Counter, Histogram), name, doc and options, its labels
    set to this server's (the served name, engine 0)."""
    def make(kind: type, name: str, doc: str, **options: object) -> Gauge | Counter | Histogram:
        return kind(name, doc, VLLM_LABELS, registry=registry, **options).labels(model_name, ENGINE_INDEX)

    return make


def cache_config_info(core: EngineCore) -> dict[str, str]:
    """The KV cache's configuration as vLLM's vllm:cache_config_info labels it (CacheConfig.metrics_info: each value
    as Python writes it): its blocks' size and number, the number asked for (--num-gpu-blocks-override: None where
    memory sized it), the GPU memory fraction and whether prefixes are shared."""
    cfg, allocator = core.runner.cfg, core.scheduler.allocator
    return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(allocator.num_blocks),
            "num_gpu_blocks_override": str(cfg.num_kv_blocks),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "enable_prefix_caching": str(allocator.shares_prefixes)}


class EngineMetrics:
    def __init__(self, core: EngineCore, model_name: str = DEFAULT_MODEL_NAME,
                 cache: dict[str, str] | None = None) -> None:
        """cache: vllm:cache_config_info's labels (cache_config_info; None: not exported)."""
        self.core = core
        self.registry = r = CollectorRegistry()
        self.step = Histogram("tpgraph_engine_step_seconds", "Host wall time of an engine step",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.control = Histogram("tpgraph_control_path_seconds", "Per-step broadcast of changes to the other ranks",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.host = Histogram("tpgraph_step_host_seconds", "Host time of an engine step, by part (decode steps)",
                              ("part",), buckets=LATENCY_BUCKETS, registry=r)
        self.sample = Histogram("tpgraph_step_sample_seconds", "Reading sampled tokens back, the wait for the GPU "
                                "included (overlapped: the previous step's)",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("tpgraph_step_prefill_seconds", "Prefill forwards of a step (host wall time, to "
                                 "the logits' launch)", buckets=LATENCY_BUCKETS, registry=r)
        self.gpu = Histogram("tpgraph_decode_gpu_seconds", "Device time of a decode forward (CUDA events)",
                             buckets=LATENCY_BUCKETS, registry=r)
        vllm = vllm_metrics(model_name, r)
        self.running = vllm(Gauge, "vllm:num_requests_running", "Sequences running")
        self.waiting = vllm(Gauge, "vllm:num_requests_waiting", "Sequences waiting (queued, preempted, or their "
                            "grammar compiling)")
        # the sequences waiting outside the scheduler's queue: those whose grammar the bridge compiles (serve.py)
        self.waiting_elsewhere: Callable[[], int] = lambda: 0
        self.kv_usage = vllm(Gauge, "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 is all)")
        self.preemptions = vllm(Counter, "vllm:num_preemptions", "Sequences preempted (their blocks freed, to be "
                                "recomputed)")
        # (as vLLM's: a preempted sequence's recompute finding its own blocks again is not counted; the scheduler
        # counts it apart)
        self.prefix_queries = vllm(Counter, "vllm:prefix_cache_queries", "Tokens of the sequences admitted, looked "
                                   "up in the prefix cache (a preempted one's recompute not counted again)")
        self.prefix_hits = vllm(Counter, "vllm:prefix_cache_hits", "Of those, tokens found cached (not computed)")
        self.iteration_tokens = vllm(Histogram, "vllm:iteration_tokens_total", "Tokens of a step that returned "
                                     "updates: each token read back, and with a sequence's first its prompt",
                                     buckets=ITERATION_BUCKETS)
        if cache is not None:  # (an info metric, as vLLM's: a gauge of 1 whose labels say it, the engine's beside them)
            info = {"engine": ENGINE_INDEX, **cache}
            Gauge("vllm:cache_config_info", "Information of the engine's KV cache configuration", tuple(info),
                  registry=r).labels(**info).set(1)
        # the scheduler's totals when serving began (the warm-up's are not counted; a small cache preempts in its
        # batch), then as last exported
        self._counted = self._served_from = self._totals()
        self._scrape_lock = threading.Lock()
        # the prompt tokens computed (each sequence's, with its first token) and tokens generated, as vLLM's stats
        # line counts them
        self.prompt_tokens = self.generated_tokens = 0
        core.runner.stats.restart_steps()  # the graph steps too: the warm-up's are not served ones

    def step_done(self, timing: StepTiming, step_s: float, control_s: float, updates: int = 0,
                  generated: int = 0) -> None:
        """One engine step's wall time, its timing parts, its control-path broadcasts and its tokens (`updates`: how
        many updates it returned; `generated`: how many of them carry a token)."""
        self.step.observe(step_s)
        self.control.observe(control_s)
        if updates:  # (as vLLM's, which counts only a step that returned outputs: not a prompt's chunk alone)
            self.iteration_tokens.observe(timing.tokens)
            self.generated_tokens += generated
            self.prompt_tokens += timing.tokens - generated
        if timing.prefill:
            self.prefill.observe(timing.prefill)
        if timing.decode_batch:
            for part in HOST_PARTS:
                self.host.labels(part).observe(getattr(timing, part))
            self.host.labels("control").observe(control_s)
            self.sample.observe(timing.sample)
            if timing.gpu is not None:
                self.gpu.observe(timing.gpu)

    def _totals(self) -> tuple[int, int, int]:
        sched = self.core.scheduler
        return sched.prefix_queried_tokens, sched.prefix_hit_tokens, sched.num_preemptions

    def exposition(self) -> bytes:
        sched = self.core.scheduler  # read from another thread: a scrape may see a step half applied, no more
        # (one scrape at a time: each front end's pipe has a reader thread of its own (--api-server-count), and two
        # scrapes at once each added what the totals grew by since the last export)
        with self._scrape_lock:
            self.running.set(len(sched.running))
            self.waiting.set(self.num_waiting())
            self.kv_usage.set(sched.kv_usage)
            totals = self._totals()
            for counter, total, counted in zip((self.prefix_queries, self.prefix_hits, self.preemptions), totals,
                                               self._counted, strict=True):
                counter.inc(total - counted)
            self._counted = totals
            return generate_latest(self.registry) + generate_latest(self.core.runner.stats.registry)

    def num_waiting(self) -> int:
        """The sequences waiting: the scheduler's queue, and those whose grammar is compiling (as vLLM counts them)."""
        return len(self.core.scheduler.waiting) + self.waiting_elsewhere()

    def prefix_hit_rate(self) -> float:
        """Of the prompt tokens looked up in the prefix cache since serving began, the fraction found (0 if none)."""
        queried, hits, _ = (now - then for now, then in zip(self._totals(), self._served_from, strict=True))
        return hits / queried if queried else 0.0


class StatsLog:
    """vLLM's periodic stats line (its LoggingStatLogger), every VLLM_LOG_STATS_INTERVAL seconds (else 10 s, as
    vLLM's): the prompt and generation throughput since the last line, the sequences running and waiting, the KV
    cache's use and the prefix cache's hit rate (since serving began; vLLM's, over its last 1000 requests). While
    idle (no tokens since the last line nor in the one before) it is logged at debug level, as vLLM's, so that an
    idle server's log stays quiet."""

    def __init__(self, metrics: EngineMetrics, now: float | None = None) -> None:
        """now: time.monotonic()'s reading when serving began (default: now)."""
        self.metrics = metrics
        self.interval_s = stats_interval_s()
        self._last = time.monotonic() if now is None else now
        self._tokens = (metrics.prompt_tokens, metrics.generated_tokens)
        self._was_busy = False

    def maybe_log(self, now: float | None = None) -> None:
        """Log the line where an interval has passed since the last one (now: time.monotonic()'s reading)."""
        now = time.monotonic() if now is None else now
        if now - self._last >= self.interval_s:
            self._log(now)

    def _log(self, now: float) -> None:
        m, sched = self.metrics, self.metrics.core.scheduler  # (read from another thread, as a scrape reads them)
        tokens = (m.prompt_tokens, m.generated_tokens)
        prompt_tps, generation_tps = ((t - before) / (now - self._last)
                                      for t, before in zip(tokens, self._tokens, strict=True))
        busy = bool(prompt_tps or generation_tps)
        logger.log(logging.INFO if busy or self._was_busy else logging.DEBUG,
                   "Engine %s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                   "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                   ENGINE_INDEX.zfill(3), prompt_tps, generation_tps, len(sched.running), m.num_waiting(),
                   sched.kv_usage * 100, m.prefix_hit_rate() * 100)
        self._last, self._tokens, self._was_busy = now, tokens, busy


def check_multiprocess_mode(path: str) -> None:
    """Raise unless the metrics this process makes now keep their values in `path`'s files (prometheus-client's
    multiprocess mode): it picks where values live as prometheus_client is imported, from PROMETHEUS_MULTIPROC_DIR,
    and opens the files where that names as the first metric is made; the variable must name `path` before both."""
    if os.environ.get(MULTIPROC_DIR_ENV) != path:
        raise RuntimeError(f"{MULTIPROC_DIR_ENV} must be {path!r} in this process (it is "
                           f"{os.environ.get(MULTIPROC_DIR_ENV)!r}) for several front ends to share their metrics")
    if values.ValueClass is values.MutexValue:
        raise RuntimeError(f"prometheus_client was imported before {MULTIPROC_DIR_ENV} was set in this process, so its "
                           "metrics are not shared between front ends: set the variable before anything imports it")


class ServerMetrics:
    def __init__(self, model_name: str = DEFAULT_MODEL_NAME, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 multiprocess_dir: str | None = None) -> None:
        """multiprocess_dir: where several front ends (--api-server-count) each keep their metrics' values
        (prometheus-client's multiprocess mode: PROMETHEUS_MULTIPROC_DIR must name it before prometheus_client is
        imported, check_multiprocess_mode); the exposition then reports them all, summed. None: this process's."""
        if multiprocess_dir is not None:
            check_multiprocess_mode(multiprocess_dir)
        self.multiprocess_dir = multiprocess_dir
        self.registry = r = CollectorRegistry()
        vllm = vllm_metrics(model_name, r)
        self.ttft = vllm(Histogram, "vllm:time_to_first_token_seconds", "Arrival to first token",
                         buckets=TTFT_BUCKETS)
        self.queue = vllm(Histogram, "vllm:request_queue_time_seconds", "A sample's wait in the engine's queue, from "
                          "its arrival there to its first admission", buckets=REQUEST_BUCKETS)
        self.tpot = vllm(Histogram, "vllm:request_time_per_output_token_seconds", "Mean time between a request's "
                         "tokens", buckets=TOKEN_GAP_BUCKETS)
        # (vLLM exports each gap too, beside the mean: the ITL that its dashboards plot)
        self.itl = vllm(Histogram, "vllm:inter_token_latency_seconds", "Time between a sample's token and its "
                        "previous one", buckets=TOKEN_GAP_BUCKETS)
        self.requests = Counter("vllm:request_success", "Requests finished, by finish reason",
                                (*VLLM_LABELS, "finished_reason"), registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(model_name, ENGINE_INDEX, reason)
        self.refused = Counter("tpgraph_requests_refused", "Requests the engine refused as it came to add them (a "
                               "bad schema, ...): answered 400, not counted as finished", registry=r)
        self.tokens = vllm(Counter, "vllm:generation_tokens", "Tokens generated")
        self.prompt_tokens = vllm(Counter, "vllm:prompt_tokens", "Prompt tokens computed (each sample's, with its "
                                  "first token)")
        self.e2e = vllm(Histogram, "vllm:e2e_request_latency_seconds", "Arrival to the request's end",
                        buckets=REQUEST_BUCKETS)
        # a finished sample's phases, as vLLM's (stats.py): observed for one that had a token, as vLLM observes them
        # only for a request that generated one
        self.prefill_time = vllm(Histogram, "vllm:request_prefill_time_seconds", "A sample's first admission to its "
                                 "first token (a preemption between them included)", buckets=REQUEST_BUCKETS)
        self.decode_time = vllm(Histogram, "vllm:request_decode_time_seconds", "A sample's first token to its last",
                                buckets=REQUEST_BUCKETS)
        self.inference_time = vllm(Histogram, "vllm:request_inference_time_seconds", "A sample's first admission to "
                                   "its last token (prefill and decode)", buckets=REQUEST_BUCKETS)
        # (vLLM's per finished request, which its dashboard draws as prompt and generation length heatmaps)
        self.prompt_lengths = vllm(Histogram, "vllm:request_prompt_tokens", "A finished sample's prompt tokens",
                                   buckets=token_buckets(max_model_len))
        self.generation_lengths = vllm(Histogram, "vllm:request_generation_tokens", "A finished sample's generated "
                                       "tokens", buckets=token_buckets(max_model_len))
        # (vLLM's per request's parameters: max_tokens per finished sample; n, and the most tokens any of its samples
        # generated, once all of a request's samples are over)
        self.max_tokens = vllm(Histogram, "vllm:request_params_max_tokens", "A finished sample's max_tokens (where the "
                               "request set none, the room its prompt left in the context)",
                               buckets=token_buckets(max_model_len))
        self.n = vllm(Histogram, "vllm:request_params_n", "A finished request's n", buckets=N_BUCKETS)
        self.max_generation_lengths = vllm(Histogram, "vllm:request_max_num_generation_tokens", "The most tokens any "
                                           "of a finished request's samples generated",
                                           buckets=token_buckets(max_model_len))
        self.model_name, self.max_model_len = model_name, max_model_len
        # each request's arrival, prompt length, samples asked (n) and max_tokens, and its samples by index: (tokens,
        # the first's time, the last's time), their prefill times (the engine's, with their first tokens), and which
        # have ended
        self._arrival: dict[str, float] = {}
        self._prompt_len: dict[str, int] = {}
        self._asked: dict[str, int] = {}
        self._max_tokens: dict[str, int] = {}
        self._samples: dict[str, dict[int, tuple[int, float, float]]] = {}
        self._prefill_s: dict[str, dict[int, float]] = {}
        self._ended: dict[str, set[int]] = {}
        # (multiprocess mode: the tokens generated not yet written to the files, and when they are due. A write costs
        # ~0.6 us more than an increment in the process, and one came with every streamed token: ~0.9 us of a token's
        # 3.5; written every TOKENS_SENT_EVERY_S, at each request's end and before an exposition)
        self._unsent: int | None = None if multiprocess_dir is None else 0
        self._send_at = 0.0

    def arrived(self, request_id: str, prompt_tokens: int = 0, n: int = 1, max_tokens: int | None = None) -> None:
        """A request of n samples taken, its prompt `prompt_tokens` long, each sample to generate at most max_tokens
        (None: up to the context's end). As vLLM's, whose engine runs each of n samples as a request of its own, the
        latencies and finished counts are each sample's; the prompt is counted with each sample's first token (each
        computes it, unless the prefix cache holds it), so that a request refused or aborted before any step computed
        its prompt counts none."""
        self._arrival[request_id] = time.perf_counter()
        self._prompt_len[request_id] = prompt_tokens
        self._asked[request_id] = n
        # (vLLM's server fills in a missing max_tokens with the room the prompt leaves, and records that)
        self._max_tokens[request_id] = max_tokens if max_tokens is not None else self.max_model_len - prompt_tokens

    def observe(self, update: StepUpdate, now: float | None = None) -> None:
        """An update, delivered at `now` (perf_counter; default: now)."""
        now = time.perf_counter() if now is None else now
        rid = update.request_id
        if update.queue_s is not None:  # (a sample's first update, with a token or ending it without one)
            self.queue.observe(update.queue_s)
        if update.prefill_s is not None:
            self._prefill_s.setdefault(rid, {})[update.sample_index] = update.prefill_s
        if update.token_id is not None:
            if self._unsent is None:
                self.tokens.inc()
            else:
                self._unsent += 1
                if now >= self._send_at:
                    self._send_tokens(now)
            samples = self._samples.setdefault(rid, {})
            count, first, last = samples.get(update.sample_index, (0, now, now))
            samples[update.sample_index] = (count + 1, first, now)
            if not count:  # this sample's first token: its prompt is computed
                self.prompt_tokens.inc(self._prompt_len.get(rid, 0))
                if rid in self._arrival:
                    self.ttft.observe(now - self._arrival[rid])
            else:  # (a later token: the gap since this sample's previous one, as vLLM's decode outputs are timed)
                self.itl.observe(now - last)
        if update.finish_reason is not None:
            self._sample_ended(rid, update.sample_index, update.finish_reason, now)

    def _sample_ended(self, request_id: str, index: int, reason: str, now: float) -> None:
        ended = self._ended.setdefault(request_id, set())
        if index in ended:
            return
        ended.add(index)
        self.requests.labels(self.model_name, ENGINE_INDEX, reason).inc()
        # (from its first token to its last, as vLLM's: not to its end, which may come much later (an abort))
        count, first, last = self._samples.get(request_id, {}).get(index, (0, 0.0, 0.0))
        if count > 1:
            self.tpot.observe((last - first) / (count - 1))
        prefill_s = self._prefill_s.get(request_id, {}).get(index)
        if count and prefill_s is not None:
            self._phases_ended(prefill_s, last - first)
        if request_id in self._arrival:
            self.e2e.observe(now - self._arrival[request_id])
        self.prompt_lengths.observe(self._prompt_len.get(request_id, 0))
        self.generation_lengths.observe(count)
        if request_id in self._max_tokens:
            self.max_tokens.observe(self._max_tokens[request_id])

    def _phases_ended(self, prefill_s: float, decode_s: float) -> None:
        """A sample's phases, as vLLM's: prefill (the engine's: its first admission to its first token read back),
        decode (its first token to its last, delivered: the span TPOT divides) and inference, the two together (vLLM's
        first admission to last token)."""
        self.prefill_time.observe(prefill_s)
        self.decode_time.observe(decode_s)
        self.inference_time.observe(prefill_s + decode_s)

    def finished(self, request_id: str, reason: str, now: float | None = None) -> None:
        """The whole request is over (at `now`, perf_counter; default: now): its samples still open end with
        `reason` (an abort, an error). One the engine refused is counted as refused alone: vLLM refuses such a
        request before its engine, so its finished requests and latencies never hold one."""
        if reason == REFUSED:
            self.refused.inc()
        else:
            now = time.perf_counter() if now is None else now
            for index in range(self._asked.get(request_id, 1)):
                self._sample_ended(request_id, index, reason, now)
            if request_id in self._asked:  # (once: a request is forgotten below)
                self._request_ended(request_id)
        self.forget(request_id)
        if self._unsent:  # (its tokens counted for every front end by its end, however recent the last write)
            self._send_tokens(time.perf_counter() if now is None else now)

    def _send_tokens(self, now: float) -> None:
        """Write the tokens counted since the last write to the files (multiprocess mode), the next due in
        TOKENS_SENT_EVERY_S."""
        self.tokens.inc(self._unsent)
        self._unsent, self._send_at = 0, now + TOKENS_SENT_EVERY_S

    def forget(self, request_id: str) -> None:
        """Drop what is kept of a request, counting nothing: one that never reached the engine (its send found the
        engine gone) never started, so it never finished either."""
        for kept in (self._arrival, self._prompt_len, self._asked, self._max_tokens, self._samples, self._prefill_s,
                     self._ended):
            kept.pop(request_id, None)

    def _request_ended(self, request_id: str) -> None:
        """All of a request's samples are over: its n, and the most tokens one of them generated (vLLM's parallel
        sampling records both when its last child request finishes)."""
        self.n.observe(self._asked[request_id])
        self.max_generation_lengths.observe(max((count for count, _, _ in self._samples.get(request_id, {}).values()),
                                                default=0))

    def exposition(self) -> bytes:
        """The metrics' exposition text: this process's, or with a multiprocess_dir every front end's, summed."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        if self._unsent:
            self._send_tokens(time.perf_counter())
        # (a registry of its own: the collector reads every process's values from the files, this one's included)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, self.multiprocess_dir)
        return generate_latest(registry)
