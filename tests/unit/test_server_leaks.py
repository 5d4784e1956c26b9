"""A server runs for weeks: every request's state goes when its request does, however it ends (finished, refused
half-way, its grammar refused, its client gone mid-stream or mid-wait, the response cancelled) — the front end's sinks
and metrics, the bridge's compiles, the service's sinks, the engine's requests, queues and penalty slots — and every
KV block is free again. The built-in model on CPU behind the bridge and service that tpgraph.serve runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

pytest.importorskip("fastapi")

from tpgtest.served import Served  # noqa: E402
from tpgtest.server_stubs import asgi_scope, request_then_disconnect  # noqa: E402

from tpgraph import TPEngine  # noqa: E402

ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=2048, num_kv_blocks=1200, block_size=4)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    s = Served(TPEngine(**ENGINE))
    yield s
    s.close()


def held(s: Served) -> dict[str, int]:
    """What each request-keyed structure holds (all 0 once every request is over), and the KV blocks in use."""
    core, allocator, m = s.engine.core, s.engine.core.scheduler.allocator, s.metrics
    return {"client sinks": len(s.client._sinks), "service sinks": len(s.service._sinks),
            "engine requests": len(core.requests), "waiting": len(core.scheduler.waiting),
            "running": len(core.scheduler.running), "penalty slots": core.runner.penalties.num_held,
            "compiling": len(s.bridge._compiling), "dropped compiles": len(s.bridge._dropped),
            "blocks in use": allocator.num_blocks - allocator.num_free,
            **{f"metrics {k}": len(getattr(m, k)) for k in ("_arrival", "_prompt_len", "_asked", "_max_tokens",
                                                             "_samples", "_prefill_s", "_ended")}}


def settled(s: Served, timeout_s: float = 30.0) -> dict[str, int]:
    """held(s) once nothing is held (or as it stands after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while any((now := held(s)).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


async def leave(s: Served, path: str, body: dict, after_s: float, cancel: bool) -> None:
    """A client that sends its request and goes away after_s later: its connection closes (cancel False), or the
    server cancels the request's task (cancel True: a server shutting down, or Starlette's stream on a disconnect)."""
    receive, left = request_then_disconnect(json.dumps(body).encode())

    async def send(_: dict) -> None:
        pass

    task = asyncio.create_task(s.app(asgi_scope(path, []), receive, send))
    await asyncio.sleep(after_s)
    task.cancel() if cancel else left.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


WHOLE = [
    ("/v1/completions", {"prompt": ["hello", "bye"], "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 3,
                         "logprobs": 2, "stop": ["x"], "repetition_penalty": 1.2}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 8, "stream": True, "allowed_token_ids": [50, 51, 52],
                         "presence_penalty": 0.5}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 8, "echo": True, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "stream": True, "n": 2, "temperature": 1.0}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 8}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 8, "stream": True}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 8}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 8, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "use_beam_search": True, "n": 2}),
]
REFUSED = [  # (each a 400: by the checks, or by the engine as it came to add it)
    ("/v1/completions", {"prompt": ["hello", "x" * 3000], "max_tokens": 8}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "structured_outputs": {"regex": "(("}}),
    ("/v1/completions", {"prompt": ["hi", "bye"], "max_tokens": 8, "n": 2, "temperature": 1.0,
                         "structured_outputs": {"json": {"type": "object", "properties": {"a": 7}}}}),
]


def test_requests_that_end_every_way_leave_nothing_behind(served):
    assert not any(held(served).values())
    for _ in range(2):
        for path, body in WHOLE:
            r = served.post(path, {"model": "m", **body})
            assert r.status_code == 200, (path, r.text)
        for path, body in REFUSED:
            r = served.post(path, {"model": "m", **body})
            assert r.status_code == 400, (path, r.text)
    assert settled(served) == dict.fromkeys(held(served), 0)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello", "n": 2, "temperature": 1.0, "frequency_penalty": 0.3}),
    ("/v1/completions", {"prompt": "hello", "structured_outputs": {"regex": "[a-z ]{1000,3000}"}}),  # (no EOS early)
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "temperature": 1.0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/messages", {"messages": CHAT}),
])
def test_requests_whose_clients_leave_leave_nothing_behind(served, path, body, monkeypatch):
    aborted = []
    abort = served.client.abort
    monkeypatch.setattr(served.client, "abort", lambda rid: aborted.append(rid) or abort(rid))
    for stream in (False, True):
        for cancel in (False, True):
            for after_s in (0.0, 0.05, 0.3):
                fields = {"max_output_tokens": 1500} if path == "/v1/responses" else {"max_tokens": 1500}
                if "structured_outputs" not in body:  # (a grammar ends where it allows the EOS: ignore_eos is refused)
                    fields["ignore_eos"] = True
                served.call(leave(served, path, {"model": "m", **body, **fields, "stream": stream}, after_s, cancel))
    assert len(aborted) >= 4  # (many left while their requests ran)
    assert settled(served) == dict.fromkeys(held(served), 0)
