"""Server-sent events: a stream's data lines, and the response that sends them, ended cleanly however it ends (a
failure after the 200 as an error event; the engine's requests aborted with the response)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from json.encoder import c_make_encoder, encode_basestring_ascii

from fastapi.responses import StreamingResponse

from tpgraph.errors import RequestError
from tpgraph.server.bridge import EngineUnavailable
from tpgraph.server.errors import ApiError, error_body

logger = logging.getLogger(__name__)
# json.dumps's own encoder (the C one, its separators and ASCII escapes), built once: json.dumps builds one for every
# call, about half of a streamed token's JSON time. (No check for circular references: an event is plain data.)
_ENCODE = None if c_make_encoder is None else c_make_encoder(None, json.JSONEncoder().default, encode_basestring_ascii,
                                                             None, ": ", ", ", False, False, True)


def dumps(payload: object) -> str:
    """json.dumps(payload), byte for byte."""
    return json.dumps(payload) if _ENCODE is None else "".join(_ENCODE(payload, 0))


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else dumps(payload)}\n\n"


def typed_sse(event: dict) -> str:
    """An event of a stream whose events name their type on an event line (the Responses and Messages APIs')."""
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events; if anything fails after the stream began (the 200 is sent), an error event and [DONE] end
    it, as vLLM's stream generators do (`except Exception`), instead of a cut connection: the engine's failure, a
    refusal (a later prompt the engine refused) as the 400 a whole reply gets, anything else as a 500."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # (not CancelledError nor GeneratorExit: a client that left is sent nothing)
        yield sse(error_body(*stream_failure(exc)))
        yield sse("[DONE]")


def stream_failure(exc: Exception, what: str = "a stream after it began") -> tuple[int, str, str]:
    """What failed a stream after it began, as the (status, message, type) a whole reply would have got; `what`:
    what failed, as the log names a bug's failure (a route that answers a whole reply's or its set-up's failure
    here too says which)."""
    if isinstance(exc, ApiError):
        return exc.status, exc.message, exc.kind
    if isinstance(exc, EngineUnavailable):
        return 503, str(exc), "ServiceUnavailableError"
    if isinstance(exc, RequestError):
        return 400, str(exc), "BadRequestError"
    logger.exception("unexpected failure in %s", what)  # (a whole reply's, unless its route answers it: Starlette's)
    return 500, str(exc), "InternalServerError"


class EventStream(StreamingResponse):
    """A stream's events (through its guard: guarded, the chat and completion APIs'), whose engine requests end with
    the response however it ends: a client that goes away while a send waits (a slow reader) cancels the response
    with its generators suspended, and nothing else closes them (their requests ran on, KV blocks held, until the
    garbage collector found them)."""

    def __init__(self, events: AsyncIterator[str], requests: AsyncIterator,
                 guard: Callable[[AsyncIterator[str]], AsyncIterator[str]] | None = guarded) -> None:
        """guard: None where the events end a failed stream themselves (the Responses API's error event)."""
        super().__init__(events if guard is None else guard(events), media_type="text/event-stream")
        self.requests = requests  # (Api.run's stream: closing it aborts whatever is unfinished)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.requests.aclose()
