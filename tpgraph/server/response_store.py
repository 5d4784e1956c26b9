"""The Responses API's stored responses (store: true, OpenAI's default): each response as last written and the
conversation before its output, for previous_response_id, GET /v1/responses/{id}, DELETE and a background response's
cancel. In memory and bounded: the newest `capacity` are kept (vLLM's store keeps every one, and its docs warn of the
leak), and an id dropped or never stored is a 404 that says so."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tpgraph.server.errors import ApiError

# (the default --responses-store-size; a response is its text and its conversation's, kilobytes each)
DEFAULT_CAPACITY = 1024


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


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep (or rewrite) a response; the oldest goes where the store is full (a background one still running is
        cancelled: nothing could read it back), and so does one still running that another response of its id (the
        same X-Request-Id or request_id) replaces."""
        replaced = self._stored.get(response_id)
        if replaced is not None and replaced is not stored and replaced.task is not None:
            replaced.task.cancel()
        self._stored[response_id] = stored
        self._stored.move_to_end(response_id)
        while len(self._stored) > self.capacity:
            _, dropped = self._stored.popitem(last=False)
            if dropped.task is not None:
                dropped.task.cancel()

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """param: the request's field that named it (the error names it)."""
        stored = self._stored.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found (this server keeps the newest "
                                f"{self.capacity} responses stored with store: true).", "NotFoundError", param)
        return stored

    def delete(self, response_id: str) -> StoredResponse:
        stored = self.get(response_id)
        del self._stored[response_id]
        if stored.task is not None:
            stored.task.cancel()
        return stored

    def __len__(self) -> int:
        return len(self._stored)
