"""The HTTP front end as its own process (see bridge.py for why): rank 0 starts it, or several (--api-server-count),
with `start_frontends`, and each runs FastAPI + uvicorn on the sockets rank 0 bound (listeners.py) until the engine's
end of its pipe closes, or until it is told to stop (SIGTERM, Ctrl-C). It says ("ready",) over the pipe once uvicorn
serves; if it cannot, it exits non-zero."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from tpgraph.engine.limits import RequestLimits
from tpgraph.prompts import PromptCodec
from tpgraph.server.listeners import bind_private, close_sockets, private_socket_path
from tpgraph.server.options import HttpOptions
from tpgraph.server.reasoning import ReasoningParser
from tpgraph.server.tools import ToolOptions

if TYPE_CHECKING:  # (the front end's process imports the server's modules itself, once it runs)
    import uvicorn

    from tpgraph.server.bridge import EngineClient

logger = logging.getLogger("tpgraph.serve")
STARTUP_FAILURE = 3  # (uvicorn's exit code for a server that could not start)
EXIT_GRACE_S = 3.0  # after the engine is gone, streams still open get this long to hear it before the process ends


@dataclass
class FrontendSpec:
    """Everything the front end needs, picklable: where it listens (rank 0 binds the sockets, listeners.py: host and
    port name them in uvicorn's log), what to call the model, how to check and encode."""

    host: str
    port: int
    model_name: str
    max_model_len: int
    limits: RequestLimits
    prompts: PromptCodec
    # (one key or several; the spec travels through a pipe to the spawned front end, never in its argv)
    api_key: str | tuple[str, ...] | None = None
    tool_options: ToolOptions = field(default_factory=ToolOptions)
    reasoning: ReasoningParser | None = None  # (checked against the tokenizer: ReasoningParser.for_tokenizer)
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)
    request_id_headers: bool = False  # every response carries X-Request-Id (--enable-request-id-headers)
    http: HttpOptions = field(default_factory=HttpOptions)  # CORS, ... (options.py)
    # every name a request may give, model_name first (vLLM's several --served-model-name); () for model_name alone
    served_names: tuple[str, ...] = ()
    model_root: str | None = None  # the --model the names stand for (/v1/models' root, as vLLM's); None: model_name
    # several front ends (--api-server-count): this one's index and their number. With more than one, their
    # request-level metrics go through prometheus-client's multiprocess mode in metrics_dir (any front end's /metrics
    # then reports them all), and the Responses API's requests all go to front end 0, which alone keeps the store:
    # it also listens on the Unix socket responses_uds, and the others relay those requests there
    index: int = 0
    count: int = 1
    metrics_dir: str | None = None
    responses_uds: str | None = None


def start_frontend(spec: FrontendSpec, sockets: list[socket.socket],
                   private: socket.socket | None = None) -> tuple[BaseProcess, Connection]:
    """Start a front-end process serving `sockets` (bound: server/listeners.py), and front end 0 of several the other
    front ends' relays on `private` (at spec.responses_uds); returns it and the engine's end of the pipe."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA context, no process group, no engine threads
    engine_end, frontend_end = ctx.Pipe(duplex=True)
    # (the sockets travel as the pipe's end does: duplicated into the new process as it starts)
    proc = ctx.Process(target=run_frontend, args=(frontend_end, spec, sockets, private), daemon=True,
                       name="tpgraph-http" if spec.count == 1 else f"tpgraph-http-{spec.index}")
    proc.start()
    frontend_end.close()
    return proc, engine_end


def start_frontends(spec: FrontendSpec, sockets: list[list[socket.socket]],
                    scratch: str | None) -> list[tuple[BaseProcess, Connection]]:
    """Start a front end (--api-server-count of them) for each entry of `sockets` (listeners.front_end_sockets), each
    serving that entry's sockets, each with its pipe; this process's copies of the sockets are closed then. With more
    than one, `scratch` (an empty directory, which outlives them) holds their shared metrics and front end 0's private
    socket for the Responses API (FrontendSpec)."""
    private: socket.socket | None = None
    try:
        if (count := len(sockets)) > 1:
            assert scratch is not None, "several front ends share a scratch directory"
            metrics_dir, responses_uds = os.path.join(scratch, "metrics"), private_socket_path(scratch)
            os.mkdir(metrics_dir)
            private = bind_private(responses_uds)
            # (listening now: a request the others relay before front end 0 serves waits in the backlog, not refused)
            private.listen()
            spec = replace(spec, count=count, metrics_dir=metrics_dir, responses_uds=responses_uds)
        return [start_frontend(replace(spec, index=i), each, private if i == 0 else None)
                for i, each in enumerate(sockets)]
    finally:
        # (one socket shared by several front ends, a Unix socket's, is closed again: a no-op)
        close_sockets([sock for each in sockets for sock in each] + ([] if private is None else [private]))


def freeze_startup_heap() -> None:
    """Move what startup left alive (the imported modules: FastAPI's, pydantic's, ...) out of the garbage collector's
    sight, its garbage collected first. Each full collection walked them all while serving: with torch's too, as a
    front end held them once, ~100 ms that stalled every stream, ~8 us a streamed token at 256 streams
    (bench/bench_server_tokens.py)."""
    gc.collect()
    gc.freeze()


def share_metrics_in(metrics_dir: str | None) -> None:
    """Where several front ends share their request metrics (FrontendSpec.metrics_dir), name the directory to
    prometheus-client before this process imports it: it reads PROMETHEUS_MULTIPROC_DIR once, as it is imported, to
    choose where every metric's values live (ServerMetrics refuses to start where it was imported first)."""
    if metrics_dir is not None:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # (metrics.MULTIPROC_DIR_ENV: that module imports it)


def run_frontend(conn: Connection, spec: FrontendSpec, sockets: list[socket.socket],
                 private: socket.socket | None = None) -> None:
    share_metrics_in(spec.metrics_dir)  # (first: the imports below import prometheus_client)
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            try:
                await super().startup(sockets)  # listens on the sockets rank 0 bound
                if private is not None and self.started:
                    await self._serve_plain(private)
            except OSError as exc:  # (another server listens there since: one that binds with SO_REUSEADDR can)
                logger.error("cannot listen on the address: %s", exc)
                await self.lifespan.shutdown()
                sys.exit(STARTUP_FAILURE)  # (as uvicorn exits where it cannot bind)
            if self.started and spec.index == 0:  # (uvicorn says where it runs only for sockets it bound itself)
                self._log_started_message(sockets)
            if self.started:  # rank 0 says "serving" only now: a client that reads it and connects gets in
                client.listening()

        async def _serve_plain(self, sock: socket.socket) -> None:
            """Serve front end 0's private socket for the other front ends' relays in plain HTTP, HTTPS or not (the
            client's TLS ends at the front end it reached; the relay speaks plain HTTP), as uvicorn serves the rest."""
            config = self.config

            def protocol() -> asyncio.Protocol:
                return config.http_protocol_class(config=config, server_state=self.server_state,
                                                  app_state=self.lifespan.state)

            self.servers.append(await asyncio.get_running_loop().create_server(protocol, sock=sock,
                                                                               backlog=config.backlog))

    from tpgraph.server.app import create_app
    from tpgraph.server.bridge import EngineClient
    from tpgraph.server.logs import configure_logging
    from tpgraph.server.metrics import ServerMetrics

    configure_logging(spec.http.server_log_config)  # (as rank 0's; uvicorn's own, log_config, is uvicorn's)
    server: Server | None = None

    def engine_gone() -> None:
        if client.closing:
            logger.info("the engine is stopping; so does the HTTP server")
        else:
            logger.error("the engine is gone; the HTTP server stops")
        if server is not None:
            server.should_exit = True
        # a backstop, should uvicorn's stop hang; a daemon, so that it does not hold up (and fail) the exit that
        # follows a stop in time (it ended every stop 3 s late with exit code 1, and rank 0 killed it before that)
        timer = threading.Timer(EXIT_GRACE_S, os._exit, (1,))
        timer.daemon = True
        timer.start()

    client = EngineClient(conn, spec.limits, on_lost=engine_gone)
    # (its token histograms reach max_model_len)
    metrics = ServerMetrics(spec.model_name, spec.max_model_len, multiprocess_dir=spec.metrics_dir)
    app = create_app(client, spec.prompts, metrics, spec.model_name, spec.max_model_len, spec.api_key,
                     spec.tool_options, spec.reasoning, spec.prompt_tokens_details, spec.request_id_headers, spec.http,
                     spec.served_names, spec.model_root,
                     relay_uds=spec.responses_uds if spec.index > 0 else None)  # (front end 0 keeps the store)
    try:
        server = Server(uvicorn_config(app, spec))
    except (ValueError, TypeError, AttributeError, ImportError) as exc:  # (log_config's, which dictConfig refused)
        logger.error("the logging configuration file (--log-config-file, VLLM_LOGGING_CONFIG_PATH) is none uvicorn's "
                     "dictConfig takes: %s", exc)
        sys.exit(1)
    # uvicorn raises the signal it stopped for again once it has stopped: Ctrl-C as KeyboardInterrupt, SIGTERM by
    # its default action (killed by it: exit code -15, which rank 0 takes for a failure); either is a clean stop,
    # unless the engine went away unannounced
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(exit_code(client)))
    freeze_startup_heap()
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=sockets)
    sys.exit(exit_code(client))


def uvicorn_config(app: object, spec: FrontendSpec) -> uvicorn.Config:
    """uvicorn's settings: the address it names (it serves the sockets it is given), what to log (and how),
    keep-alive and HTTPS (HttpOptions)."""
    import uvicorn

    http = spec.http
    # (a logging configuration file configures uvicorn's loggers too, as vLLM's; else uvicorn's own)
    logs = {} if http.log_config is None else {"log_config": http.log_config}
    return uvicorn.Config(app, host=spec.host, port=spec.port, uds=http.uds, log_level=http.uvicorn_log_level,
                          access_log=http.access_log, timeout_keep_alive=http.keep_alive_s,
                          ssl_keyfile=http.ssl_keyfile, ssl_certfile=http.ssl_certfile,
                          ssl_ca_certs=http.ssl_ca_certs, ssl_cert_reqs=http.ssl_cert_reqs, **logs)


def exit_code(client: EngineClient) -> int:
    """1 where the engine went away unannounced, else 0 (a clean stop)."""
    return 1 if client.error is not None and not client.closing else 0
