"""`torchrun --nproc-per-node N -m tpgraph.serve`: an OpenAI-compatible server (FastAPI + uvicorn on rank 0).

    python -m tpgraph.serve                                              # the built-in model, one process, CPU ok
    torchrun --nproc-per-node 2 -m tpgraph.serve DIR --port 8000         # (or --model DIR)
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tpgraph-builtin", "prompt": "Hello", "max_tokens": 16}'

Every rank builds the engine; rank 0 runs the step loop and starts the HTTP front end as its own process (FastAPI +
uvicorn, server/frontend.py), or several on one address (--api-server-count), and the other ranks follow rank 0's
messages.
SIGTERM or Ctrl-C stops the server and every rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
from functools import partial
from multiprocessing.connection import wait as mp_wait
from multiprocessing.process import BaseProcess
from typing import NoReturn

from tpgraph.chat import CONTENT_FORMATS
from tpgraph.config import BUILTIN_MODEL, ModelConfig
from tpgraph.engine.cli import (
    add_engine_args,
    checkpoint_dirs_from_args,
    checkpoint_name,
    dashed_names,
    engine_from_args,
    json_object,
    positive_number,
)
from tpgraph.engine.followers import leave_later_on
from tpgraph.engine.sampling_params import max_n
from tpgraph.errors import ConfigError, TPGraphError
from tpgraph.ranks import PROCESS_GROUP_TIMEOUT_S, env_int
from tpgraph.server.config_file import CONFIG_MODEL_FLAG, expand_config
from tpgraph.server.listeners import ListenPoints, check_private_socket, close_sockets, front_end_sockets
from tpgraph.server.logs import check_environment, configure_logging, logging_config
from tpgraph.server.options import UVICORN_LOG_LEVELS, HttpOptions, check_unix_socket, keep_alive_s
from tpgraph.server.reasoning import PARSERS as REASONING_PARSERS
from tpgraph.server.reasoning import ReasoningParser
from tpgraph.server.response_store import DEFAULT_CAPACITY, DEFAULT_MIB
from tpgraph.server.tool_parsers import PARSERS
from tpgraph.server.tools import ToolOptions
from tpgraph.tokenizer import load_tokenizer

logger = logging.getLogger("tpgraph.serve")
BUILTIN_NAME = "tpgraph-builtin"


class ServeParser(argparse.ArgumentParser):
    """Says what to do about a flag it does not take (a vLLM flag with no setting here), or a word that is no flag (a
    second model), beside argparse's naming it."""

    vllm_subcommand = False  # whether the command line begins with vLLM's `serve` (parse_args says)

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix) and self.vllm_subcommand:  # (`tpgraph-serve serve MODEL`, as `vllm serve MODEL`)
            super().error(SUBCOMMAND)
        if message.startswith(prefix):
            flags = any(word.startswith("-") for word in message[len(prefix):].split())
            message += ("; this server has no such setting (it takes vLLM's flags where it can do what they ask; "
                        "--help lists them): leave it out" if flags else
                        "; the command line takes one MODEL, and every other setting as a flag")
        super().error(message)


SUBCOMMAND = ("`serve` is vLLM's subcommand (vllm serve MODEL); this command is the server itself: give the model "
              "alone (tpgraph-serve MODEL, or python -m tpgraph.serve MODEL)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ServeParser(prog="python -m tpgraph.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", type=checkpoint_name, default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` names it: the same as --model")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="flags from a YAML file (port: 8000, enforce-eager: true, ...), as vLLM's; the command line's "
                        "own override them")
    p.add_argument(CONFIG_MODEL_FLAG, dest="config_model", type=checkpoint_name, default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: %(default)s, this machine alone, where vLLM's listens on "
                        "every interface: 0.0.0.0 serves other machines)")
    p.add_argument("--port", type=port_number, default=8000, help="(default: %(default)s)")
    p.add_argument("--api-server-count", "-asc", type=api_server_count, default=1, metavar="N",
                   help="HTTP front-end processes sharing the address (vLLM's): each takes the connections the kernel "
                        "gives it, for streams past one core's worth of JSON and SSE; the Responses API is served by "
                        "the first, the others relaying to it (default: %(default)s)")
    p.add_argument("--served-model-name", type=served_name, nargs="+", default=None, metavar="NAME",
                   help="the names clients may ask for, replies naming the first (default: --model, or "
                        f"{BUILTIN_NAME})")
    p.add_argument("--api-key", type=api_key, nargs="+", default=None, metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY`, one of the keys given (every route but "
                        "/health, /ping, /metrics, /version and the API docs, /docs, /redoc and /openapi.json); "
                        "default: $TPGRAPH_API_KEY (else vLLM's "
                        "$VLLM_API_KEY), which keeps the key out of the process list")
    p.add_argument("--heartbeat-s", type=heartbeat_seconds, default=1.0,
                   help="idle message interval from rank 0 (default: %(default)s; the other ranks wait for its next "
                        f"message: at most {PROCESS_GROUP_TIMEOUT_S / 2:.0f} s)")
    tools = p.add_argument_group("function calling (vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                       help='serve tool_choice "auto" (the default when a request gives tools), reading the model\'s '
                            "calls with --tool-call-parser")
    tools.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                       help="the model's tool-call format: llama3_json (Llama 3.1-3.3's JSON), pythonic (Llama 3.2 and "
                            "4's [f(a=1)] lists) or hermes (<tool_call> tags)")
    tools.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction, default=False,
                       help='leave the tools out of the chat template when tool_choice is "none"')
    p.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                   help="usage reports prompt_tokens_details.cached_tokens: the prompt tokens read from the prefix "
                        "cache")
    p.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
                   help="every response carries X-Request-Id: the client's, or one made for it (the reply's id names "
                        "it too)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split a chat reply's thoughts out into message.reasoning: deepseek_r1 (<think>...</think>)")
    p.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="how a message's content reaches the chat template, as vLLM's flag says: string (its text "
                        "parts joined), openai (a list of text parts), auto (the one vLLM detects for the template: "
                        "the list where the template loops over a message's content)")
    p.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                   help="a request's own chat_template renders its chat (/v1/chat/completions, /tokenize), in the "
                        "same sandbox as the server's (default: such a request is refused)")
    p.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help='the chat template\'s variables every chat request starts from, a JSON object (a request\'s '
                        'own chat_template_kwargs override them), e.g. \'{"enable_thinking": false}\'')
    http = p.add_argument_group("HTTP (vLLM's flags)")
    http.add_argument("--allowed-origins", type=json_strings, default=["*"], metavar="JSON",
                      help='CORS: the origins whose pages may call the API, a JSON list (default ["*"], any)')
    http.add_argument("--allowed-methods", type=json_strings, default=["*"], metavar="JSON",
                      help='CORS: the methods they may use, a JSON list (default ["*"])')
    http.add_argument("--allowed-headers", type=json_strings, default=["*"], metavar="JSON",
                      help='CORS: the headers they may send, a JSON list (default ["*"])')
    http.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                      help="CORS: pages may send cookies and credentials")
    http.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                      help="uvicorn's log level (info: a line for each request answered)")
    http.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False,
                      help="no line for each request answered, whatever the log level")
    http.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="HTTPS: the certificate's private key")
    http.add_argument("--ssl-certfile", default=None, metavar="FILE",
                      help="HTTPS: serve over TLS with this certificate (chain), PEM")
    http.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="HTTPS: CAs to check client certificates")
    http.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), metavar="N",
                      help="HTTPS: client certificates: 0 none, 1 checked if sent, 2 required (the ssl module's; "
                           "default: %(default)s)")
    http.add_argument("--uds", default=None, metavar="PATH",
                      help="listen on this Unix domain socket, not on --host and --port (vLLM's)")
    http.add_argument("--root-path", default="", metavar="PATH",
                      help="the prefix a path-routing proxy serves the API under (/llm: /llm/v1/models)")
    p.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="a chat reply's role where the request adds the generation prompt (else the last message's)")
    p.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction, default=False,
                   help='log-probability entries name tokens "token_id:N" where a request does not say')
    p.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                   help="every stream reports its usage (each chunk its usage so far, then a usage chunk), "
                        "asked or not")
    http.add_argument("--responses-store-size", type=int, default=DEFAULT_CAPACITY, metavar="N",
                      help="the Responses API keeps its newest N stored responses (store: true) for "
                           f"previous_response_id, GET and cancel (default {DEFAULT_CAPACITY})")
    http.add_argument("--responses-store-mib", type=int, default=DEFAULT_MIB, metavar="N",
                      help="and of them no more than N MiB (as JSON): past it the oldest go first, but for background "
                           f"responses still running, which stay till they end (default {DEFAULT_MIB})")
    http.add_argument("--log-config-file", default=None, metavar="FILE.json",
                      help="logging as this JSON file configures it (logging.config.dictConfig's schema), the "
                           "server's loggers and uvicorn's (default: $VLLM_LOGGING_CONFIG_PATH, else the server's own)")
    http.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                      help="serve no OpenAPI schema (/openapi.json), Swagger UI (/docs) or ReDoc (/redoc)")
    logs = p.add_argument_group("request logs (vLLM's flags)")
    logs.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                      help="log each request: its prompt and parameters (off by default, as vLLM's)")
    logs.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                      help="log no requests (the default; vLLM's older spelling)")
    logs.add_argument("--max-log-len", type=int, default=None, metavar="N",
                      help="of a logged prompt, its first N characters or token ids (default: all)")
    add_engine_args(p)
    argv = dashed_names(sys.argv[1:] if argv is None else argv)
    # (a first word "serve" that is no directory here: vLLM's subcommand, typed out of habit; it was taken as the
    # model, and the real model refused as a second one)
    p.vllm_subcommand = bool(argv) and argv[0] == "serve" and not os.path.isdir("serve")
    flags = p._option_string_actions
    try:  # (argparse's own table of flags: a false boolean in the file is --no-X only where that exists)
        argv = expand_config(argv, lambda flag: flag in flags, lambda flag: flag in flags and flags[flag].nargs is None)
    except ConfigError as exc:
        p.error(str(exc))
    args = p.parse_args(argv)
    take_model_tag(p, args)
    if args.api_key is None:  # (read here, not as the flag's default: a blank one would be blamed on the flag)
        # (vLLM's VLLM_API_KEY too: a key kept there, ignored, would leave the server open)
        variable = next((v for v in ("TPGRAPH_API_KEY", "VLLM_API_KEY") if os.environ.get(v)), None)
        key = None if variable is None else os.environ[variable]
        if key is not None and not key.strip():
            p.error(f"{variable} is blank: set it to the key, or unset it to serve without one")
        if key is not None and (problem := unsendable(key)) is not None:
            p.error(f"{variable} {problem}")
        args.api_key = None if key is None else [key]
    try:  # (built once, here: flags that only make sense together are said now, and main serves with it)
        args.http = http_options(args)
        check_environment()  # (vLLM's logging variables: read by both processes, so a bad one is said once, now)
    except ConfigError as exc:
        p.error(str(exc))
    # (as vLLM's: the parser alone is taken, and reads no "auto" call without the flag that serves them)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice requires --tool-call-parser: the model's tool-call format, "
                f"one of {', '.join(sorted(PARSERS))}")
    return args


def take_model_tag(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The model given positionally (vLLM's model_tag) is --model; both given must agree, as vLLM refuses two. A
    --config file's model is taken where the command line gives none."""
    tag, from_file = args.__dict__.pop("model_tag"), args.__dict__.pop("config_model")
    if tag == "serve" and getattr(p, "vllm_subcommand", False):
        p.error(SUBCOMMAND)
    if tag is None:
        args.model = args.model if args.model is not None else from_file
        if args.model is None:
            refuse_swallowed_model(p, args)
        return
    if args.model is not None and args.model != tag:
        p.error(f"the model is given twice, {tag!r} and --model {args.model!r}: give it once")
    args.model = tag


# flags of several values, which take every word after them: a model named after one is read as one more value
LIST_FLAGS = (("served_model_name", "--served-model-name"), ("api_key", "--api-key"))
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def refuse_swallowed_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """No model given, and a word that names one (a directory, or a hub id org/name) among a list flag's later values:
    `serve --api-key KEY org/model` read the model as a second key and served the built-in model, its name an API key.
    Refused, saying where the model goes."""
    for dest, flag in LIST_FLAGS:
        for word in (getattr(args, dest) or [])[1:]:
            if HUB_ID.fullmatch(word) or os.path.isdir(word):
                p.error(f"{word!r} after {flag} was read as one more of its values, and no model is given: put the "
                        f"model first (serve {word} {flag} ...), or give it with --model")


def tool_options(args: argparse.Namespace) -> ToolOptions:
    """Function calling's settings: --tool-call-parser reads "auto" calls where --enable-auto-tool-choice serves them
    (given alone, as vLLM takes it, "auto" is refused as without it)."""
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        logger.warning("--tool-call-parser %s is not used without --enable-auto-tool-choice: tool_choice \"auto\" is "
                       "refused", args.tool_call_parser)
    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    return ToolOptions(parser, args.exclude_tools_when_tool_choice_none)


def http_options(args: argparse.Namespace) -> HttpOptions:
    return HttpOptions(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                       args.allow_credentials, args.uvicorn_log_level, not args.disable_uvicorn_access_log,
                       args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs, args.root_path,
                       args.response_role, args.return_tokens_as_token_ids, not args.disable_fastapi_docs,
                       args.enable_log_requests, args.max_log_len, args.default_chat_template_kwargs,
                       args.enable_force_include_usage, args.chat_template_content_format,
                       args.responses_store_size, args.trust_request_chat_template, keep_alive_s=keep_alive_s(),
                       log_config=logging_config(args.log_config_file), uds=args.uds,
                       server_log_config=logging_config(), responses_store_mib=args.responses_store_mib)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        configure_logging(args.http.server_log_config)
    except ConfigError as exc:  # (a logging configuration file's, which dictConfig refused)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService

    http: HttpOptions = args.http
    sockets: list[list[socket.socket]] = []  # (rank 0's, each front end's to serve)
    scratch: tempfile.TemporaryDirectory | None = None  # (several front ends' shared metrics and relay socket)
    try:
        max_n()  # (VLLM_MAX_N_SEQUENCES, read by every request: a bad value said now, not as each request's 500)
        if (env_int("RANK") or 0) == 0:  # (an address in use said now, before minutes of loading, not after)
            if args.api_server_count > 1:  # (a TMPDIR too deep for its socket's path: said now too)
                scratch = tempfile.TemporaryDirectory(prefix="tpgraph-")
                check_private_socket(scratch.name)
            if http.uds is None:  # bound now and held (as vLLM's): no other server listens there meanwhile
                sockets = front_end_sockets(args.host, args.port, None, args.api_server_count)
            else:  # bound as the front ends start: a socket file held through the load looks a stopped server's,
                check_unix_socket(http.uds)  # which another server's asyncio would take over
            http.check_tls()
        reasoning = reasoning_parser(args)  # (before the weights load: the tokenizer is a file)
        # (ranks it starts itself log as this one does, as torchrun's each set up their own)
        engine = engine_from_args(args, rank_setup=partial(configure_logging, args.http.server_log_config))
    except TPGraphError as exc:
        close_sockets([sock for each in sockets for sock in each])
        if scratch is not None:
            scratch.cleanup()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine.warm_up()  # every rank, before anyone is served: the first burst of requests should not pay first-use costs
    if engine.state.rank != 0:
        # torchrun sends SIGTERM to every rank at once, and passes a Ctrl-C on to every rank as SIGINT. A follower
        # leaving at once would strand rank 0 inside a step's collectives, so it keeps following until rank 0's
        # shutdown message, and leaves by itself if that is late.
        leave_later_on(signal.SIGTERM, signal.SIGINT)
        service = EngineService(engine.core, ControlPlane(engine.state))
        failed = True
        try:
            service.run_worker()
            failed = False
        finally:  # (a follower whose loop failed stays a failure where the close then hangs, as rank 0 does)
            _close(engine, exit_code=1 if failed else 0)
        return 0

    from tpgraph.server.bridge import EngineBridge
    from tpgraph.server.frontend import FrontendSpec, start_frontends
    from tpgraph.server.metrics import EngineMetrics, StatsLog, cache_config_info

    root = args.model or BUILTIN_NAME  # (the checkpoint served: /v1/models' root, and the name where none is given)
    names = tuple(args.served_model_name or [root])
    name = names[0]
    # (labelled with the served name, as vLLM's are; with the KV cache's configuration, vLLM's cache_config_info)
    metrics = EngineMetrics(engine.core, name, cache_config_info(engine.core))
    # ranks the engine started itself (no torchrun) follow its own loop: the server drives that one, so that closing
    # the engine knows whether it failed (then the ranks are ended, not told, and the failed engine never steps again)
    service = engine.service or EngineService(engine.core, ControlPlane(engine.state))
    service.heartbeat_s = args.heartbeat_s
    service.on_step = lambda updates, step_s: metrics.step_done(engine.core.timing, step_s, service.times.control_s,
                                                                len(updates),
                                                                sum(u.token_id is not None for u in updates))
    stats = None if args.disable_log_stats else StatsLog(metrics)  # (vLLM's stats line, every 10 s or as set)
    keys = None if args.api_key is None else tuple(args.api_key)
    spec = FrontendSpec(args.host, args.port, name, engine.runner.max_model_len, engine.core.limits, engine.prompts,
                        keys, tool_options(args), reasoning, args.enable_prompt_tokens_details,
                        args.enable_request_id_headers, http, names, root)
    try:
        # (--uds: bound now, where a server may listen since the check)
        sockets = sockets or front_end_sockets(args.host, args.port, http.uds, args.api_server_count)
        # (several front ends' SO_REUSEPORT sockets: another server's that joined them is looked for once they serve)
        shared = http.uds is None and len(sockets) > 1
        points = ListenPoints([sock for each in sockets for sock in each]) if shared else None
        fronts = start_frontends(spec, sockets, None if scratch is None else scratch.name)
    except ConfigError as exc:
        logger.error("%s; stopping", exc)
        if scratch is not None:
            scratch.cleanup()
        _close(engine, timeout_s=3.0, exit_code=1)
        return 1
    frontends = [proc for proc, _ in fronts]
    requested, frontend_closed = threading.Event(), threading.Event()  # a stop we were asked for; a front end gone
    listening = threading.Event()
    url = serving_url(http, args.host, args.port)

    clash: list[str] = []  # (where another server listens beside our front ends, splitting the connections)

    def serving() -> None:  # every front end's HTTP server serves: only now is "serving" true
        if points is not None and (others := points.others()):
            clash.extend(others)
            requested.set()
            return
        logger.info("serving %s on %s (tp=%d%s)", name, url, engine.state.world_size,
                    "" if len(frontends) == 1 else f", {len(frontends)} API server processes")
        listening.set()

    bridge = EngineBridge(service, [conn for _, conn in fronts], metrics.exposition, on_closed=frontend_closed.set,
                          on_ready=serving)
    metrics.waiting_elsewhere = bridge.compiling  # (requests whose grammar compiles wait too, as vLLM counts them)
    service.on_failed = lambda exc: bridge.failed(f"{type(exc).__name__}: {exc}")  # (/health's 503 at once)
    signal.signal(signal.SIGTERM, lambda *_: requested.set())
    service.start()
    bridge.start()
    start_deadline = time.monotonic() + FRONTEND_START_S
    failed = False
    try:
        while not requested.wait(0.5):
            if stats is not None:
                stats.maybe_log()
            if not service.alive:
                logger.error("the engine loop stopped: %s", service.error)
                failed = True
                break
            if frontend_closed.is_set() or not all(proc.is_alive() for proc in frontends):
                gone = _first_gone(frontends)
                code, which = None if gone is None else gone.exitcode, _frontend_named(frontends, gone)
                if code == 0:  # it was stopped (Ctrl-C reaches it first, or SIGTERM): so are we
                    logger.info("%s stopped; stopping", which)
                elif not listening.is_set():  # (an import that failed, a certificate it cannot load): say so, stop
                    logger.error("%s failed to start (exit code %s); nothing serves %s; stopping", which, code, url)
                    failed = True
                else:
                    logger.error("%s exited (code %s)", which, code)
                    failed = True
                break
            if not listening.is_set() and time.monotonic() > start_deadline:
                logger.error("the HTTP front end%s not listening on %s after %.0f s; stopping",
                             " was" if len(frontends) == 1 else "s were", url, FRONTEND_START_S)
                failed = True
                break
    except KeyboardInterrupt:  # Ctrl-C reaches the front ends too; they stop by themselves
        pass
    if clash:  # (the server that came second stops; the first goes on serving alone)
        logger.error("another server listens on %s beside this one's front ends, and the kernel would split the "
                     "connections between the two (SO_REUSEPORT: one started there while this one loaded); stopping",
                     ", ".join(clash))
        failed = True
    # Every step of the way is bounded, so SIGTERM ends the process within 10 s even with requests in flight.
    followers_told = service.shutdown(timeout_s=4.0)
    bridge.close()
    deadline = time.monotonic() + 2.0  # (all the front ends together)
    for proc in frontends:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
    if scratch is not None:
        scratch.cleanup()
    if service.alive:  # still inside a step whose collectives will not complete: releasing would hang or trap
        logger.warning("the engine loop did not stop in time; exiting without releasing the GPU state")
        os._exit(1)
    _close(engine, timeout_s=3.0, followers_told=followers_told, exit_code=1 if failed else 0)
    return 1 if failed else 0


def reasoning_parser(args: argparse.Namespace) -> ReasoningParser | None:
    """--reasoning-parser checked against the tokenizer the engine loads (ReasoningParser.for_tokenizer), read on its
    own: a model whose tokenizer splits the end tag was refused once every rank had loaded the weights."""
    if args.reasoning_parser is None:
        return None
    model, tokenizer = checkpoint_dirs_from_args(args)
    vocab_size = (ModelConfig.from_dir(model, args.disable_sliding_window) if model is not None else
                  BUILTIN_MODEL).vocab_size
    return REASONING_PARSERS[args.reasoning_parser].for_tokenizer(load_tokenizer(tokenizer or model, vocab_size))


def serving_url(http: HttpOptions, host: str, port: int) -> str:
    """Where the server is reached, as the log says it: an IPv6 address in brackets (http://[::1]:8000, which a client
    can read back), every interface (an empty host) as 0.0.0.0, as vLLM's log says it, or the Unix socket."""
    if http.uds is not None:
        return f"{http.scheme}+unix://{http.uds}"
    return f"{http.scheme}://{f'[{host}]' if ':' in host else host or '0.0.0.0'}:{port}"


def _first_gone(frontends: list[BaseProcess], wait_s: float = 1.0) -> BaseProcess | None:
    """The front end that has exited (a closed pipe's, whose exit may take a moment: up to wait_s), else None."""
    ended = mp_wait([proc.sentinel for proc in frontends], timeout=wait_s)
    gone = next((proc for proc in frontends if proc.sentinel in ended), None)
    if gone is not None:
        gone.join()
    return gone


def _frontend_named(frontends: list[BaseProcess], which: BaseProcess | None) -> str:
    if len(frontends) == 1:
        return "the HTTP front end"
    return "an HTTP front end" if which is None else f"HTTP front end {frontends.index(which)}"


FRONTEND_START_S = 60.0  # from its start to listening: a spawned interpreter importing FastAPI and uvicorn


def api_key(text: str) -> str:
    """A key that guards something: an empty one (`--api-key "$UNSET"`) would silently leave the server open."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the API key is empty: give one, or leave --api-key out to serve without one")
    if (problem := unsendable(text)) is not None:
        raise argparse.ArgumentTypeError(f"the key {problem}")
    return text


def served_name(text: str) -> str:
    """A name clients ask for: an empty one (`--served-model-name "$UNSET"`) served the model as "", and every request
    that named it was answered 404."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give the name clients ask for, or leave "
                                         "--served-model-name out to serve the model under its own")
    return text


def unsendable(key: str) -> str | None:
    """Why no client can send `key` in a header (HTTP strips a value's surrounding whitespace and carries no line
    break or control character: the server would answer every request 401), or None where one can."""
    if key != key.strip() or not key.isprintable():
        # (the key itself not echoed: the message reaches logs)
        return ("begins or ends with whitespace or holds a control character (a secret file's trailing newline?), "
                "which no client can send in a header: remove it")
    return None


def json_strings(text: str) -> list[str]:
    """A JSON list of strings, as vLLM reads its CORS flags: '["https://example.com"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'must be a JSON list of strings, such as \'["https://example.com"]\', got '
                                         f"{text!r}")
    return value


def heartbeat_seconds(text: str) -> float:
    """The idle rank 0's message interval: the other ranks wait for its next message in a collective, which fails past
    the process group's timeout (an idle server's other ranks died of a heartbeat that long, and every rank with them);
    at most half of it, for rank 0's own time between messages."""
    value = positive_number(text)
    if value > PROCESS_GROUP_TIMEOUT_S / 2:
        raise argparse.ArgumentTypeError(
            f"must be at most {PROCESS_GROUP_TIMEOUT_S / 2:.0f} s, got {text}: the other ranks wait for rank 0's next "
            f"message at most {PROCESS_GROUP_TIMEOUT_S:.0f} s (the process group's timeout), and an idle server's "
            f"ranks would fail past it")
    return value


def api_server_count(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"at least one HTTP front end serves, got {count}")
    return count


def port_number(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def _close(engine, timeout_s: float = 15.0, followers_told: bool = False, exit_code: int = 0) -> None:
    """Release graphs, communicator and process group, but never hang on a peer that is gone: past timeout_s the
    process ends with exit_code (what it would have returned: a failed server's 1 stays a failure)."""
    done = threading.Event()

    def close() -> None:
        try:
            engine.close(followers_told=followers_told)
        finally:
            done.set()

    threading.Thread(target=close, daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("closing the engine took over %.0f s (a peer is gone?); exiting anyway", timeout_s)
        os._exit(exit_code)


if __name__ == "__main__":
    sys.exit(main())
