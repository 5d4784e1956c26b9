"""The Responses API's stored responses (store: true, OpenAI's default): each response as last written and the
conversation before its output, for previous_response_id, GET /v1/responses/{id}, DELETE and a background response's
cancel. In memory and bounded: the newest `capacity` are kept, and of those no more than `max_bytes` of them (vLLM's
store keeps every one, and its docs warn of the leak), and an id dropped or never stored is a 404 that says so."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tpgraph.server.errors import ApiError

# (the default --responses-store-size; a response is its text and its conversation's, kilobytes each)
DEFAULT_CAPACITY = 1024
# (the default --responses-store-mib: a count alone let 1024 responses of long outputs, top_logprobs or long background
# event logs hold gigabytes)
DEFAULT_MIB = 256


@dataclass
class EventLog:
    """A background stream's events (numbered) as they come, kept so that its readers (the POST that created it,
    and GET ?stream=true) read them from any point, each at its own pace, none of them holding the run back."""

    events: list[dict] = field(default_factory=list)
    ended: bool = False
    _added: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, event: dict) -> None:
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        added, self._added = self._added, asyncio.Event()  # (each wait is on the event of the log as it stood)
        added.set()

    async def read(self, starting_after: int | None = None) -> AsyncIterator[dict]:
        """The events after the one numbered starting_after (all of them without), until the log ends."""
        at = 0 if starting_after is None else max(starting_after + 1, 0)  # (not from the end, as a list's index)
        while True:
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.ended:
                return
            await self._added.wait()


@dataclass
class StoredResponse:
    response: dict  # the response object once written (a background one's: as it was queued)
    conversation: list[dict]  # the input items before its output (an earlier response's conversation, then its own)
    task: asyncio.Task | None = None  # (a background response) the run that writes it
    live: Callable[[], dict] | None = None  # (a background response being written) the response as it stands
    inputs: int = 0  # how many of the conversation's last items are its own input (input_items lists them)
    log: EventLog | None = None  # (a background response created with stream: true) its events

    def current(self) -> dict:
        """The response as GET returns it: as it stands, where it is still being written."""
        return self.response if self.live is None else self.live()

    def own_inputs(self) -> list[dict]:
        return self.conversation[len(self.conversation) - self.inputs:]

    def items(self) -> list[dict]:
        """The conversation a next response continues: the input, then this response's output."""
        return [*self.conversation, *self.response["output"]]

    def running(self) -> bool:
        """Whether it is still being written (a background response): no bound drops it then, as its run goes on."""
        return self.live is not None or (self.task is not None and not self.task.done())

    def size(self) -> int:
        """Its bytes, as JSON: the response, its conversation and its event log (the conversation counted whole, though
        a continued response shares its items with the one it continues: a chain is over-counted, never under)."""
        events = self.log.events if self.log is not None else []
        return len(json.dumps([self.response, self.conversation, events], default=repr))


def in_bytes(size: int) -> str:
    return f"{size >> 20} MiB" if size and size % (1 << 20) == 0 else f"{size} bytes"


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MIB << 20) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store's capacity must be >= 0, got {capacity}")
        if max_bytes < 0:
            raise ValueError(f"the responses store's max_bytes must be >= 0, got {max_bytes}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # (each response's bytes, as last measured: when written, when it ended)
        self.bytes = 0

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep (or rewrite) a response; where the store is full, the oldest no longer being written goes (where every
        other is still running, the oldest: cancelled, as nothing could read it back), and so does one still running
        that another response of its id (the same X-Request-Id or request_id) replaces. Past max_bytes, the oldest
        responses no longer being written go too (see _shrink)."""
        replaced = self._stored.get(response_id)
        if replaced is not None and replaced is not stored and replaced.task is not None:
            replaced.task.cancel()
        self._stored[response_id] = stored
        self._stored.move_to_end(response_id)
        self._measure(response_id, stored)
        while len(self._stored) > self.capacity:
            done = (r for r, s in self._stored.items() if r != response_id and not s.running())
            self._drop(next(done, next(iter(self._stored))))
        self._shrink(response_id)

    def ended(self, response_id: str, stored: StoredResponse) -> None:
        """A background response has ended: measured again (its output and event log have grown since it was put),
        and the store shrunk to its bound, as by a put. Nothing where the store no longer holds it."""
        if self._stored.get(response_id) is stored:
            self._measure(response_id, stored)
            self._shrink(response_id)

    def _measure(self, response_id: str, stored: StoredResponse) -> None:
        size = stored.size()
        self.bytes += size - self._sizes.get(response_id, 0)
        self._sizes[response_id] = size

    def _shrink(self, written: str) -> None:
        """Past max_bytes, drop the oldest responses, but for those still being written (a running background
        response is never dropped for its bytes: while such responses alone are past the bound, every other goes and
        the store stays past it until they end) and the one just written (kept even where it alone is past the bound,
        so that a response stored is there to read at least until the next one comes)."""
        if self.bytes <= self.max_bytes:
            return
        for response_id in [r for r, s in self._stored.items() if r != written and not s.running()]:
            self._drop(response_id)
            if self.bytes <= self.max_bytes:
                return

    def _drop(self, response_id: str) -> StoredResponse:
        dropped = self._stored.pop(response_id)
        self.bytes -= self._sizes.pop(response_id)
        if dropped.task is not None:
            dropped.task.cancel()
        return dropped

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """param: the request's field that named it (the error names it)."""
        stored = self._stored.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found (this server keeps the newest "
                                f"{self.capacity} responses stored with store: true, up to "
                                f"{in_bytes(self.max_bytes)} of them).", "NotFoundError", param)
        return stored

    def delete(self, response_id: str) -> StoredResponse:
        self.get(response_id)
        return self._drop(response_id)

    def __len__(self) -> int:
        return len(self._stored)
