"""The pipe between the HTTP front-end process and the engine on rank 0.

The front end (FastAPI, SSE formatting, tokenization) and the engine's step loop each need a core's worth of Python;
in one process they share one GIL, and at batch 64 the step loop waited milliseconds for it every step. So rank 0
starts the front end as its own process, and the two talk through one duplex pipe:

    front end -> engine: ("ready",) once, when its HTTP server accepts connections; ("add", request id, prompt ids,
                         params), ("abort", request id), ("metrics", ticket)
    engine -> front end: a list per send, of StepUpdates, ("metrics", ticket, exposition bytes) replies, ("failed",
                         reason) at once where the engine loop failed, and a last ("closing",)

The engine side batches whatever accumulated while the pipe was busy, so a decode step costs one send, not one per
stream. Either side seeing the pipe close knows the other is gone. With several front ends (--api-server-count), each
has a pipe of its own, and a request's updates go down the pipe it came in by.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from tpgraph.engine.limits import RequestLimits
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.structured import COMPILE_THREADS
from tpgraph.engine.updates import StepUpdate

if TYPE_CHECKING:  # (EngineBridge runs beside it, in rank 0's process; a front end's process never imports the engine)
    from tpgraph.engine.service import EngineService

logger = logging.getLogger(__name__)
Sink = Callable[[StepUpdate], None]
_STOP = object()
# the finish reason of the updates the client itself sends its open requests when the engine is gone (shut down or
# unreachable): not the engine's "error", which a failed step sends its requests
UNAVAILABLE = "unavailable"


class EngineUnavailable(RuntimeError):
    """The engine process is gone (the server answers 503)."""


class EngineBridge:
    """Engine side (rank 0's process): requests from the front ends' pipes go to the service's inbox; each request's
    updates go back down the pipe it came from (its sink is that pipe's queue), so no request id is looked up."""

    def __init__(self, service: EngineService, conns: Sequence[Connection], exposition: Callable[[], bytes],
                 on_closed: Callable[[], None], on_ready: Callable[[], None] | None = None,
                 compile_threads: int = COMPILE_THREADS) -> None:
        """conns: one pipe per front end (--api-server-count); on_closed: called when any of them closes (a front end
        gone: the server stops); on_ready: called (on a reader thread) once every front end has said its HTTP server
        accepts connections; compile_threads: how many grammars compile at once."""
        self.service, self.conns, self.exposition, self.on_closed = service, list(conns), exposition, on_closed
        self.on_ready = on_ready
        self._outs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.conns]
        self._readers = [threading.Thread(target=self._read, args=(i,), name=f"tpgraph-bridge-in-{i}", daemon=True)
                         for i in range(len(self.conns))]
        self._senders = [threading.Thread(target=self._send, args=(i,), name=f"tpgraph-bridge-out-{i}", daemon=True)
                         for i in range(len(self.conns))]
        self._compilers = [threading.Thread(target=self._compile, name=f"tpgraph-bridge-compile-{i}", daemon=True)
                           for i in range(compile_threads)]
        # a request whose grammar is not compiled yet is compiled on a thread of its own (a few at once: one large
        # grammar holds up no other's request) and queued after, so that the adds and aborts behind it in the pipe
        # wait for no compile; one aborted meanwhile is never queued (daemon threads: a compile under way holds up no
        # exit)
        self._to_compile: queue.SimpleQueue = queue.SimpleQueue()
        self._compiling: dict[str, int] = {}  # (their request ids, and each one's samples: n)
        self._dropped: set[str] = set()  # (those aborted while compiling)
        self._lock = threading.Lock()
        self._closed = threading.Event()  # (then what waits to compile is dropped: the service has stopped)
        self._not_ready = len(self.conns)  # (front ends yet to say they listen; under the lock)

    def start(self) -> None:
        for t in (*self._readers, *self._senders, *self._compilers):
            t.start()

    def compiling(self) -> int:
        """The samples of the requests whose grammar is compiling, not in the engine's queue yet: waiting all the same
        (vLLM's scheduler queues them, waiting for their grammar)."""
        with self._lock:
            return sum(self._compiling.values())

    def failed(self, reason: str) -> None:
        """Tell the front ends the engine loop failed (`reason`): they refuse new requests and fail /health now,
        naming the failure, and stop as a failure (the close that follows is no planned stop)."""
        for out in self._outs:
            out.put(("failed", reason))

    def close(self) -> None:
        """Tell the front ends the engine is going (they exit), stop sending, shut the sockets down (which also ends
        this side's blocked readers; closing the descriptors alone would not) and close them. Grammars waiting to
        compile are dropped, and those compiling queue nothing: the service they were for has stopped."""
        with self._lock:  # (so no request is queued after this)
            self._closed.set()
        for _ in self._compilers:  # (each compile thread's stop)
            self._to_compile.put(_STOP)
        for out in self._outs:
            out.put(("closing",))
            out.put(_STOP)
        _join_within(self._senders, 2.0)
        for conn in self.conns:
            try:
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        _join_within(self._readers, 2.0)
        for conn in self.conns:
            conn.close()

    def _read(self, index: int) -> None:
        conn, sink = self.conns[index], self._outs[index].put
        try:
            while True:
                message = conn.recv()
                kind = message[0]
                if kind == "add":
                    _, request_id, prompt_ids, params = message
                    if self.service.compiles(params):  # (here, not in a step: a new grammar takes a while)
                        with self._lock:
                            self._compiling[request_id] = params.n
                        self._to_compile.put((request_id, prompt_ids, params, sink))
                    else:
                        self.service.precompile(params)  # (the other ranks hear of a grammar compiled here)
                        self.service.enqueue(request_id, prompt_ids, params, sink)
                elif kind == "abort":
                    with self._lock:
                        if message[1] in self._compiling:
                            self._dropped.add(message[1])
                            self._compiling[message[1]] = 0  # (no longer waiting: its compile ends it)
                        else:
                            self.service.enqueue_abort(message[1])
                elif kind == "metrics":
                    sink(("metrics", message[1], self.exposition()))
                elif kind == "ready":
                    with self._lock:
                        self._not_ready -= 1
                        everyone = self._not_ready == 0
                    if everyone and self.on_ready is not None:
                        self.on_ready()
        except (EOFError, OSError):
            logger.info("%s closed its pipe", self._named(index))
        except Exception:  # noqa: BLE001 - a message the engine cannot take: stop serving rather than hang
            logger.exception("the pipe from %s failed", self._named(index))
        finally:
            self.on_closed()

    def _named(self, index: int) -> str:
        """A front end as the log names it: "the HTTP front end" where it is the only one (serve.py's wording)."""
        return "the HTTP front end" if len(self.conns) == 1 else f"HTTP front end {index}"

    def _compile(self) -> None:
        while (item := self._to_compile.get()) is not _STOP and not self._closed.is_set():
            request_id, prompt_ids, params, sink = item
            self.service.precompile(params)  # (raises nothing: a refusal, or any failure, is the add's to report)
            with self._lock:  # (queued, or dropped if aborted meanwhile: under the lock, so no abort slips between)
                self._compiling.pop(request_id, None)
                if self._closed.is_set():
                    return
                if request_id in self._dropped:
                    self._dropped.discard(request_id)
                else:
                    self.service.enqueue(request_id, prompt_ids, params, sink)

    def _send(self, index: int) -> None:
        conn, out = self.conns[index], self._outs[index]
        while True:
            batch = [out.get()]
            while True:  # whatever else is waiting goes in the same send
                try:
                    batch.append(out.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            batch = [item for item in batch if item is not _STOP]
            try:
                if batch:
                    conn.send(batch)
            except (OSError, ValueError):  # the front end is gone; the reader reports it
                return
            except Exception:  # noqa: BLE001 - an update that does not pickle: streams would hang, so stop serving
                logger.exception("sending to %s failed", self._named(index))
                self.on_closed()
                return
            if stop:
                return


def _join_within(threads: list[threading.Thread], seconds: float) -> None:
    """Wait for the threads to end, `seconds` for them all together (as for one), not each."""
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


class EngineClient:
    """Front-end side: submit and abort requests, receive their updates on the event loop, fetch engine metrics.

    Sinks are called on the event loop's thread. Every send happens on that thread too (the pipe allows one writer).
    """

    def __init__(self, conn: Connection, limits: RequestLimits, on_lost: Callable[[], None] | None = None) -> None:
        self.conn, self.limits, self.on_lost = conn, limits, on_lost
        self.error: str | None = None
        self.closing = False  # the engine said it is stopping (its pipe then closes as planned)
        self._sinks: dict[str, Sink] = {}
        self._metrics: dict[int, asyncio.Future] = {}
        self._scrape: asyncio.Future | None = None  # the engine_metrics under way, which scrapes meanwhile share
        self._tickets = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start receiving (call once, from the event loop that serves requests)."""
        self._loop = loop
        threading.Thread(target=self._read, name="tpgraph-engine-client", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._loop is not None and self.error is None

    def listening(self) -> None:
        """Tell the engine side the HTTP server accepts connections now (call on the event loop, once)."""
        self.conn.send(("ready",))

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.limits.check(prompt_ids, params)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Raises EngineUnavailable if the engine is gone."""
        if self.error is not None:
            raise EngineUnavailable(f"the engine stopped: {self.error}")
        self._sinks[request_id] = sink
        try:
            self.conn.send(("add", request_id, list(prompt_ids), params))
        except OSError as exc:
            self._sinks.pop(request_id, None)
            self._lost(f"the connection to the engine broke: {exc}")
            raise EngineUnavailable(f"the engine stopped: {self.error}") from None

    def release(self, request_id: str) -> None:
        """The request is over; forget its sink."""
        self._sinks.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        if self.error is None:
            try:
                self.conn.send(("abort", request_id))
            except OSError as exc:  # the engine is gone: nothing left to abort
                self._lost(f"the connection to the engine broke: {exc}")

    async def engine_metrics(self, timeout_s: float = 5.0) -> bytes:
        """The engine process's Prometheus exposition (empty if it does not answer in time). Scrapes that come while
        one is under way share its answer: /metrics asks no key, and each scrape had the engine's process write its
        exposition, beside its steps, however many came at once."""
        if self.error is not None:
            return b""
        if self._scrape is None or self._scrape.done():
            self._scrape = asyncio.ensure_future(self._fetch_metrics(timeout_s))
        return await asyncio.shield(self._scrape)  # (a scraper that goes away leaves the others' answer coming)

    async def _fetch_metrics(self, timeout_s: float) -> bytes:
        ticket = next(self._tickets)
        future = asyncio.get_running_loop().create_future()
        self._metrics[ticket] = future
        try:
            self.conn.send(("metrics", ticket))
        except OSError as exc:
            self._metrics.pop(ticket, None)
            self._lost(f"the connection to the engine broke: {exc}")
            return b""
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return b"# the engine did not answer within the scrape timeout\n"
        finally:
            self._metrics.pop(ticket, None)

    def _read(self) -> None:
        assert self._loop is not None
        try:
            while True:
                batch = self.conn.recv()
                self._loop.call_soon_threadsafe(self._dispatch, batch)
        except (EOFError, OSError):
            self._loop.call_soon_threadsafe(self._lost, "the engine process closed the connection")
        except Exception as exc:  # noqa: BLE001 - an unreadable message: treat the engine as lost, say why
            logger.exception("the pipe from the engine failed")
            self._loop.call_soon_threadsafe(self._lost, f"the connection to the engine failed: {exc}")

    def _lost(self, reason: str) -> None:
        if self.error is None:
            self._fail(reason)

    def _dispatch(self, batch: list) -> None:
        for item in batch:
            if isinstance(item, StepUpdate):
                sink = self._sinks.get(item.request_id)
                if sink is not None:
                    sink(item)
            elif item[0] == "metrics":
                future = self._metrics.get(item[1])
                if future is not None and not future.done():
                    future.set_result(item[2])
            elif item[0] == "failed":
                self._lost(f"its loop failed: {item[1]}")
            elif item[0] == "closing" and self.error is None:
                self.closing = True  # (a stop the engine announced, not a failure)
                self._lost("the engine is shutting down")

    def _fail(self, reason: str) -> None:
        self.error = reason
        for request_id, sink in list(self._sinks.items()):
            sink(StepUpdate(request_id, 0, None, reason, UNAVAILABLE))
        self._sinks.clear()
        if self.on_lost is not None:
            self.on_lost()
