"""The engine as a service: rank 0 runs the step loop in a thread fed by front-end requests; other ranks follow.

Front ends (the HTTP server) call `submit` / `abort` from any thread and get each request's StepUpdates through the
callback they passed. Each loop turn: collect what arrived, send it to every rank (control.py), apply it on every
rank in the same order, and step if there is work. Idle, rank 0 waits for requests up to `heartbeat_s` at a time and
then sends an empty message, so the other ranks hear from it regularly.

Every rank must apply the same adds, aborts and steps, so what can fail on rank 0 alone never fails between a message
and what the other ranks do with it: a request is prepared (checked, detokenizers built) before it is sent, and one
that fails is answered and left out; a front end's sink that raises loses its request through an abort in the next
message; the step hook is switched off. A turn that raises anyway fails the service for good (see `turn`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpgraph.engine.control import ControlPlane, StepMessage
from tpgraph.engine.core import EngineCore, PreparedRequest
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.updates import REFUSED, StepUpdate
from tpgraph.errors import RequestError

logger = logging.getLogger(__name__)
Sink = Callable[[StepUpdate], None]
Local = list[tuple[PreparedRequest, Sink]]  # rank 0's side of a message's adds, one per add, in order


@dataclass
class LoopTimes:
    """The last stepping turn: its control-path broadcasts and the step's wall time without them (seconds)."""

    control_s: float = 0.0
    step_s: float = 0.0


class EngineService:
    def __init__(self, core: EngineCore, control: ControlPlane, heartbeat_s: float = 1.0,
                 on_step: Callable[[list[StepUpdate], float], None] | None = None) -> None:
        self.core = core
        self.control = control
        self.heartbeat_s = heartbeat_s
        self.on_step = on_step  # metrics hook: (updates, step seconds)
        # rank 0: told (on the loop's thread) once the loop has failed and every open request has heard it, so that a
        # front end refuses new requests at once instead of queueing them for a loop that is gone
        self.on_failed: Callable[[BaseException], None] | None = None
        self.times = LoopTimes()
        self.error: BaseException | None = None
        self.prefix_cache_reset: bool | None = None  # what the last reset_prefix_cache message did (every rank alike)
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._idle_s = 0.0  # rank 0: how long the last blocking collect waited for something to arrive
        self._next: tuple[StepMessage, Local | None] | None = None  # exchanged, applied next turn
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None

    # ---- front-end side (any thread) -------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue a request; raise RequestError now if the engine would refuse it."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        self.core.check_request(prompt_ids, params)  # reads fixed configuration only: safe from any thread
        self.enqueue(request_id, prompt_ids, params, sink)

    def compiles(self, params: SamplingParams) -> bool:
        """Whether precompile would compile a grammar (one the request asks for, not compiled yet), taking a while."""
        grammars = self.core.grammars
        return params.structured is not None and grammars is not None and not grammars.compiled(params.structured)

    def precompile(self, params: SamplingParams) -> None:
        """Compile a request's grammar on the caller's thread (the server bridge's), so that the engine thread, which
        adds the request, finds it compiled rather than stalling a step on it; the other ranks are told to compile it
        too, on a thread of theirs. A refusal, or any failure, is left for the add to report."""
        if params.structured is not None and self.core.grammars is not None:
            if self.control.needed:  # the other ranks compile it beside this one (the next message tells them)
                self._inbox.put(("compile", params.structured))
            try:
                self.core.grammars.compile(params.structured)
            except Exception:  # noqa: BLE001 - the add reports it (this thread is the server's reader: it must live)
                pass

    def abort(self, request_id: str) -> None:
        self.enqueue_abort(request_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_driver, name="tpgraph-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        """Stop the loop and tell every other rank to return. False where the loop had already ended (it failed):
        then no rank was told."""
        if self._thread is None or not self._thread.is_alive():
            return False
        self.enqueue_shutdown()
        self._thread.join(timeout_s)
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the loops ---------------------------------------------------------------------------------------------
    def _run_driver(self) -> None:
        device = self.core.runner.device
        if device.type == "cuda":  # a new thread starts on device 0, and Triton launches on the current device
            torch.cuda.set_device(device)
        try:
            while self.turn():
                pass
        except BaseException as exc:  # the engine is gone: every waiting request learns it
            self.error = exc
            logger.exception("the engine loop failed")
            for request_id, sink in list(self._sinks.items()):
                sink(StepUpdate(request_id, 0, None, f"{type(exc).__name__}: {exc}", "error"))
            self._sinks.clear()
            if self.on_failed is not None:
                try:
                    self.on_failed(exc)
                except Exception:  # noqa: BLE001 - the failure is logged above; the server's own poll still sees it
                    logger.exception("telling the front end that the engine loop failed failed")

    def run_worker(self) -> None:
        """Ranks other than 0: follow rank 0's messages until it says shut down."""
        while self.turn():
            pass

    def enqueue(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue an already checked request (rank 0 driving the loop itself)."""
        self._inbox.put(("add", request_id, list(prompt_ids), params, sink))

    def enqueue_abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def enqueue_reset_prefix_cache(self) -> None:
        self._inbox.put(("reset_prefix_cache",))

    def enqueue_shutdown(self) -> None:
        self._inbox.put(("shutdown",))

    @property
    def pending(self) -> bool:
        """Rank 0: something queued or exchanged that no turn has applied yet."""
        return not self._inbox.empty() or (self._next is not None and not self._next[0].empty)

    def turn(self) -> bool:
        """One loop turn, the same on every rank (see _turn). False: shut down.

        A turn that raises may have stopped between messages and collectives the other ranks go through (rank 0's
        step failing, say): the ranks may then disagree on what runs next, and another turn could wait forever in
        a collective nobody else joins. So the service is failed for good (`error`), and takes no more turns."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop failed earlier ({type(self.error).__name__}: {self.error}); its "
                               f"ranks may disagree, so it takes no more turns")
        try:
            return self._turn()
        except BaseException as exc:
            self.error = exc
            raise

    def _turn(self) -> bool:
        """One loop turn, the same on every rank. False: shut down.

        In steady decode the next turn's message travels during this turn's step, while the GPU runs (the step's
        `while_gpu_runs` hook), so no rank waits for it. After a turn without a step it is exchanged at the top of
        the next turn (rank 0 waiting up to heartbeat_s for something to send). Every rank takes the same branches
        (their cores agree on has_work), so the broadcasts always pair up.
        """
        t0 = time.perf_counter()
        self._idle_s = 0.0
        if self._next is None:
            self._next = self._exchange(block=not self.core.has_work)
        (message, local), self._next = self._next, None
        self._apply(message, local)
        if message.shutdown:
            return False
        if not self.core.has_work:
            return True
        top = time.perf_counter() - t0 - self._idle_s  # (an idle engine's wait for its request is no control path)
        mid = 0.0

        def exchange_next() -> None:
            nonlocal mid
            t = time.perf_counter()
            self._next = self._exchange(block=False)
            mid = time.perf_counter() - t

        t1 = time.perf_counter()
        updates = self.core.step(while_gpu_runs=exchange_next)
        self.times = LoopTimes(control_s=top + mid, step_s=time.perf_counter() - t1 - mid)
        self._deliver(updates)
        if self.on_step is not None:
            try:
                self.on_step(updates, self.times.step_s)
            except Exception:  # noqa: BLE001 - rank 0's alone, after the step: raising would strand the other ranks
                logger.exception("the step hook failed; it is switched off and the engine serves on")
                self.on_step = None
        return True

    def _exchange(self, block: bool) -> tuple[StepMessage, Local | None]:
        if self.control.state.rank == 0:
            message, local = self._collect(block)
            return self.control.exchange(message), local
        message = self.control.exchange(None)
        if self.core.grammars is not None:  # begun now, while this rank's step runs (rank 0 compiles them itself)
            for spec in message.compiles:
                self.core.grammars.compile_soon(spec)
        return message, None

    def _apply(self, message: StepMessage, local: Local | None) -> None:
        """Every rank applies the same adds and aborts in the same order. `local`: rank 0's prepared adds and sinks
        (None on the other ranks, which build the same requests from the message)."""
        for i, (request_id, prompt_ids, params) in enumerate(message.adds):
            try:
                if local is None:
                    self.core.add_request(request_id, prompt_ids, params)
                else:
                    self.core.add_prepared(local[i][0])
            except RequestError as exc:  # a refusal from what every rank shares (an id already running, a length):
                # every rank refuses it alike; it is answered and the engine serves on. Anything else may have hit
                # one rank alone (rank 0 prepared this request without failing), so it is not swallowed: a rank
                # that carried on without the request would desync from the others.
                if local is not None:
                    self._answer(local[i][1], StepUpdate(request_id, 0, None, str(exc), REFUSED))
                continue
            if local is not None:
                self._sinks[request_id] = local[i][1]
        for request_id in message.aborts:
            self._deliver(self.core.abort(request_id))
        if message.reset_prefix_cache:
            self.prefix_cache_reset = self.core.reset_prefix_cache()

    def _collect(self, block: bool) -> tuple[StepMessage, Local]:
        """Rank 0: what arrived since the last message. A request that fails to prepare (its checks, detokenizers:
        a failure that may be rank 0's alone) is answered here, before any rank hears of it."""
        message, local = StepMessage(), []
        waited_from = time.perf_counter()
        try:
            item = self._inbox.get(timeout=self.heartbeat_s) if block else self._inbox.get_nowait()
            self._idle_s = time.perf_counter() - waited_from if block else 0.0
            while True:
                kind = item[0]
                if kind == "add":
                    _, request_id, prompt_ids, params, sink = item
                    try:
                        prepared = self.core.prepare_request(request_id, prompt_ids, params)
                    except Exception as exc:  # noqa: BLE001 - checked at submit; a late failure answers the request
                        refused = isinstance(exc, RequestError)
                        if not refused:
                            logger.exception("request %s could not be added", request_id)
                        self._answer(sink, StepUpdate(request_id, 0, None, str(exc), REFUSED if refused else "error"))
                    else:
                        message.adds.append((request_id, prepared.prompt_ids, params))
                        local.append((prepared, sink))
                elif kind == "abort":
                    message.aborts.append(item[1])
                elif kind == "compile":
                    message.compiles.append(item[1])
                elif kind == "reset_prefix_cache":
                    message.reset_prefix_cache = True
                else:
                    message.shutdown = True
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return message, local

    def _answer(self, sink: Sink, update: StepUpdate) -> None:
        """Rank 0: hand an update to a front end's sink. A sink that raises must not end rank 0's loop alone (the
        other ranks would wait in the next collective for good): it is dropped and its request aborted, on every
        rank, by the next message."""
        try:
            sink(update)
        except Exception:  # noqa: BLE001 - the front end's failure is its request's, not the engine's
            logger.exception("delivering an update of request %s failed; aborting the request", update.request_id)
            self._sinks.pop(update.request_id, None)
            if update.finish_reason not in ("error", REFUSED) and update.request_id in self.core.requests:
                self.enqueue_abort(update.request_id)

    def _deliver(self, updates: list[StepUpdate]) -> None:
        for update in updates:
            sink = self._sinks.get(update.request_id)
            if sink is not None:
                self._answer(sink, update)
        # A request is over once all its samples finished; a step can finish several of them (n > 1), so its sink is
        # forgotten only after every update of this step was delivered.
        for request_id in {update.request_id for update in updates if update.finish_reason is not None}:
            if request_id not in self.core.requests:
                self._sinks.pop(request_id, None)
