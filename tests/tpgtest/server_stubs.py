"""Stand-ins for the server's tests that run the app in process (no engine, no HTTP server): engine clients that
answer in set ways, the built-in model's prompt codec, and httpx (which openai 3 brings as httpx2)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from tpgraph.chat import ChatTemplate, GenerationDefaults
from tpgraph.engine.updates import StepUpdate
from tpgraph.prompts import PromptCodec
from tpgraph.server.bridge import UNAVAILABLE
from tpgraph.tokenizer import BOS, EOS, builtin_tokenizer


def httpx_module():
    try:
        import httpx
    except ImportError:  # (openai 3 brings it under this name)
        httpx = pytest.importorskip("httpx2")
    return httpx


def builtin_codec(name: str = "m", chat: bool = True) -> PromptCodec:
    """The built-in model's codec as TPEngine builds it (its chat template, special tokens and EOS id)."""
    tokenizer = builtin_tokenizer()
    return PromptCodec(tokenizer, ChatTemplate.from_dir(None, BOS) if chat else None, GenerationDefaults(), name,
                       (tokenizer.token_to_id(EOS),), {"bos_token": BOS, "eos_token": EOS})


class EndlessClient:
    """An engine that sends the request a token every 5 ms and never finishes it."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self.error = None

    def check(self, prompt, params) -> None:
        pass

    def submit(self, request_id, prompt, params, sink) -> None:
        async def tokens() -> None:
            while request_id not in self.aborted:
                sink(StepUpdate(request_id, 0, 7, "x"))
                await asyncio.sleep(0.005)

        self.tasks.append(asyncio.get_running_loop().create_task(tokens()))

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)

    def release(self, request_id) -> None:
        pass


class FailingClient(EndlessClient):
    """An engine that answers the request with an error update; `gone`: as the bridge does when the engine process
    shut down or died (its error set, every open request told)."""

    def __init__(self, gone: bool) -> None:
        super().__init__()
        self.gone = gone

    def submit(self, request_id, prompt, params, sink) -> None:
        self.error = "the engine is shutting down" if self.gone else None
        finish = UNAVAILABLE if self.gone else "error"
        sink(StepUpdate(request_id, 0, None, self.error or "ValueError: a bad step", finish))


class OneTokenClient(FailingClient):
    """An engine that answers every request with one token and its finish."""

    def __init__(self) -> None:
        super().__init__(gone=False)
        self.alive = True

    def submit(self, request_id, prompt, params, sink) -> None:
        sink(StepUpdate(request_id, 0, 7, "x", "length"))


class IdleClient:
    """An engine that must not be reached: these routes never submit anything."""

    alive, error = True, None

    def attach(self, loop) -> None:
        pass

    def check(self, *_) -> None:
        raise AssertionError("the engine was asked")

    submit = check

    async def engine_metrics(self) -> str:
        return ""


class SilentClient(IdleClient):
    """An engine that takes a request and never answers it."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def check(self, *_) -> None:
        pass

    def submit(self, request_id, prompt, params, sink) -> None:
        pass

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)


class ScriptedClient(OneTokenClient):
    """An engine that answers each sample of a request with the text pieces given (a token each, id 7, with a
    log-probability of -0.5 where asked), then `finish`; it keeps the params and prompts it was sent. cached: the
    prompt tokens a sample's first update says it found cached, plus the sample's index."""

    def __init__(self, pieces: list[str], finish: str = "stop", cached: int = 0,
                 stop_reason: int | str | None = None) -> None:
        super().__init__()
        self.pieces, self.finish, self.params, self.prompts, self.cached = pieces, finish, [], [], cached
        self.stop_reason = stop_reason  # (the last update's)

    def submit(self, request_id, prompt, params, sink) -> None:
        self.params.append(params)
        self.prompts.append(prompt)
        for sample in range(params.n):
            for i, piece in enumerate(self.pieces):
                update = StepUpdate(request_id, sample, 7, piece, self.finish if i == len(self.pieces) - 1 else None,
                                    cached_tokens=None if i else self.cached + sample)
                if params.logprobs is not None:
                    update.logprob, update.top_logprobs = -0.5, [(7, -0.5)][:params.logprobs]
                if update.finish_reason is not None:
                    update.stop_reason = self.stop_reason
                sink(update)


def post_all(app, requests: list[tuple[str, dict]], headers: dict[str, str] | None = None) -> list:
    """POST each (path, JSON body) to the app in process (httpx over ASGI), in order, with `headers` too; the
    responses."""
    import json

    httpx = httpx_module()

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return [await http.post(path, headers={"Content-Type": "application/json", **(headers or {})},
                                    content=json.dumps(body)) for path, body in requests]

    return asyncio.run(asyncio.wait_for(main(), timeout=30))


def sse_events(text: str) -> list[dict]:
    """A streamed reply's JSON events (its data lines but [DONE])."""
    import json

    return [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: {")]


def typed_sse_events(text: str) -> list[dict]:
    """A stream's events whose event lines name their type (the Responses and Messages APIs'), each line checked."""
    import json

    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def asgi_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    """An HTTP POST's ASGI scope as uvicorn makes it, with these exact header bytes (JSON content type first)."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
            "server": ("t", 80)}


def request_then_disconnect(body: bytes) -> tuple[Callable[[], Awaitable[dict]], asyncio.Event]:
    """An ASGI receive that gives the request whole, then waits until the event returned is set and says the client
    disconnected."""
    left = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await left.wait()
        return {"type": "http.disconnect"}

    return receive, left


def leave_mid_request(app, client, path: str, body: bytes, headers: list[tuple[bytes, bytes]],
                      stuck_send: int | None = None) -> tuple[float, list[dict]]:
    """The ASGI exchange of a client that sends its request, waits 0.3 s, then goes away: the seconds until the
    engine client was told to abort (3 at most), and the messages the app sent. stuck_send: a slow reader, whose
    socket takes that many messages and then never drains (that send waits for good)."""
    sent: list[dict] = []

    async def main() -> float:
        receive, left = request_then_disconnect(body)

        async def send(message: dict) -> None:
            sent.append(message)
            if stuck_send is not None and len(sent) >= stuck_send:
                await asyncio.Event().wait()

        task = asyncio.create_task(app(asgi_scope(path, headers), receive, send))
        await asyncio.sleep(0.3)
        left.set()
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not client.aborted and loop.time() - start < 3:
            await asyncio.sleep(0.02)
        took = loop.time() - start
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for t in getattr(client, "tasks", ()):  # (an endless client's token tasks)
            t.cancel()
        return took

    return asyncio.run(main()), sent
