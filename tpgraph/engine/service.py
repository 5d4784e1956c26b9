"""The engine as a service: rank 0 runs the step loop in a thread fed by front-end requests; other ranks follow.

Front ends (the HTTP server) call `submit` / `abort` from any thread and get each request's StepUpdates through the
callback they passed. Each loop turn: collect what arrived, send it to every rank (control.py), apply it on every
rank in the same order, and step if there is work. Idle, rank 0 waits for requests up to `heartbeat_s` at a time and
then sends an empty message, so the other ranks hear from it regularly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tpgraph.engine.control import ControlPlane, StepMessage
from tpgraph.engine.core import EngineCore, StepUpdate
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.errors import RequestError

logger = logging.getLogger(__name__)
Sink = Callable[[StepUpdate], None]


@dataclass
class LoopTimes:
    """The last loop turn's control-path broadcast and step wall time, and running totals."""

    control_s: list[float] = field(default_factory=lambda: [0.0])
    step_s: list[float] = field(default_factory=lambda: [0.0])
    turns: int = 0
    control_total_s: float = 0.0


class EngineService:
    def __init__(self, core: EngineCore, control: ControlPlane, heartbeat_s: float = 1.0,
                 on_step: Callable[[list[StepUpdate], float], None] | None = None) -> None:
        self.core = core
        self.control = control
        self.heartbeat_s = heartbeat_s
        self.on_step = on_step  # metrics hook: (updates, step seconds)
        self.times = LoopTimes()
        self.error: BaseException | None = None
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None

    # ---- front-end side (any thread) -------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue a request; raise RequestError now if the engine would refuse it."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        self.core.check_request(prompt_ids, params)  # reads fixed configuration only: safe from any thread
        self._inbox.put(("add", request_id, list(prompt_ids), params, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_driver, name="tpgraph-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop and tell every other rank to return."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._inbox.put(("shutdown",))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the loops ---------------------------------------------------------------------------------------------
    def _run_driver(self) -> None:
        try:
            while True:
                message, sinks = self._collect(block=not self.core.has_work)
                if not self.turn(message, sinks):
                    return
        except BaseException as exc:  # the engine is gone: every waiting request learns it
            self.error = exc
            logger.exception("the engine loop failed")
            for request_id, sink in list(self._sinks.items()):
                sink(StepUpdate(request_id, 0, None, "", "error"))
            self._sinks.clear()

    def run_worker(self) -> None:
        """Ranks other than 0: follow rank 0's messages until it says shut down."""
        while self.turn(None, {}):
            pass

    def turn(self, message: StepMessage | None, sinks: dict[str, Sink]) -> bool:
        """One loop turn on any rank: exchange the message, apply it, step if there is work. False: shut down."""
        t0 = time.perf_counter()
        message = self.control.exchange(message)
        t1 = time.perf_counter()
        for request_id, prompt_ids, params in message.adds:
            try:
                self.core.add_request(request_id, prompt_ids, params)
                if request_id in sinks:
                    self._sinks[request_id] = sinks[request_id]
            except RequestError as exc:  # checked at submit; a late refusal still answers the request
                sink = sinks.get(request_id)
                if sink is not None:
                    sink(StepUpdate(request_id, 0, None, str(exc), "error"))
        for request_id in message.aborts:
            self._deliver(self.core.abort(request_id))
        if message.shutdown:
            return False
        if self.core.has_work:
            updates = self.core.step()
            t2 = time.perf_counter()
            self.times.control_s[-1], self.times.step_s[-1] = t1 - t0, t2 - t1
            self.times.turns += 1
            self.times.control_total_s += t1 - t0
            self._deliver(updates)
            if self.on_step is not None:
                self.on_step(updates, t2 - t1)
        return True

    def _collect(self, block: bool) -> tuple[StepMessage, dict[str, Sink]]:
        message, sinks = StepMessage(), {}
        try:
            item = self._inbox.get(timeout=self.heartbeat_s) if block else self._inbox.get_nowait()
            while True:
                kind = item[0]
                if kind == "add":
                    _, request_id, prompt_ids, params, sink = item
                    message.adds.append((request_id, prompt_ids, params))
                    sinks[request_id] = sink
                elif kind == "abort":
                    message.aborts.append(item[1])
                else:
                    message.shutdown = True
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return message, sinks

    def _deliver(self, updates: list[StepUpdate]) -> None:
        for update in updates:
            sink = self._sinks.get(update.request_id)
            if sink is None:
                continue
            sink(update)
            if update.request_id not in self.core.requests:  # the request is over (all its samples finished)
                self._sinks.pop(update.request_id, None)
