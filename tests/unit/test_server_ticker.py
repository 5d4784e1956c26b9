"""Api.run's _Ticker: one repeating timer a request wakes its wait for updates to check for a gone client. It is
stopped however the request ends, its tick (a None) never reaches a caller, and a client that leaves is noticed on
time whether updates pause or keep coming."""

import asyncio

import pytest

from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.updates import REFUSED, StepUpdate
from tpgraph.server import app as server_app
from tpgraph.server.bridge import UNAVAILABLE, EngineUnavailable
from tpgraph.server.metrics import ServerMetrics

CHECK_S = 0.02


class Client:
    """An engine that sends its script's (token, finish reason) updates one a tick, or (flow) two updates every
    loop turn until aborted; gone: it is unavailable at submit."""

    error = None

    def __init__(self, script=(), flow: bool = False, gone: bool = False) -> None:
        self.script, self.flow, self.gone, self.aborted = list(script), flow, gone, []

    def check(self, prompt, params) -> None:
        pass

    def submit(self, rid, prompt, params, sink) -> None:
        if self.gone:
            raise EngineUnavailable("gone")
        loop = asyncio.get_running_loop()
        if self.flow:
            async def flow() -> None:
                while rid not in self.aborted:
                    sink(StepUpdate(rid, 0, 7, "x"))
                    sink(StepUpdate(rid, 0, 7, "x"))
                    await asyncio.sleep(0)
            loop.create_task(flow())
        for k, (token, finish) in enumerate(self.script):
            loop.call_soon(sink, StepUpdate(rid, k % params.n, token, "t", finish))

    def abort(self, rid) -> None:
        self.aborted.append(rid)

    def release(self, rid) -> None:
        pass


class Request:
    def __init__(self, gone_after_checks: int | None = None) -> None:
        self.gone_after, self.checks = gone_after_checks, 0

    async def is_disconnected(self) -> bool:
        self.checks += 1
        return self.gone_after is not None and self.checks > self.gone_after


async def read(client: Client, request: Request, n: int = 1, stop_after: int | None = None) -> tuple[list, str]:
    """The updates read, and how the read ended (an exception's name, or "end")."""
    got: list = []
    stream = server_app.Api(client, ServerMetrics(), "m").run(request, [[1, 2]], SamplingParams(max_tokens=9, n=n))
    try:
        async for _, update in stream:
            got.append(update)
            if len(got) == stop_after:
                await stream.aclose()
                break
    except (server_app.ApiError, EngineUnavailable, server_app.RequestError) as exc:
        return got, type(exc).__name__
    return got, "end"


CASES = {
    "finished": (Client([(7, None), (7, "length")]), {}, 2, "end"),
    "n=2": (Client([(7, None), (7, None), (7, "length"), (7, "length")]), {"n": 2}, 4, "end"),
    "refused": (Client([(None, REFUSED)]), {}, 0, "RequestError"),
    "error": (Client([(None, "error")]), {}, 0, "ApiError"),
    "engine gone": (Client([(None, UNAVAILABLE)]), {}, 0, "EngineUnavailable"),
    "gone at submit": (Client(gone=True), {}, 0, "EngineUnavailable"),
    "caller stopped": (Client([(7, None), (7, None), (7, "length")]), {"stop_after": 1}, 1, "end"),
}


@pytest.fixture
def tickers(monkeypatch) -> list:
    made: list = []

    class Recorded(server_app._Ticker):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(server_app, "DISCONNECT_CHECK_S", CHECK_S)
    monkeypatch.setattr(server_app, "_Ticker", Recorded)
    return made


def live_ticks() -> list:
    """The loop's armed timers that would tick a request's queue."""
    return [h for h in asyncio.get_running_loop()._scheduled
            if not h.cancelled() and getattr(h._callback, "__func__", None) is server_app._Ticker._tick]


@pytest.mark.parametrize("case", CASES)
def test_the_timer_stops_however_a_request_ends_and_no_tick_reaches_the_caller(case, tickers):
    client, kwargs, count, ended = CASES[case]

    async def main() -> None:
        got, how = await read(client, Request(), **kwargs)
        assert (len(got), how) == (count, ended)
        assert all(isinstance(u, StepUpdate) for u in got)
        assert all(t.handle.cancelled() for t in tickers) and not live_ticks()

    asyncio.run(asyncio.wait_for(main(), 5))
    assert len(tickers) == (case != "gone at submit")


@pytest.mark.parametrize("flow", [False, True], ids=["updates paused", "updates flowing"])
def test_a_gone_client_is_noticed_within_a_check_or_two_and_its_request_aborted(flow, tickers):
    """The first check, due CHECK_S after the start, finds the client gone, whether updates pause (a tick wakes the
    wait) or keep coming (a backlog never lets a tick in: the check is due by the clock). Counted in checks, not
    seconds: a loaded CI machine once took 0.54 s for the first check's CHECK_S; a check that never came would take
    the whole 5 s limit."""
    client, request = Client(flow=flow), Request(gone_after_checks=0)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        got, how = await read(client, request)
        assert how == "end" and all(isinstance(u, StepUpdate) for u in got) and (flow or not got)
        assert tickers[0].handle.cancelled() and client.aborted
        return loop.time() - start

    elapsed = asyncio.run(asyncio.wait_for(main(), 5))
    assert request.checks == 1 and CHECK_S <= elapsed < 2.5


def test_a_cancel_during_the_wait_is_delivered_and_stops_the_timer(tickers):
    client = Client()

    async def main() -> None:
        task = asyncio.create_task(read(client, Request()))
        while not tickers:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tickers[0].handle.cancelled() and client.aborted and not live_ticks()

    asyncio.run(asyncio.wait_for(main(), 5))
