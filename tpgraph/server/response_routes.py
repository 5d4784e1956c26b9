"""The Responses API's routes: POST /v1/responses (whole, streamed as typed events, or in the background, streamed
too), GET (whole, or a background stream's events again) and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel. A response runs as a chat turn (responses.py reads the
request as one); its output items are folded from the turn's deltas (OutputItems)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpgraph.engine.updates import StepUpdate
from tpgraph.errors import RequestError
from tpgraph.server.protocol import ChatRequest
from tpgraph.server.reply import Delta
from tpgraph.server.request_ids import request_id
from tpgraph.server.response_store import EventLog, ResponseStore, StoredResponse
from tpgraph.server.responses import AnswerTokens, OutputItems, ResponsesRequest, ThoughtTokens
from tpgraph.server.sse import EventStream, stream_failure, typed_sse
from tpgraph.server.turn import ChatTurn


class StartChat(Protocol):
    """A chat request submitted as a turn (app.py's start_chat): its HTTP request, its reply's id, and whether the
    engine's first update is awaited (begun)."""

    def __call__(self, body: ChatRequest, request: Any, name: str, begun: bool = True) -> Awaitable[ChatTurn]: ...


# a chat request's log-probability entries ({"token", "logprob", "bytes", "top_logprobs"}) of (token, logprob, top)
LogprobEntries = Callable[[ChatRequest, list], list[dict]]


# a response's status by the engine's finish reason, where not "completed" (vLLM's): "abort" is a sample the engine
# ended (every token its grammar or bans allowed was banned), no answer the model finished
FINISHED_STATUSES = {"length": "incomplete", "abort": "cancelled"}


class _Detached:
    """A background response's stand-in for its HTTP request: it has no client to go away (cancel ends it)."""

    async def is_disconnected(self) -> bool:
        return False


class ResponseRun:
    """One response being written: the chat turn it runs as, and its output items as they come."""

    def __init__(self, response_id: str, body: ResponsesRequest, chat: ChatRequest, turn: ChatTurn, model_name: str,
                 entries: LogprobEntries) -> None:
        self.id, self.body, self.chat, self.turn, self.model_name = response_id, body, chat, turn, model_name
        self.entries, self.created = entries, int(time.time())
        self.output = OutputItems()
        self.thoughts = ThoughtTokens(turn.replies[0].thoughts)
        self.final: dict | None = None  # the response once it ended

    def snapshot(self, status: str, error: dict | None = None) -> dict:
        """The response object as it stands (the output items so far)."""
        body, params, choice = self.body, self.turn.params, self.turn.choices[0]
        if status in ("failed", "cancelled"):  # (it is over: so is the item it was writing)
            self.output.cut()
        prompt_tokens, generated = len(self.turn.token_ids[0]), len(choice.token_ids)
        done = status in ("completed", "incomplete", "cancelled")  # (what was written is counted)
        usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": choice.cached_tokens or 0},
                 "output_tokens": generated,
                 "output_tokens_details": {"reasoning_tokens": self.thoughts.count},
                 "total_tokens": prompt_tokens + generated} if done else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": body.background, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "max_tool_calls": body.max_tool_calls, "model": self.model_name, "output": self.output.current(),
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": body.field("reasoning.effort"), "summary": body.field("reasoning.summary")},
                "service_tier": body.service_tier or "auto", "store": body.store,
                "temperature": params.temperature,
                "text": {"format": body.field("text.format") or {"type": "text"},
                         "verbosity": body.field("text.verbosity")},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "top_logprobs": body.top_logprobs or 0, "top_p": params.top_p,
                "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
                "metadata": body.metadata or {}}

    async def events(self) -> AsyncIterator[dict]:
        """The response's stream of events (without their sequence numbers), from response.created to
        response.completed (or response.incomplete, where max_output_tokens cut it). Where the turn stopped short (its
        client went away: Api.run aborted the request and ended), the events stop there too, and final stays None."""
        yield {"type": "response.created", "response": self.snapshot("in_progress")}
        yield {"type": "response.in_progress", "response": self.snapshot("in_progress")}
        turn, asked = self.turn, self.body.logprobs() and not self.turn.hidden
        reply = turn.replies[0]
        # (a whole reply's "auto" or "required" calls are read once it ends: its text comes with them, at the end)
        answer = AnswerTokens() if asked and reply.calls is None and reply.plan.mode in ("auto", "required") else None
        finish = None
        async for _, u in turn.updates():
            read = len(reply.pieces)
            self.thoughts.before()
            _, delta, _ = turn.apply(u)
            if u.token_id is not None:
                self.thoughts.after(u.text)
            piece = "".join(reply.pieces[read:])  # (a reply read whole: the answer's text this token wrote)
            entries = self._entries(u, delta, piece) if asked else []
            if answer is not None:
                answer.add(piece, entries, bool(delta.reasoning))
            for event in self.output.add(delta, entries, reply.broken_call):
                yield event
            # (the engine's reason, as vLLM's, not the reply's: a whole "auto" reply whose calls are whole reports
            # "tool_calls" where max_tokens cut it, a streamed one "length"; the status must not differ)
            finish = u.finish_reason or finish
        if finish is None:  # (no finish came: the client went away; what was written is no completed response)
            return
        status = FINISHED_STATUSES.get(finish, "completed")
        for event in self.output.release():  # (before a whole reply's texts take their tokens' entries)
            yield event
        if answer is not None:
            self.output.retake_text_logprobs(answer)
        for event in self.output.finish(status != "completed"):
            yield event
        self.final = self.snapshot(status)
        # (OpenAI's stream has no response.cancelled: vLLM ends a cancelled one with response.completed)
        yield {"type": "response.incomplete" if status == "incomplete" else "response.completed",
               "response": self.final}

    def _entries(self, u: StepUpdate, delta: Delta, piece: str) -> list[dict]:
        """An update's log-probability entries, for the text: none where its token was read in the thoughts and wrote
        no answer (their end tag: no token of the text)."""
        if u.logprob is None or self.thoughts.in_thoughts() and not (delta.content or piece):
            return []
        return self.entries(self.chat, [(u.token_id, u.logprob, u.top_logprobs or [])])

    async def whole(self) -> dict | None:
        """The response once it ended (None where its client went away first)."""
        try:
            async for _ in self.events():
                pass
        finally:  # (its request ends with the response, also where reading an update raised)
            await self.turn.stream.aclose()
        return self.final


def failure_events(run: ResponseRun, exc: Exception, what: str) -> tuple[dict, list[dict]]:
    """A response that failed after it began: the response "failed" with its error, and the events that end its
    stream (the API's error event, then response.failed). The error event's code is the failed response's: one of
    OpenAI's error codes ("server_error", ...), not the error type a chat stream's error names."""
    status, message, _ = stream_failure(exc, what)
    error = response_error(status, message)
    failed = run.snapshot("failed", error)
    return failed, [{"type": "error", "code": error["code"], "message": message, "param": None},
                    {"type": "response.failed", "response": failed}]


def cancelled_event(cancelled: dict) -> dict:
    """The event that ends a cancelled background response's stream, so that its readers hear it end: OpenAI's stream
    has no response.cancelled, and vLLM's, as a response whose client went away here, ends with response.completed."""
    return {"type": "response.completed", "response": cancelled}


def response_error(status: int, message: str) -> dict:
    """A failed response's error, as OpenAI's (the SDK's ResponseError, whose code is one of OpenAI's codes): a
    refusal (a 400: the prompt refused) "invalid_prompt", any other failure "server_error"."""
    return {"code": "invalid_prompt" if status == 400 else "server_error", "message": message}


def typed_event(event: dict, sequence_number: int) -> str:
    """A Responses stream event as the API sends it, numbered."""
    return typed_sse({**event, "sequence_number": sequence_number})


def response_routes(start_chat: StartChat, entries: LogprobEntries, model_name: str, store: ResponseStore
                    ) -> APIRouter:
    """start_chat: the chat route's set-up (app.py), which submits a chat request as a turn; entries: its
    log-probability entries."""
    router = APIRouter()

    def conversation_before(body: ResponsesRequest) -> list[dict]:
        if body.previous_response_id is None:
            return []
        earlier = store.get(body.previous_response_id, "previous_response_id")
        status = earlier.current()["status"]
        if status in ("queued", "in_progress"):
            raise RequestError(f"previous_response_id {body.previous_response_id!r} is still {status}: continue it "
                               "once it has finished")
        return earlier.items()

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        body.check()
        own = body.input_items()
        conversation = [*conversation_before(body), *own]
        chat = body.chat_request(conversation)
        given = request_id(request, chat.request_id)
        # (vLLM's id is the request_id as given, "resp_..." by default: one given so is not prefixed again)
        response_id = given if given.startswith("resp_") else f"resp_{given}"

        def kept(response: dict) -> StoredResponse:
            return StoredResponse(response, conversation, inputs=len(own))

        if body.background:
            stored = await start_background(response_id, body, chat, kept)
            if stored.log is None:
                return JSONResponse(stored.response)
            return logged_stream(stored.log)
        run = ResponseRun(response_id, body, chat, await start_chat(chat, request, response_id), model_name,
                          entries)
        if not body.stream:
            response = await run.whole()
            if response is None:  # (its client went away: nothing to store, no one to answer)
                return Response(status_code=499)
            if body.store:
                store.put(response_id, kept(response))
            return JSONResponse(response)

        async def stream() -> AsyncIterator[str]:
            numbers = itertools.count()
            try:
                async for event in run.events():
                    # (final: the last event's. Stored before it goes out: its client may continue it at once, while
                    # the send waits on a slow reader)
                    if body.store and run.final is not None:
                        store.put(response_id, kept(run.final))
                    yield typed_event(event, next(numbers))
            except Exception as exc:  # (after the 200: the API's error event, then response.failed, end the stream)
                failed, ending = failure_events(run, exc, "a stream after it began")
                if body.store:
                    store.put(response_id, kept(failed))
                for event in ending:
                    yield typed_event(event, next(numbers))

        return EventStream(stream(), run.turn.stream, guard=None)

    async def start_background(response_id: str, body: ResponsesRequest, chat: ChatRequest,
                               kept: Callable[[dict], StoredResponse]) -> StoredResponse:
        """Check the response (a refusal is the request's 400), store it queued and write it as it runs, in the store
        (with stream: true, its events too, in its log). It answers before the engine does, as OpenAI's and vLLM's:
        queued until the engine's first update, then in_progress; a refusal only the engine makes fails it."""
        turn = await start_chat(chat, _Detached(), response_id, begun=False)
        run = ResponseRun(response_id, body, chat, turn, model_name, entries)
        stored = kept(run.snapshot("queued"))
        log = stored.log = EventLog() if body.stream else None
        numbers = itertools.count()

        def logged(event: dict) -> None:
            if log is not None:
                log.add({**event, "sequence_number": next(numbers)})

        status = "queued"
        stored.live = lambda: run.snapshot(status)

        async def work() -> None:
            nonlocal status
            try:
                await turn.begin()  # (the engine has it, and has answered)
                status = "in_progress"
                async for event in run.events():
                    logged(event)
                stored.response = run.final
            except asyncio.CancelledError:
                stored.response = run.snapshot("cancelled")
                logged(cancelled_event(stored.response))
            except Exception as exc:
                stored.response, ending = failure_events(run, exc, "a background response")
                for event in ending:
                    logged(event)
            finally:
                stored.live = None
                if log is not None:
                    log.end()
                await run.turn.stream.aclose()

        def ended(_: asyncio.Task) -> None:
            """A task cancelled before its first step (the store dropped it at once) never ran work's body: it is
            cancelled all the same, and its log ends (its readers, the POST that created it among them, would wait
            for good). Then the store counts its bytes as they are now."""
            if stored.live is not None:
                stored.response, stored.live = run.snapshot("cancelled"), None
                logged(cancelled_event(stored.response))
            if log is not None and not log.ended:
                log.end()
            store.ended(response_id, stored)  # (its bytes, grown as it ran, counted now)

        stored.task = asyncio.get_running_loop().create_task(work())
        stored.task.add_done_callback(ended)
        store.put(response_id, stored)
        return stored

    def logged_stream(log: EventLog, starting_after: int | None = None) -> StreamingResponse:
        """A background stream's events (a reader that goes away stops reading, not the response)."""
        return StreamingResponse((typed_sse(event) async for event in log.read(starting_after)),
                                 media_type="text/event-stream")

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        stored = store.get(response_id)
        if not stream:
            return JSONResponse(stored.current())
        if stored.log is None:
            raise RequestError(f"response {response_id!r} was not created in the background with stream: true: "
                               "only such a response's events can be streamed again; read it whole")
        return logged_stream(stored.log, starting_after)

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, after: str | None = None, limit: int = 20,
                          order: str = "desc") -> JSONResponse:
        """OpenAI's list of a response's own input items (not the earlier conversation's), a page at a time."""
        if not 1 <= limit <= 100:
            raise RequestError(f"limit must be between 1 and 100, got {limit}")
        if order not in ("asc", "desc"):
            raise RequestError(f"order must be asc or desc, got {order!r}")
        items = store.get(response_id).own_inputs()
        items = items if order == "asc" else items[::-1]
        if after is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            if at is None:
                raise RequestError(f"after {after!r} is no input item of response {response_id!r}")
            items = items[at + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        stored = store.get(response_id)
        status = stored.current()["status"]
        if stored.task is None:
            raise RequestError(f"response {response_id!r} was not created in the background: only a background "
                               "response can be cancelled")
        if status not in ("queued", "in_progress"):
            raise RequestError(f"response {response_id!r} is already {status}: only a queued or in_progress "
                               "response can be cancelled")
        stored.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stored.task
        return JSONResponse(stored.response)

    return router
