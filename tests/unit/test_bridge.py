"""The pipe between the HTTP front end and the engine: requests reach the service, updates come back batched to the
right sinks on the event loop, metrics answer by ticket, and a closed pipe fails every open request."""

import asyncio
import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

import pytest

from tpgraph.engine.limits import RequestLimits
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.updates import StepUpdate
from tpgraph.server.bridge import UNAVAILABLE, EngineBridge, EngineClient

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, cache_tokens=256)


class FakeService:
    """Answers each request with three tokens at once, from the bridge's reader thread."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.precompiled: list = []

    def compiles(self, params) -> bool:
        return False

    def precompile(self, params) -> None:
        self.precompiled.append(params)

    def enqueue(self, request_id, prompt_ids, params, sink) -> None:
        for i, token in enumerate(prompt_ids[:3]):
            sink(StepUpdate(request_id, 0, token, str(token), "length" if i == 2 else None))

    def enqueue_abort(self, request_id) -> None:
        self.aborted.append(request_id)


class Collected:
    """Each request's updates as the client delivers them (on the loop: checked), and an event set by its last."""

    def __init__(self, *request_ids: str) -> None:
        self.got: dict[str, list[StepUpdate]] = {rid: [] for rid in request_ids}
        self.done = {rid: asyncio.Event() for rid in request_ids}

    def sink(self, rid: str):
        def sink(u: StepUpdate) -> None:
            assert threading.current_thread() is threading.main_thread()  # delivered on the loop
            self.got[rid].append(u)
            if u.finish_reason:
                self.done[rid].set()
        return sink


def test_requests_updates_metrics_and_a_lost_engine():
    engine_end, frontend_end = mp.Pipe(duplex=True)
    service, closed = FakeService(), threading.Event()
    bridge = EngineBridge(service, [engine_end], lambda: b"engine_metric 1\n", on_closed=closed.set)
    bridge.start()
    lost = threading.Event()
    client = EngineClient(frontend_end, LIMITS, on_lost=lost.set)

    async def main() -> None:
        client.attach(asyncio.get_running_loop())
        collected = Collected("a", "b")
        got, done, sink_for = collected.got, collected.done, collected.sink

        client.submit("a", [5, 6, 7, 8], SamplingParams(), sink_for("a"))
        client.submit("b", [9, 10, 11], SamplingParams(), sink_for("b"))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in done.values())), 10)
        assert [u.token_id for u in got["a"]] == [5, 6, 7] and [u.token_id for u in got["b"]] == [9, 10, 11]
        assert len(service.precompiled) == 2  # (each add's grammar, if any, compiled on the reader, not in a step)
        assert await client.engine_metrics() == b"engine_metric 1\n"
        client.abort("a")
        await asyncio.sleep(0.2)
        assert service.aborted == ["a"]

        # the engine goes away: an open request hears an error, and the client says it is not alive
        errors = []
        client._sinks["c"] = errors.append
        bridge.close()
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, lost.wait, 10), 15)
        await asyncio.sleep(0)
        assert errors and errors[0].finish_reason == UNAVAILABLE and not client.alive

    asyncio.run(main())


class SlowGrammars(FakeService):
    """A service whose grammars take until `release` is set to compile."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.compiling = threading.Event(), threading.Event()

    def compiles(self, params) -> bool:
        return params.structured is not None

    def precompile(self, params) -> None:
        if self.compiles(params):
            self.compiling.set()
            assert self.release.wait(10)
        super().precompile(params)


def test_a_grammars_compile_holds_up_no_other_request_and_one_aborted_meanwhile_never_runs():
    """The bridge's reader compiled each new grammar before it read the pipe on: every add and abort behind it
    waited for the compile (at a 128k vocabulary, about 0.1 s for a 40-property schema, more for larger ones). A
    grammar not compiled yet is compiled on a thread of its own, its request queued once it is; one aborted meanwhile
    is never queued (its abort reached the service first, and the add after it would have run for nobody)."""
    from tpgraph.engine.structured import StructuredOutput

    engine_end, frontend_end = mp.Pipe(duplex=True)
    service = SlowGrammars()
    bridge = EngineBridge(service, [engine_end], lambda: b"", on_closed=lambda: None)
    bridge.start()
    client = EngineClient(frontend_end, LIMITS)
    constrained = SamplingParams(structured=StructuredOutput("regex", "[0-9]+"))

    async def main() -> None:
        client.attach(asyncio.get_running_loop())
        collected = Collected("slow", "fast", "gone")
        got, done, sink_for = collected.got, collected.done, collected.sink

        client.submit("gone", [1, 2, 3], constrained, sink_for("gone"))
        client.submit("slow", [4, 5, 6], constrained, sink_for("slow"))
        assert await asyncio.get_running_loop().run_in_executor(None, service.compiling.wait, 10)
        client.submit("fast", [7, 8, 9], SamplingParams(), sink_for("fast"))
        await asyncio.wait_for(done["fast"].wait(), 5)  # (while the grammars compile)
        assert not got["slow"] and not got["gone"]
        client._sinks.pop("gone")
        frontend_end.send(("abort", "gone"))  # (the client's abort, its sink kept to see what would come)
        client._sinks["gone"] = sink_for("gone")
        await asyncio.sleep(0.2)
        service.release.set()
        await asyncio.wait_for(done["slow"].wait(), 5)
        await asyncio.sleep(0.2)
        assert [u.token_id for u in got["slow"]] == [4, 5, 6] and got["gone"] == []
        assert service.aborted == [] and len(service.precompiled) == 3
        bridge.close()  # (while the loop runs, which hears the pipe close)
        await asyncio.sleep(0.2)

    try:
        asyncio.run(main())
    finally:
        service.release.set()


def test_a_large_grammar_compiling_holds_up_no_other_grammars_request():
    """Grammars compiled on one thread: one large grammar (minutes, for some deep schemas) held up every constrained
    request behind it. They compile on a small pool, as vLLM's (a thread pool of at most 8, half the cores), so a
    small grammar's request runs while the large one compiles, which then runs too."""
    from tpgraph.engine.structured import StructuredOutput

    class OneSlowGrammar(SlowGrammars):
        """Each grammar is new (compiled on a compile thread); the one of spec "slow" compiles until released."""

        def precompile(self, params) -> None:
            if params.structured.spec == "slow":
                super().precompile(params)
            else:
                FakeService.precompile(self, params)

    engine_end, frontend_end = mp.Pipe(duplex=True)
    service = OneSlowGrammar()
    bridge = EngineBridge(service, [engine_end], lambda: b"", on_closed=lambda: None, compile_threads=2)
    bridge.start()
    client = EngineClient(frontend_end, LIMITS)

    async def main() -> None:
        client.attach(asyncio.get_running_loop())
        collected = Collected("slow", "fast")
        got, done, sink_for = collected.got, collected.done, collected.sink

        client.submit("slow", [4, 5, 6], SamplingParams(structured=StructuredOutput("regex", "slow")),
                      sink_for("slow"))
        assert await asyncio.get_running_loop().run_in_executor(None, service.compiling.wait, 10)
        client.submit("fast", [7, 8, 9], SamplingParams(structured=StructuredOutput("regex", "fast")),
                      sink_for("fast"))
        await asyncio.wait_for(done["fast"].wait(), 5)  # (while the large grammar compiles)
        assert not got["slow"]
        service.release.set()
        await asyncio.wait_for(done["slow"].wait(), 5)
        assert [u.token_id for u in got["slow"]] == [4, 5, 6] and [u.token_id for u in got["fast"]] == [7, 8, 9]
        bridge.close()
        await asyncio.sleep(0.2)

    try:
        asyncio.run(main())
    finally:
        service.release.set()


def test_grammars_queued_at_close_are_neither_compiled_nor_queued_for_the_stopped_service():
    """close() queued its stop behind the grammars waiting to compile: the compile thread went on compiling each
    (telling the other ranks to compile it too) and queued its request for a service that had stopped. What is
    waiting is dropped on close, and the compile under way queues nothing."""
    from tpgraph.engine.structured import StructuredOutput

    class Recording(SlowGrammars):
        def __init__(self) -> None:
            super().__init__()
            self.enqueued: list[str] = []

        def enqueue(self, request_id, prompt_ids, params, sink) -> None:
            self.enqueued.append(request_id)

    engine_end, frontend_end = mp.Pipe(duplex=True)
    service = Recording()
    # (one compile thread: one grammar under way, two waiting, whatever the machine's cores)
    bridge = EngineBridge(service, [engine_end], lambda: b"", on_closed=lambda: None, compile_threads=1)
    bridge.start()
    constrained = SamplingParams(structured=StructuredOutput("regex", "[0-9]+"))
    try:
        for rid in ("under way", "waiting", "also waiting"):
            frontend_end.send(("add", rid, [1, 2, 3], constrained))
        assert service.compiling.wait(10)
        deadline = time.monotonic() + 10
        while len(bridge._compiling) < 3 and time.monotonic() < deadline:  # (all three read off the pipe)
            time.sleep(0.01)
        assert len(bridge._compiling) == 3
        bridge.close()
    finally:
        service.release.set()
    bridge._compilers[0].join(10)
    assert not bridge._compilers[0].is_alive()
    assert len(service.precompiled) == 1 and service.enqueued == []
    frontend_end.close()


def test_requests_whose_grammar_compiles_are_counted_waiting():
    """A request whose grammar the bridge compiles is not in the scheduler's queue yet: vllm:num_requests_waiting (and
    the stats line's Waiting) left it out, where vLLM's scheduler queues it, waiting for its grammar. An autoscaler
    read an idle server while requests with new schemas piled up. Each of its n samples waits (vLLM runs each as a
    request); one aborted meanwhile no longer does."""
    from prometheus_client.parser import text_string_to_metric_families

    from tpgraph.engine.structured import StructuredOutput
    from tpgraph.graphs.stats import GraphStats
    from tpgraph.server.metrics import EngineMetrics

    def waiting(metrics: EngineMetrics) -> float:
        (family,) = [f for f in text_string_to_metric_families(metrics.exposition().decode())
                     if f.name == "vllm:num_requests_waiting"]
        return family.samples[0].value

    engine_end, frontend_end = mp.Pipe(duplex=True)
    service = SlowGrammars()
    bridge = EngineBridge(service, [engine_end], lambda: b"", on_closed=lambda: None)
    scheduler = SimpleNamespace(prefix_queried_tokens=0, prefix_hit_tokens=0, running=[], waiting=["queued"],
                                kv_usage=0.0, num_preemptions=0)
    metrics = EngineMetrics(SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(stats=GraphStats())))
    metrics.waiting_elsewhere = bridge.compiling  # (as serve.py wires them)
    bridge.start()
    try:
        assert waiting(metrics) == 1
        frontend_end.send(("add", "pair", [1, 2, 3], SamplingParams(n=2, structured=StructuredOutput("regex", "a"))))
        frontend_end.send(("add", "one", [1, 2, 3], SamplingParams(structured=StructuredOutput("regex", "b"))))
        assert service.compiling.wait(10)
        deadline = time.monotonic() + 10
        while bridge.compiling() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting(metrics) == 1 + 3 and metrics.num_waiting() == 4
        frontend_end.send(("abort", "pair"))
        while bridge.compiling() > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting(metrics) == 1 + 1
    finally:
        service.release.set()
    deadline = time.monotonic() + 10
    while bridge.compiling() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bridge.compiling() == 0
    bridge.close()
    frontend_end.close()


def test_the_engine_side_hears_the_front_end_go():
    engine_end, frontend_end = mp.Pipe(duplex=True)
    closed = threading.Event()
    EngineBridge(FakeService(), [engine_end], lambda: b"", on_closed=closed.set).start()
    frontend_end.close()
    assert closed.wait(10)


def test_the_front_end_says_when_it_listens():
    engine_end, frontend_end = mp.Pipe(duplex=True)
    ready = threading.Event()
    bridge = EngineBridge(FakeService(), [engine_end], lambda: b"", on_closed=lambda: None, on_ready=ready.set)
    bridge.start()
    EngineClient(frontend_end, LIMITS).listening()
    assert ready.wait(10)
    bridge.close()


def test_limits_refuse_what_the_engine_would():
    from tpgraph.errors import RequestError

    for prompt, needle in (([], "empty"), ([100], "integers in [0, 100)"), (list(range(64)), "max_model_len")):
        with pytest.raises(RequestError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            LIMITS.check(prompt, SamplingParams())
    LIMITS.check([1, 2, 3], SamplingParams())
    LIMITS.check([1, 2, 3], SamplingParams(max_tokens=61))  # exactly fills max_model_len
    with pytest.raises(RequestError, match=r"asks for 65: 3 in the prompt and 62 to generate; ask for at most 61 "
                                           r"new tokens, or for none \(null\) to generate up to max_model_len"):
        LIMITS.check([1, 2, 3], SamplingParams(max_tokens=62))


@pytest.mark.parametrize("stop", ["closing", "SIGTERM", "SIGINT"])
def test_the_front_end_stops_at_once_and_cleanly(stop):
    """The engine says ("closing",), or the front end gets SIGTERM or Ctrl-C: its HTTP server stops and its process
    exits 0 (rank 0 reads that as a stop it was asked for, not a failure), within the 2 s rank 0 waits before it
    kills it. Its exit timer, a backstop for a stop that hangs, was not a daemon: every stop the engine announced
    waited it out (3 s) and ended with exit code 1, after rank 0 had already killed the process. uvicorn raises
    SIGTERM again once it has stopped, which killed the process (exit code -15, a failure to rank 0)."""
    import os
    import signal
    import time

    pytest.importorskip("uvicorn")
    from tpgtest.server_stubs import builtin_codec

    from tpgraph.server.frontend import FrontendSpec, start_frontends
    from tpgraph.server.listeners import bind_sockets

    [(proc, conn)] = start_frontends(FrontendSpec("127.0.0.1", 0, "m", 64, LIMITS, builtin_codec()),
                                     [bind_sockets("127.0.0.1", 0)], None)
    try:
        assert conn.poll(120) and conn.recv() == ("ready",)
        if stop == "closing":
            conn.send([("closing",)])
        else:
            os.kill(proc.pid, getattr(signal, stop))
        start = time.monotonic()
        proc.join(10)
        took = time.monotonic() - start
        assert proc.exitcode == 0 and took < 2.0, (proc.exitcode, took)
    finally:
        if proc.is_alive():
            proc.kill()
        conn.close()


class BrokenCore:
    """An engine core whose every step raises (a device error, a bug): the service loop fails on its first step."""

    grammars = None

    def __init__(self) -> None:
        import torch

        self.runner = SimpleNamespace(device=torch.device("cpu"))
        self.requests: dict = {}
        self.has_work = False

    def check_request(self, prompt_ids, params) -> None:
        pass

    def prepare_request(self, request_id, prompt_ids, params):
        from tpgraph.engine.core import PreparedRequest

        return PreparedRequest(request_id, list(prompt_ids), params, [None])

    def add_prepared(self, request) -> None:
        self.has_work = True

    def step(self, while_gpu_runs=None):
        raise RuntimeError("an illegal memory access")


def test_an_engine_loop_that_fails_is_told_to_the_front_end_at_once_as_a_failure():
    """The loop failing answered its open requests, but the front end heard nothing until rank 0's poll (0.5 s later)
    stopped the server with the ("closing",) of a planned stop: meanwhile /health said 200 and new requests queued
    for a loop that was gone, and then every one was told "the engine is shutting down", the request in flight a 503
    of that too where the two came together (the failure's reason lost), and the front end exited 0 as stopped. Now
    the failure reaches the front end as it happens: /health's 503 and new requests' refusal name it, the request it
    failed is a 500 naming it, and a close after it is still a failure."""
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService
    from tpgraph.server import app as server_app
    from tpgraph.server.bridge import EngineUnavailable
    from tpgraph.server.frontend import exit_code
    from tpgraph.server.metrics import ServerMetrics

    service = EngineService(BrokenCore(), ControlPlane(SimpleNamespace(rank=0, world_size=1)), heartbeat_s=0.05)
    engine_end, frontend_end = mp.Pipe(duplex=True)
    bridge = EngineBridge(service, [engine_end], lambda: b"", on_closed=lambda: None)
    service.on_failed = lambda exc: bridge.failed(f"{type(exc).__name__}: {exc}")
    lost = threading.Event()
    client = EngineClient(frontend_end, LIMITS, on_lost=lost.set)
    api = server_app.Api(client, ServerMetrics(), "m")

    class Here:  # (a client that stays)
        async def is_disconnected(self) -> bool:
            return False

    async def main() -> None:
        client.attach(asyncio.get_running_loop())
        with pytest.raises(server_app.ApiError) as failed:
            async for _ in api.run(Here(), [[1, 2]], SamplingParams(max_tokens=4)):
                pass
        assert failed.value.status == 500 and "RuntimeError: an illegal memory access" in failed.value.message
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, lost.wait, 5), 10)
        await asyncio.sleep(0)
        assert not client.alive and "an illegal memory access" in client.error  # (/health: 503)
        with pytest.raises(EngineUnavailable, match="its loop failed: RuntimeError: an illegal memory access"):
            client.submit("late", [1], SamplingParams(), lambda u: None)
        bridge.close()  # (rank 0's stop, after the failure)
        await asyncio.sleep(0.3)
        assert not client.closing and exit_code(client) == 1

    bridge.start()
    service.start()
    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        service.shutdown(timeout_s=1.0)


class OneStepCore(BrokenCore):
    """An engine core whose requests each take one step, which returns no updates."""

    def step(self, while_gpu_runs=None):
        if while_gpu_runs is not None:
            while_gpu_runs()
        self.has_work = False
        return []


def test_the_control_path_time_leaves_out_the_idle_wait_for_a_request():
    """tpgraph_control_path_seconds (and the decode steps' "control" part) is the broadcast of a step's changes to
    the other ranks. The first step after the engine sat idle counted the wait for its request too (up to
    --heartbeat-s: a burst's first step scraped as a control path of hundreds of ms). A request that arrives 0.3 s
    into an idle wait is stepped with a control path of a few ms."""
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService

    service = EngineService(OneStepCore(), ControlPlane(SimpleNamespace(rank=0, world_size=1)), heartbeat_s=2.0)
    timer = threading.Timer(0.3, service.enqueue, ("r", [1, 2], SamplingParams(max_tokens=1), lambda u: None))
    timer.start()
    try:
        assert service.turn()  # (waits for the request, then steps it)
    finally:
        timer.cancel()
    assert service.times.control_s < 0.1, service.times


def test_scrapes_that_come_together_share_one_ask_of_the_engine():
    """/metrics asks no key, and each scrape sent the engine's process a ticket whose exposition it wrote beside its
    steps: a client scraping in a loop, or many at once, loaded the engine as much as it liked. Scrapes that come
    while one is under way share its answer; a later one asks again."""

    class Pipe:
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, message) -> None:
            self.sent.append(message)

    pipe = Pipe()
    client = EngineClient(pipe, LIMITS)

    async def main() -> None:
        scrapes = [asyncio.ensure_future(client.engine_metrics()) for _ in range(50)]
        await asyncio.sleep(0.05)
        scrapes[0].cancel()  # (one scraper goes away: the others still get the answer)
        assert pipe.sent == [("metrics", 0)]
        client._dispatch([("metrics", 0, b"engine_metric 1\n")])
        got = await asyncio.gather(*scrapes[1:])
        assert got == [b"engine_metric 1\n"] * 49
        later = asyncio.ensure_future(client.engine_metrics())
        await asyncio.sleep(0.05)
        assert pipe.sent == [("metrics", 0), ("metrics", 1)]
        client._dispatch([("metrics", 1, b"engine_metric 2\n")])
        assert await later == b"engine_metric 2\n"

    asyncio.run(asyncio.wait_for(main(), 10))


def test_prompts_never_sent_to_an_engine_whose_pipe_broke_are_not_counted_as_finished(caplog):
    """A completion of five prompts (n=2) whose pipe to the engine breaks as its third prompt is sent: the two sent
    end with "error" (4 samples) and are named aborted in the request log, but the three never sent were counted
    too, as requests finished with "error", and logged aborted, though the engine never had them. The client gets the
    503 of an engine that is gone."""
    import logging

    from tpgtest.server_stubs import builtin_codec, post_all

    from tpgraph.server import app as server_app
    from tpgraph.server.metrics import ServerMetrics
    from tpgraph.server.options import HttpOptions

    class BreakingPipe:  # (the engine's process died: the third add finds the pipe broken)
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, message) -> None:
            if message[0] == "add" and sum(m[0] == "add" for m in self.sent) == 2:
                raise BrokenPipeError(32, "Broken pipe")
            self.sent.append(message)

    pipe, metrics = BreakingPipe(), ServerMetrics("m", 64)
    client = EngineClient(pipe, LIMITS)
    app = server_app.create_app(client, builtin_codec("m"), metrics, "m", 64, http=HttpOptions(log_requests=True))
    body = {"model": "m", "prompt": [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], "n": 2, "max_tokens": 4}
    with caplog.at_level(logging.INFO, logger="tpgraph.server.app"):
        [reply] = post_all(app, [("/v1/completions", body)])
    assert reply.status_code == 503 and "Broken pipe" in reply.json()["error"]["message"], reply.text
    assert [m[0] for m in pipe.sent] == ["add", "add"] and not client.alive
    ended = {reason: metrics.registry.get_sample_value("vllm:request_success_total", {
        "model_name": "m", "engine": "0", "finished_reason": reason}) for reason in ("error", "abort", "stop")}
    assert ended == {"error": 4, "abort": 0, "stop": 0}
    assert not (metrics._arrival or metrics._asked or client._sinks)  # (nothing kept of any of the five)
    [aborted] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Aborted")]
    names = aborted.removeprefix("Aborted request(s) ").removesuffix(".").split(",")
    assert [name.rsplit("-", 1)[1] for name in names] == ["0", "1"], aborted  # (cmpl-<id>-<prompt>: the two sent)


def _received(conn, until) -> list:
    """Items from the engine's batches on `conn` until one satisfies `until` (10 s at most)."""
    items: list = []
    while not any(until(item) for item in items):
        assert conn.poll(10), f"nothing more came; got {items}"
        items += conn.recv()
    return items


def test_several_front_ends_each_hear_only_their_own_requests_and_metrics():
    """--api-server-count: one pipe per front end; a request's updates and a scrape's answer go back down the pipe
    they came by; "ready" is said once every front end listens; a close tells each; any one pipe closing is heard."""
    pipes = [mp.Pipe(duplex=True) for _ in range(3)]
    ready, closed = threading.Event(), threading.Event()
    bridge = EngineBridge(FakeService(), [engine for engine, _ in pipes], lambda: b"engine_metric 1\n",
                          on_closed=closed.set, on_ready=ready.set)
    bridge.start()
    fronts = [front for _, front in pipes]
    for i, front in enumerate(fronts):
        front.send(("add", f"req-{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], SamplingParams()))
    fronts[1].send(("metrics", 7))
    scrape_answer = ("metrics", 7, b"engine_metric 1\n")
    for i, front in enumerate(fronts):
        # (front end 1's answer is queued after its request's updates: the last thing it hears)
        items = _received(front, (lambda item: item == scrape_answer) if i == 1 else
                          (lambda u: isinstance(u, StepUpdate) and u.finish_reason is not None))
        updates = [u for u in items if isinstance(u, StepUpdate)]
        assert {u.request_id for u in updates} == {f"req-{i}"}  # (none of another front end's)
        assert [u.token_id for u in updates] == [10 * i + 1, 10 * i + 2, 10 * i + 3]
        assert [u for u in items if not isinstance(u, StepUpdate)] == ([scrape_answer] if i == 1 else [])
    fronts[0].send(("ready",))
    fronts[2].send(("ready",))
    assert not ready.wait(0.3)  # (front end 1 does not listen yet: nothing serves on its behalf)
    fronts[1].send(("ready",))
    assert ready.wait(10)
    assert not closed.is_set()
    fronts[2].close()  # (one front end gone: the engine side hears it)
    assert closed.wait(10)
    bridge.close()
    for front in fronts[:2]:
        assert _received(front, lambda item: item == ("closing",))[-1] == ("closing",)


def test_the_log_names_a_lone_front_end_as_the_server_does(caplog):
    """With one front end the bridge said "the HTTP front end 0 closed its pipe", naming an index no one gave; it says
    "the HTTP front end" (as serve.py does), and "HTTP front end N" where there are several."""
    import logging

    for count, said in ((1, "the HTTP front end closed its pipe"), (2, "HTTP front end 1 closed its pipe")):
        pipes = [mp.Pipe(duplex=True) for _ in range(count)]
        closed = threading.Event()
        bridge = EngineBridge(FakeService(), [engine for engine, _ in pipes], lambda: b"", on_closed=closed.set)
        with caplog.at_level(logging.INFO, logger="tpgraph.server.bridge"):
            bridge.start()
            pipes[-1][1].close()
            assert closed.wait(10)
            bridge.close()
        assert said in caplog.text and (count > 1 or "front end 0" not in caplog.text), caplog.text
        caplog.clear()
