"""The HTTP front ends' streaming capacity against their number (--api-server-count), on CPU: a fake engine in this
process drives the real front ends (start_frontends: uvicorn processes on one address, bound as tpgraph.serve binds
it, each with its pipe to a real EngineBridge here), and client processes read the streams over real HTTP connections.

The fake engine models a decode batch: every --step-ms it sends one token (one printable byte of the built-in
tokenizer, a StepUpdate as the engine makes it) to every open request, through the bridge's sinks, and finishes each
after --tokens ("length"). Its offered rate is streams x 1000/step-ms tokens/s; the front ends keep up with it, or
the tokens they receive fall behind it (the received/offered ratio). --step-ms 0 steps as fast as it can: the front
ends' own ceiling. The clients (--client-procs processes, raw asyncio sockets, no HTTP library) connect, wait for each
other, then all post their --streams requests at once; each stream must receive every token.

    PYTHONPATH=. python bench/bench_api_servers.py --api-server-counts 1,2,4,8 --streams 256 --tokens 512
    PYTHONPATH=. python bench/bench_api_servers.py --api-server-counts 1,2,4 --step-ms 0 --api chat --plot asc.png
    PYTHONPATH=. python bench/bench_api_servers.py --api-server-counts 1,2 --streams 64 --out asc.json

Reports, per count: tokens/s received over the steady span (from the moment every stream has its first token to the
moment the first stream ends), the offered rate, their ratio, the front ends' CPU time per token received (utime +
stime of every front-end process over the run, from /proc, summed), the busiest front end's CPU utilisation (100% is
a core: the GIL's ceiling), the busiest client process's utilisation (near 100% the clients, not the front ends,
were the bottleneck), what the fake engine itself sent a second over the span (engine/s: below the offered rate, it
could not hold its step), and how the kernel spread the streams over the front ends (a socket each, SO_REUSEPORT:
listeners.front_end_sockets).
The fake engine's thread and the bridge's pickling share this process's GIL: on a small machine they compete with the
front ends and the clients for cores, so read capacity on a machine with a core for each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

# (the heavy imports, tpgraph's and torch through it, are inside the functions that run in this process: the client
# processes import this module as they spawn, and need only the standard library)

HOST = "127.0.0.1"
MODEL = "m"
BIN_S = 0.005  # the clients count the tokens they receive in bins of this many seconds (the steady span's grain)
WARM_TOKENS = 4  # a first round of this many tokens a stream, not measured: every front end's first-use costs
READY_S = 120.0  # every front end listening within this, or the point fails
PIECES = [(t, chr(t)) for t in range(97, 123)]  # each token's text: the built-in tokenizer's ids are bytes


class FakeEngine:
    """EngineService as the bridge calls it (compiles, precompile, enqueue, enqueue_abort), and a step thread that,
    every step_s (0: at once), sends each open request its next token through its sink: a batch, every request
    advancing once a step. A request ends after `tokens` tokens (or its max_tokens, if fewer)."""

    def __init__(self, tokens: int, step_s: float) -> None:
        from tpgraph.engine.updates import StepUpdate

        self.tokens, self.step_s, self._update = tokens, step_s, StepUpdate
        self._open: dict[str, list] = {}  # request id -> [sink, tokens sent, tokens it gets]
        self._wake = threading.Condition()
        self._stopped = False
        self.steps: list[tuple[float, int]] = []  # (when, updates sent) of each step
        self.per_pipe: Counter = Counter()  # requests by the bridge's queue they reply through: one per front end
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)

    def compiles(self, params) -> bool:
        return False

    def precompile(self, params) -> None:
        pass

    def enqueue(self, request_id: str, prompt_ids: list[int], params, sink: Callable) -> None:
        wanted = self.tokens if params.max_tokens is None else min(self.tokens, params.max_tokens)
        with self._wake:
            self._open[request_id] = [sink, 0, wanted]
            self.per_pipe[id(getattr(sink, "__self__", sink))] += 1  # (the sink is its pipe's queue's put)
            self._wake.notify()

    def enqueue_abort(self, request_id: str) -> None:
        with self._wake:
            self._open.pop(request_id, None)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(5)

    def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            with self._wake:  # (idle, it waits for a request rather than spin)
                while not self._open and not self._stopped:
                    self._wake.wait()
                    next_at = time.monotonic()
                if self._stopped:
                    return
            self._step()
            if self.step_s:
                next_at += self.step_s
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:  # a late step: the next one a step after it, as a batch that ran long (no burst to catch up)
                    next_at = time.monotonic()

    def _step(self) -> None:
        with self._wake:
            batch = list(self._open.items())
            for request_id, entry in batch:
                entry[1] += 1
                if entry[1] >= entry[2]:
                    del self._open[request_id]
        self.steps.append((time.monotonic(), len(batch)))
        for request_id, (sink, sent, wanted) in batch:
            token, text = PIECES[(sent - 1) % len(PIECES)]
            update = self._update(request_id, 0, token, text, "length" if sent >= wanted else None)
            if sent == 1:
                update.cached_tokens, update.queue_s, update.prefill_s = 0, 0.0, 0.0
            sink(update)


# ---------------------------------------------------------------------------------------------------------- clients

def request_body(api: str, tokens: int) -> tuple[str, bytes]:
    body: dict = {"model": MODEL, "max_tokens": tokens, "stream": True, "temperature": 0.0}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": "hello there"}]
        return "/v1/chat/completions", json.dumps(body).encode()
    body["prompt"] = "hello there"
    return "/v1/completions", json.dumps(body).encode()


def carries_token(event: bytes, api: str) -> bool:
    """Whether an SSE event is a chunk with a token's text (not the chat's first, role-only, chunk, a finish-only
    chunk, usage or [DONE]): its text or delta content is a string and not empty (json.dumps's separators)."""
    key = b'"content": "' if api == "chat" else b'"text": "'
    at = event.find(key)
    return at >= 0 and event[at + len(key):at + len(key) + 1] != b'"'


@dataclass
class StreamResult:
    tokens: int = 0
    first_at: float = math.inf  # (time.monotonic: one clock for every process of this host)
    last_at: float = 0.0
    done: bool = False


@dataclass
class ClientRound:
    """One client process's round: its streams and the tokens its streams received, binned by arrival time."""

    streams: list[StreamResult] = field(default_factory=list)
    bins: Counter = field(default_factory=Counter)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    error: str | None = None


async def read_stream(reader: asyncio.StreamReader, api: str, out: StreamResult, bins: Counter) -> None:
    """A streaming response: its head (200, or the error), then its chunked body, counting token events as they come,
    until [DONE] or the last chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {head.decode(errors='replace')}"
                           f"{(await reader.read(2000)).decode(errors='replace')}")
    if b"transfer-encoding: chunked" not in head.lower():
        raise RuntimeError(f"a streamed response should be chunked: {head.decode(errors='replace')}")
    raw, sse = b"", b""
    while not out.done:
        data = await reader.read(1 << 16)
        if not data:
            raise RuntimeError("the server closed the stream before its end")
        now = time.monotonic()
        raw += data
        while True:  # the whole chunks so far: "<size hex>\r\n<payload>\r\n"
            eol = raw.find(b"\r\n")
            if eol < 0:
                break
            size = int(raw[:eol].split(b";", 1)[0], 16)
            if len(raw) < eol + 2 + size + 2:
                break
            sse += raw[eol + 2:eol + 2 + size]
            raw = raw[eol + 2 + size + 2:]
            if size == 0:
                out.done = True
        *events, sse = sse.split(b"\n\n")
        got = sum(carries_token(e, api) for e in events)
        if any(e == b"data: [DONE]" for e in events):
            out.done = True
        if got:
            out.tokens += got
            out.first_at, out.last_at = min(out.first_at, now), now
            bins[int(now / BIN_S)] += got


async def client_round(port: int, path: str, body: bytes, api: str, streams: int, barrier) -> ClientRound:
    """Connect every stream, wait at the barrier for every other client process (and the bench), then post them all
    at once and read them to their ends."""
    result = ClientRound(streams=[StreamResult() for _ in range(streams)])
    conns = [await asyncio.open_connection(HOST, port) for _ in range(streams)]
    request = (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
    wall0, cpu0 = time.monotonic(), time.process_time()
    for _, writer in conns:
        writer.write(request)

    async def one(i: int) -> None:
        reader, writer = conns[i]
        try:
            await read_stream(reader, api, result.streams[i], result.bins)
        finally:
            writer.close()

    outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    result.wall_s, result.cpu_s = time.monotonic() - wall0, time.process_time() - cpu0
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    if failed:
        result.error = f"{len(failed)} of {streams} streams failed; the first: {failed[0]!r}"
    return result


def client_process(conn: Connection, port: int, api: str, streams: int, rounds: list[int], barrier) -> None:
    """A client process: for each round (its tokens a stream), a client_round, whose result goes back by `conn`."""
    for tokens in rounds:
        path, body = request_body(api, tokens)
        try:
            result = asyncio.run(client_round(port, path, body, api, streams, barrier))
        except Exception as exc:  # noqa: BLE001 - told to the bench, which says it (a hang otherwise)
            result = ClientRound(error=repr(exc))
            barrier.abort()
        conn.send(result)
        if result.error:  # (the bench stops at the first failed round)
            break
    conn.close()


# ------------------------------------------------------------------------------------------------------ one point

def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far, all its threads: utime + stime from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # (after the command's name, which may hold spaces)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal shares (none empty)."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def steady_rate(rounds: list[ClientRound]) -> tuple[float, float, float, int]:
    """Tokens/s received over the steady span, from the latest first token to the earliest last one (whole bins
    within it); where that span holds fewer than two bins, over the whole run. Returns (rate, start, end, tokens)."""
    streams = [s for r in rounds for s in r.streams]
    bins: Counter = Counter()
    for r in rounds:
        bins.update(r.bins)
    start, end = max(s.first_at for s in streams), min(s.last_at for s in streams)
    first, last = math.ceil(start / BIN_S), math.floor(end / BIN_S)  # (bins [first, last) lie wholly inside)
    if last - first < 2:
        start, end = min(s.first_at for s in streams), max(s.last_at for s in streams)
        first, last = math.floor(start / BIN_S), math.floor(end / BIN_S) + 1
    tokens = sum(n for b, n in bins.items() if first <= b < last)
    return tokens / ((last - first) * BIN_S), first * BIN_S, last * BIN_S, tokens


def spec_for(port: int, tokens: int, access_log: bool):
    from bench_server_tokens import codec  # (the built-in tokenizer's, its model named "m": MODEL)

    from tpgraph.engine.limits import RequestLimits
    from tpgraph.server.frontend import FrontendSpec
    from tpgraph.server.options import HttpOptions

    prompts = codec(None)
    max_model_len = tokens + 1024  # (room for the prompt, chat template and all)
    limits = RequestLimits(prompts.tokenizer.get_vocab_size(), max_model_len, max_model_len)
    http = HttpOptions(uvicorn_log_level="info" if access_log else "warning", access_log=access_log)
    return FrontendSpec(HOST, port, MODEL, max_model_len, limits, prompts, http=http)


def run_point(count: int, streams: int, tokens: int, step_ms: float, api: str, client_procs: int,
              access_log: bool = False) -> dict:
    """`count` front ends, `streams` streams of `tokens` tokens from the fake engine: a warm-up round, then the
    measured one. Everything started here is stopped before it returns."""
    from tpgraph.server.bridge import EngineBridge
    from tpgraph.server.frontend import start_frontends
    from tpgraph.server.listeners import front_end_sockets

    engine = FakeEngine(tokens, step_ms / 1000.0)
    sockets = front_end_sockets(HOST, 0, None, count)  # (as tpgraph.serve binds them)
    port = sockets[0][0].getsockname()[1]
    scratch = tempfile.TemporaryDirectory(prefix="tpg-asc-") if count > 1 else None
    fronts = start_frontends(spec_for(port, tokens, access_log), sockets,
                             None if scratch is None else scratch.name)
    ready, closed = threading.Event(), threading.Event()
    bridge = EngineBridge(engine, [c for _, c in fronts], lambda: b"", on_closed=closed.set, on_ready=ready.set,
                          compile_threads=1)
    ctx = mp.get_context("spawn")
    clients: list = []
    try:
        bridge.start()
        engine.start()
        deadline = time.monotonic() + READY_S
        while not ready.wait(0.1):
            if closed.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"the front ends did not all start (exit codes {[p.exitcode for p, _ in fronts]})")
        shares = split(streams, client_procs)
        barrier = ctx.Barrier(len(shares) + 1)
        for share in shares:
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=client_process, args=(theirs, port, api, share, [WARM_TOKENS, tokens], barrier),
                               daemon=True)
            proc.start()
            theirs.close()
            clients.append((proc, mine))
        measured = None
        for round_ in ("warm-up", "measured"):
            try:
                barrier.wait(READY_S)
            except threading.BrokenBarrierError:  # (a client that could not connect: it says why)
                said = next(filter(None, (conn.recv().error for _, conn in clients if conn.poll(5))), "no reason")
                raise RuntimeError(f"the {round_} round did not start: {said}") from None
            cpu0 = {p.pid: cpu_seconds(p.pid) for p, _ in fronts}
            engine.steps.clear()
            engine.per_pipe.clear()
            results = [conn.recv() for _, conn in clients]
            cpu1 = {p.pid: cpu_seconds(p.pid) for p, _ in fronts}
            errors = [r.error for r in results if r.error]
            if errors:
                raise RuntimeError(f"the {round_} round failed: {errors[0]}")
            measured = (results, cpu0, cpu1)
        results, cpu0, cpu1 = measured
        return summarize(count, streams, tokens, step_ms, api, engine, results, cpu0, cpu1)
    finally:
        for proc, conn in clients:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            conn.close()
        bridge.close()
        engine.stop()
        for proc, _ in fronts:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if scratch is not None:
            scratch.cleanup()


def summarize(count: int, streams: int, tokens: int, step_ms: float, api: str, engine: FakeEngine,
              results: list[ClientRound], cpu0: dict[int, float], cpu1: dict[int, float]) -> dict:
    rate, start, end, steady_tokens = steady_rate(results)
    received = [s.tokens for r in results for s in r.streams]
    wall = max(r.wall_s for r in results)
    front_cpu = {pid: cpu1[pid] - cpu0[pid] for pid in cpu0}
    total = sum(received)
    # the engine's own rate over the same span (with --step-ms 0 the offered rate is what it managed)
    sent = sum(n for at, n in engine.steps if start <= at < end)
    return {
        "api_server_count": count, "streams": streams, "tokens": tokens, "step_ms": step_ms, "api": api,
        "tokens_per_s": rate, "offered_tokens_per_s": streams * 1000.0 / step_ms if step_ms else None,
        "engine_sent_per_s": sent / (end - start),
        "ratio": rate / (streams * 1000.0 / step_ms) if step_ms else None,
        "steady_s": end - start, "steady_tokens": steady_tokens, "wall_s": wall,
        "received_min": min(received), "received_total": total, "all_received": min(received) == tokens,
        "frontend_cpu_s": sorted(front_cpu.values(), reverse=True),
        "frontend_cpu_us_per_token": 1e6 * sum(front_cpu.values()) / total,
        "busiest_frontend_util": max(front_cpu.values()) / wall,
        "client_procs": len(results),
        "busiest_client_util": max(r.cpu_s / r.wall_s for r in results),
        "client_cpu_s": sum(r.cpu_s for r in results),
        "streams_per_frontend": sorted(engine.per_pipe.values(), reverse=True),
        "engine_steps": len(engine.steps),
    }


# ------------------------------------------------------------------------------------------------------------ main

def parse_counts(text: str) -> list[int]:
    counts = [int(c) for c in text.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"front-end counts must be at least 1 each, got {text!r}")
    return counts


def print_table(rows: list[dict]) -> None:
    print(f"{'count':>5} {'streams':>7} {'tok/s recv':>11} {'offered':>9} {'ratio':>6} {'engine/s':>9} "
          f"{'FE us/tok':>9} {'FE max %':>8} {'clients %':>9}  streams per front end")
    for r in rows:
        offered = "max" if r["offered_tokens_per_s"] is None else f"{r['offered_tokens_per_s']:.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['api_server_count']:5d} {r['streams']:7d} {r['tokens_per_s']:11.0f} {offered:>9} {ratio:>6} "
              f"{r['engine_sent_per_s']:9.0f} {r['frontend_cpu_us_per_token']:9.1f} "
              f"{100 * r['busiest_frontend_util']:8.0f} {100 * r['busiest_client_util']:9.0f}  "
              f"{r['streams_per_frontend']}", flush=True)
        if not r["all_received"]:
            print(f"      (a stream received only {r['received_min']} of its {r['tokens']} tokens)", flush=True)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    counts = [r["api_server_count"] for r in rows]
    received = [r["tokens_per_s"] for r in rows]
    offered = [r["offered_tokens_per_s"] for r in rows if r["offered_tokens_per_s"] is not None]
    ax.plot(counts, received, "o-", label="received")
    if offered:
        ax.plot(counts, offered, "--", color="gray", label="offered")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("API server processes (--api-server-count)")
    ax.set_ylabel("streamed tokens/s")
    step = f"step {rows[0]['step_ms']:g} ms" if rows[0]["step_ms"] else "engine as fast as it can"
    ax.set_title(f"{rows[0]['streams']} streams, {rows[0]['api']}, {step}")
    ax.set_ylim(0, 1.15 * max(received + offered))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api-server-counts", type=parse_counts, default=[1, 2, 4], help="comma-separated, e.g. 1,2,4,8")
    p.add_argument("--streams", type=int, default=256, help="concurrent streaming requests")
    p.add_argument("--tokens", type=int, default=256, help="tokens a stream")
    p.add_argument("--step-ms", type=float, default=10.0, help="the fake engine's step (0: as fast as it can)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--access-log", action="store_true", help="uvicorn's access log on, as the server's default")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="plot tokens/s against the count into this image")
    args = p.parse_args(argv)
    for flag, value in (("--streams", args.streams), ("--tokens", args.tokens), ("--client-procs", args.client_procs)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if args.step_ms < 0:
        p.error(f"--step-ms must be at least 0, got {args.step_ms}")
    counts = args.api_server_counts
    points = counts
    if len(counts) > 1:
        from tqdm import tqdm

        points = tqdm(counts, desc="api servers", unit="point")
    rows = [run_point(c, args.streams, args.tokens, args.step_ms, args.api, args.client_procs, args.access_log)
            for c in points]
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {**vars(args), "api_server_counts": counts}, "results": rows},
                                             indent=1))
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
