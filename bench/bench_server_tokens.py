"""The HTTP front end's per-token cost, on CPU: N streaming requests through the real app (create_app, its middleware
and routes, called over ASGI in process, as uvicorn calls it) fed by a fake engine that sends one token to every open
stream per step, the next step once the server has taken the last (an engine faster than the server, as a 256-stream
batch at ~3 ms a step is). What the server does per token is all here: the update's hand-off through the request's
queue, metrics, the chunk's dict and JSON, SSE, the response's send through the middleware (not uvicorn's HTTP
writing, nor the pipe's reader thread: each step's updates are unpickled here, as EngineClient's reader does).

    PYTHONPATH=. python bench/bench_server_tokens.py --streams 1 64 256 --tokens 256 --api chat
    PYTHONPATH=. python bench/bench_server_tokens.py --streams 256 --profile prof.out   # cProfile of the run
    PYTHONPATH=. python bench/bench_server_tokens.py --http    # through uvicorn on localhost (its HTTP writes too)

Reports, per N: tokens/s (wall, steady decode only: from the first step to the last stream's end), and the server's
CPU time per token (the process's CPU time over that span, less the fake engine's own time making the updates), whose
inverse is the front end's ceiling on one core (the event loop thread's CPU time: wall time on a shared machine
counts others' turns too). Detokenization and stop strings run in the engine (StepUpdate.text
comes decoded), so they are not here; the tokenizer is used for logprobs' token texts and bytes (--logprobs).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pickle
import statistics
import time
from pathlib import Path

from tpgraph.chat import ChatTemplate, GenerationDefaults
from tpgraph.engine.sampling_params import MAX_LOGPROBS
from tpgraph.engine.updates import StepUpdate
from tpgraph.prompts import PromptCodec
from tpgraph.server.app import create_app
from tpgraph.server.frontend import freeze_startup_heap
from tpgraph.server.metrics import ServerMetrics
from tpgraph.tokenizer import BOS, EOS, builtin_tokenizer, load_tokenizer

# each token's text: the built-in tokenizer's ids are bytes, so a token is one printable byte
PIECES = [(t, chr(t)) for t in range(97, 123)]


class CountingMetrics(ServerMetrics):
    """ServerMetrics that also counts the updates the server has taken from its queues (Api.run observes each as it
    takes it, then formats and sends its chunk before it waits again)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0
        self.wanted = 0
        self.caught_up = asyncio.Event()

    def observe(self, update: StepUpdate, now: float | None = None) -> None:
        super().observe(update, now)
        self.taken += 1
        if self.taken >= self.wanted:
            self.caught_up.set()


class FakeEngine:
    """EngineClient's interface: every open request gets a token per step; its last ends it ("length")."""

    alive, error, closing = True, None, False

    def __init__(self, metrics: CountingMetrics, tokens: int, logprobs: int | None, streams: int) -> None:
        self.metrics, self.tokens, self.logprobs, self.streams = metrics, tokens, logprobs, streams
        self.sinks: dict[str, object] = {}
        self.sent: dict[str, int] = {}
        self.engine_s = 0.0  # (time making the updates and pickling them: the engine process's in production)
        self.started_at: float | None = None
        self.cpu_at: float | None = None
        self.all_in = asyncio.Event()

    def attach(self, loop) -> None:
        pass

    def check(self, prompt, params) -> None:
        pass

    def submit(self, request_id, prompt, params, sink) -> None:
        self.sinks[request_id], self.sent[request_id] = sink, 0
        if len(self.sinks) == self.streams:
            self.all_in.set()

    def abort(self, request_id) -> None:
        self.sinks.pop(request_id, None)

    def release(self, request_id) -> None:
        self.sinks.pop(request_id, None)

    async def engine_metrics(self) -> bytes:
        return b""

    def _step(self) -> bytes:
        batch = []
        for rid in list(self.sinks):
            k = self.sent[rid]
            token, text = PIECES[k % len(PIECES)]
            u = StepUpdate(rid, 0, token, text, "length" if k + 1 == self.tokens else None)
            if self.logprobs is not None:
                u.logprob, u.rank = -0.25, 1
                u.top_logprobs = [(t, -0.25 - j) for j, (t, _) in enumerate(PIECES[:self.logprobs])]
            if k == 0:
                u.cached_tokens, u.queue_s, u.prefill_s = 0, 0.001, 0.002
            self.sent[rid] = k + 1
            batch.append(u)
        return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)

    async def run(self) -> None:
        await self.all_in.wait()
        self.started_at, self.cpu_at = time.perf_counter(), time.thread_time()
        while self.sinks:
            t0 = time.thread_time()  # (CPU time: on a shared machine, wall time here counts others' turns too)
            data = self._step()
            self.engine_s += time.thread_time() - t0
            batch = pickle.loads(data)  # (EngineClient's reader thread: the front end's)
            self.metrics.wanted += len(batch)
            self.metrics.caught_up.clear()
            for u in batch:  # (EngineClient._dispatch)
                sink = self.sinks.get(u.request_id)
                if sink is not None:
                    sink(u)
            if self.metrics.taken < self.metrics.wanted:
                await self.metrics.caught_up.wait()


def codec(tokenizer_dir: str | None) -> PromptCodec:
    tokenizer = builtin_tokenizer() if tokenizer_dir is None else load_tokenizer(tokenizer_dir, 0)
    eos = tokenizer.token_to_id(EOS)
    return PromptCodec(tokenizer, ChatTemplate.from_dir(None, BOS), GenerationDefaults(), "m",
                       () if eos is None else (eos,), {"bos_token": BOS, "eos_token": EOS})


def request_body(api: str, tokens: int, logprobs: int | None, usage: bool) -> tuple[str, bytes]:
    body: dict = {"model": "m", "max_tokens": tokens, "stream": True, "temperature": 0.0}
    if api == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "hello there"}]
        if logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, logprobs
    else:
        path = "/v1/completions"
        body["prompt"] = "hello there"
        if logprobs is not None:
            body["logprobs"] = logprobs
    if usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return path, json.dumps(body).encode()


async def one_stream(app, path: str, body: bytes, out: list[int]) -> None:
    """A streaming request over ASGI, as uvicorn makes it: its body, then a receive that waits (the client stays)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    stay = asyncio.Event()

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await stay.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
        elif message["type"] == "http.response.body":
            out[0] += 1
            out[1] += len(message.get("body", b""))

    await app(scope, receive, send)


async def run_once(streams: int, tokens: int, api: str, logprobs: int | None, usage: bool,
                   tokenizer_dir: str | None) -> dict:
    metrics = CountingMetrics()
    engine = FakeEngine(metrics, tokens, logprobs, streams)
    app = create_app(engine, codec(tokenizer_dir), metrics, "m", 1 << 16)
    path, body = request_body(api, tokens, logprobs, usage)
    counts = [[0, 0] for _ in range(streams)]
    stepping = asyncio.create_task(engine.run())
    await asyncio.gather(*(one_stream(app, path, body, counts[i]) for i in range(streams)))
    wall, cpu = time.perf_counter() - engine.started_at, time.thread_time() - engine.cpu_at
    await stepping
    n = streams * tokens
    server_cpu = cpu - engine.engine_s
    return {"streams": streams, "tokens": n, "wall_s": wall, "tokens_per_s": n / wall,
            "server_cpu_us_per_token": 1e6 * server_cpu / n, "ceiling_tokens_per_s": n / server_cpu,
            "engine_us_per_token": 1e6 * engine.engine_s / n, "chunks": sum(c[0] for c in counts),
            "bytes": sum(c[1] for c in counts)}


# --http's client, a process of its own: N connections, each a POST, read (and dropped) until [DONE]
HTTP_CLIENT = r"""
import selectors, socket, sys
host, port, n, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
body = sys.stdin.buffer.read()
head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
sel, tails, total = selectors.DefaultSelector(), {}, 0
for _ in range(n):
    s = socket.create_connection((host, port))
    s.sendall(head.encode() + body)
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
    tails[s] = b""
while tails:
    for key, _ in sel.select():
        s = key.fileobj
        data = s.recv(1 << 20)
        total += len(data)
        tail = tails[s] + data
        if not data or b"data: [DONE]" in tail:
            sel.unregister(s)
            s.close()
            del tails[s]
        else:
            tails[s] = tail[-32:]
print(total)
"""


async def run_once_http(streams: int, tokens: int, api: str, logprobs: int | None, usage: bool,
                        tokenizer_dir: str | None) -> dict:
    """run_once through uvicorn (as the front end runs it, with whatever HTTP parser this environment gives it) on
    localhost, its client another process: uvicorn's own cost per chunk (parsing, chunked writes) counted too."""
    import socket
    import sys

    import uvicorn

    metrics = CountingMetrics()
    engine = FakeEngine(metrics, tokens, logprobs, streams)
    app = create_app(engine, codec(tokenizer_dir), metrics, "m", 1 << 16)
    path, body = request_body(api, tokens, logprobs, usage)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    stepping = asyncio.create_task(engine.run())
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", HTTP_CLIENT, "127.0.0.1",
                                                  str(sock.getsockname()[1]), str(streams), path,
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    out, _ = await client.communicate(body)
    wall, cpu = time.perf_counter() - engine.started_at, time.thread_time() - engine.cpu_at
    await stepping
    server.should_exit = True
    await serving
    n = streams * tokens
    server_cpu = cpu - engine.engine_s
    return {"streams": streams, "tokens": n, "wall_s": wall, "tokens_per_s": n / wall,
            "server_cpu_us_per_token": 1e6 * server_cpu / n, "ceiling_tokens_per_s": n / server_cpu,
            "engine_us_per_token": 1e6 * engine.engine_s / n, "chunks": n, "bytes": int(out)}


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any run, what would fail inside one (a stream's 400) or after it (no runs to take a median of)."""
    if min(args.streams) < 1:
        p.error(f"--streams must be at least 1 each, got {args.streams}")
    for flag, value in (("--tokens", args.tokens), ("--repeat", args.repeat)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if args.min_total < 0:
        p.error(f"--min-total must be at least 0, got {args.min_total}")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:  # (the server's limit: a 400 past it)
        p.error(f"--logprobs must be between 0 and {MAX_LOGPROBS}, got {args.logprobs}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream (at least --min-total over all streams)")
    p.add_argument("--min-total", type=int, default=16384, help="tokens over all streams, at least (a timed span "
                   "long enough to read: N=1 at 256 tokens timed ~10 ms)")
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs asked per token")
    p.add_argument("--usage", action="store_true", help="stream_options: include_usage, continuous_usage_stats")
    p.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json (default: the built-in one)")
    p.add_argument("--repeat", type=int, default=3, help="runs per N (the median is reported)")
    p.add_argument("--profile", default=None, help="write a cProfile of one run of the largest N here")
    p.add_argument("--http", action="store_true", help="through uvicorn on localhost, the client another process")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    check_args(p, args)
    results = []
    run_once_ = run_once_http if args.http else run_once
    asyncio.run(run_once_(8, 16, args.api, args.logprobs, args.usage, args.tokenizer))  # (warm-up: first-use costs)
    freeze_startup_heap()  # (as the front end's process does before it serves)
    for n in args.streams:
        tokens = max(args.tokens, -(-args.min_total // n))
        runs = [asyncio.run(run_once_(n, tokens, args.api, args.logprobs, args.usage, args.tokenizer))
                for _ in range(args.repeat)]
        med = sorted(runs, key=lambda r: r["server_cpu_us_per_token"])[len(runs) // 2]
        spread = [round(r["server_cpu_us_per_token"], 1) for r in runs]
        results.append({**med, "runs_us_per_token": spread})
        print(f"N={n:4d}  {med['tokens_per_s']:9.0f} tok/s wall  server CPU {med['server_cpu_us_per_token']:6.1f} "
              f"us/token (runs {spread}; median {statistics.median(spread):.1f})  ceiling "
              f"{med['ceiling_tokens_per_s']:8.0f} tok/s  ({med['bytes'] / med['tokens']:.0f} B/token)", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(run_once_(max(args.streams), args.tokens, args.api, args.logprobs, args.usage, args.tokenizer))
        prof.disable()
        prof.dump_stats(args.profile)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
