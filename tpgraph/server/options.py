"""HttpOptions: how the HTTP server answers, beside what it serves (vLLM's front-end flags), validated once. serve.py
maps the flags to it; the front end's process gets it in its FrontendSpec."""

from __future__ import annotations

import os
import socket
import ssl
import stat
from dataclasses import dataclass
from typing import Any

from tpgraph.chat import CONTENT_FORMATS, RESERVED_TEMPLATE_VARIABLES
from tpgraph.checks import positive_int
from tpgraph.errors import ConfigError
from tpgraph.server.response_store import DEFAULT_CAPACITY, DEFAULT_MIB

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


KEEP_ALIVE_VARIABLE, KEEP_ALIVE_S = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 5  # (vLLM's, and its default: uvicorn's too)


def keep_alive_s() -> int:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE's seconds (unset: 5, as vLLM's)."""
    text = os.environ.get(KEEP_ALIVE_VARIABLE, "").strip()
    if not text:
        return KEEP_ALIVE_S
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{KEEP_ALIVE_VARIABLE}={os.environ[KEEP_ALIVE_VARIABLE]!r} must be a whole number of "
                          f"seconds") from None


@dataclass(frozen=True)
class HttpOptions:
    # CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials), through Starlette's
    # CORSMiddleware; vLLM's defaults let a page from any origin call the API
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    uvicorn_log_level: str = "info"  # (vLLM's --uvicorn-log-level; at info, uvicorn logs each request it answers)
    access_log: bool = True  # uvicorn's line a request (vLLM's --disable-uvicorn-access-log turns it off)
    # HTTPS (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs), through uvicorn's SSL settings:
    # a certificate chain (and its key, where the file does not hold it), the CAs that client certificates are
    # checked against, and whether clients must send one (the ssl module's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    # vLLM's --root-path: the prefix a path-routing proxy serves the API under ("/llm": /llm/v1/models), whether the
    # proxy passes it on or strips it
    root_path: str = ""
    # vLLM's --response-role: a chat reply's role where the request adds the generation prompt (else the role of the
    # last message, which the reply continues)
    response_role: str = "assistant"
    # vLLM's --return-tokens-as-token-ids: log-probability entries name tokens "token_id:N" (tokens that are no text
    # of their own, such as part of a character, are then told apart) where a request does not say
    return_tokens_as_token_ids: bool = False
    # FastAPI's OpenAPI schema (/openapi.json) and its Swagger UI (/docs) and ReDoc (/redoc) pages, served as vLLM
    # serves them (--disable-fastapi-docs: none of the three)
    docs: bool = True
    # vLLM's --enable-log-requests: a line for each engine request, its prompt and parameters (of the prompt, its
    # first max_log_len characters or ids: vLLM's --max-log-len; None, all)
    log_requests: bool = False
    max_log_len: int | None = None
    # vLLM's --default-chat-template-kwargs: the chat template's variables every chat request starts from (a request's
    # own chat_template_kwargs override them one by one), e.g. {"enable_thinking": false}
    default_chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's --enable-force-include-usage: every stream reports usage as if it asked for include_usage and
    # continuous_usage_stats
    force_include_usage: bool = False
    # vLLM's --chat-template-content-format: how a message's content reaches the chat template ("auto": as vLLM
    # detects it for the template, a list of text parts where it loops over them, else one string; or "string")
    chat_template_content_format: str = "auto"
    # the Responses API's store (response_store.py): how many responses it keeps for previous_response_id, GET and
    # cancel, the oldest dropped first (vLLM's store is unbounded and off unless VLLM_ENABLE_RESPONSES_API_STORE)
    responses_store_size: int = DEFAULT_CAPACITY
    # vLLM's --trust-request-chat-template: a request's own chat_template renders its chat (else it is refused)
    trust_request_chat_template: bool = False
    # how long an idle keep-alive connection stays open, in seconds (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, uvicorn's
    # timeout_keep_alive): a load balancer that reuses connections longer than this gets a reset, or a 502, unless
    # it is raised past the balancer's idle timeout
    keep_alive_s: int = KEEP_ALIVE_S
    # vLLM's --log-config-file (else VLLM_LOGGING_CONFIG_PATH's file): uvicorn's logging configuration, as dictConfig
    # takes it, in place of uvicorn's own (logs.py); None: uvicorn's
    log_config: dict[str, Any] | None = None
    # vLLM's --uds: a Unix domain socket's path to listen on, in place of the host and port
    uds: str | None = None
    # VLLM_LOGGING_CONFIG_PATH's file: the server's own logging configuration, in place of its default, in both
    # processes (vLLM's --log-config-file is uvicorn's alone: a file for uvicorn's access lines leaves the server's)
    server_log_config: dict[str, Any] | None = None
    # the Responses API's store: how many MiB of responses (as JSON) it keeps, the oldest no longer being written
    # dropped first past them (with responses_store_size, whichever bound comes first)
    responses_store_mib: int = DEFAULT_MIB

    def template_variables(self, request: dict[str, Any] | None) -> dict[str, Any] | None:
        """A chat request's template variables: the server's defaults, each overridden by the request's own."""
        if not self.default_chat_template_kwargs:
            return request
        return {**self.default_chat_template_kwargs, **(request or {})}

    def __post_init__(self) -> None:
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ConfigError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got "
                              f"{self.uvicorn_log_level!r}")
        if isinstance(self.keep_alive_s, bool) or not isinstance(self.keep_alive_s, int) or self.keep_alive_s < 0:
            raise ConfigError(f"{KEEP_ALIVE_VARIABLE} must be a whole number of seconds >= 0, got "
                              f"{self.keep_alive_s!r}")
        for name in ("log_config", "server_log_config"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a dictConfig mapping, got {getattr(self, name)!r}")
        if self.uds is not None and (not isinstance(self.uds, str) or not self.uds):
            raise ConfigError(f"--uds must be a socket's path, got {self.uds!r}")
        if not isinstance(self.access_log, bool):
            raise ConfigError(f"access_log must be True or False, got {self.access_log!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name} must be a tuple of strings, got {value!r}")
        if not isinstance(self.allow_credentials, bool):
            raise ConfigError(f"allow_credentials must be True or False, got {self.allow_credentials!r}")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ConfigError("--ssl-keyfile needs --ssl-certfile: the certificate that goes with the key")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ConfigError(f"--ssl-cert-reqs must be {int(ssl.CERT_NONE)} (no client certificate), "
                              f"{int(ssl.CERT_OPTIONAL)} (checked if sent) or {int(ssl.CERT_REQUIRED)} (required), got "
                              f"{self.ssl_cert_reqs!r}")
        if self.ssl_cert_reqs != ssl.CERT_NONE and self.ssl_ca_certs is None:
            raise ConfigError("--ssl-cert-reqs checks client certificates against --ssl-ca-certs: give that file")
        if self.ssl_certfile is None and (self.ssl_ca_certs is not None or self.ssl_cert_reqs != ssl.CERT_NONE):
            raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs are for HTTPS: give --ssl-certfile (and "
                              "--ssl-keyfile) too")

        if not isinstance(self.log_requests, bool):
            raise ConfigError(f"log_requests must be True or False, got {self.log_requests!r}")
        if self.max_log_len is not None and (isinstance(self.max_log_len, bool) or not isinstance(self.max_log_len, int)
                                             or self.max_log_len < 0):
            raise ConfigError(f"--max-log-len must be an integer >= 0, got {self.max_log_len!r}")
        defaults = self.default_chat_template_kwargs
        if defaults is not None and not isinstance(defaults, dict):
            raise ConfigError(f"--default-chat-template-kwargs must be a JSON object, got {defaults!r}")
        # (what a request's fields set, or the template itself, refused now: else every chat request would be a 400;
        # add_generation_prompt too, as each request's own always wins over it)
        if taken := sorted(set(defaults or {}) & (RESERVED_TEMPLATE_VARIABLES | {"add_generation_prompt",
                                                                                "chat_template"})):
            raise ConfigError(f"--default-chat-template-kwargs may not set {', '.join(taken)}: a request's own fields "
                              f"do (the template: --chat-template)")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
                              f"{self.chat_template_content_format!r}")
        positive_int("--responses-store-size", self.responses_store_size)
        positive_int("--responses-store-mib", self.responses_store_mib)
        if not isinstance(self.force_include_usage, bool):
            raise ConfigError(f"force_include_usage must be True or False, got {self.force_include_usage!r}")
        if not isinstance(self.trust_request_chat_template, bool):
            raise ConfigError(f"trust_request_chat_template must be True or False, got "
                              f"{self.trust_request_chat_template!r}")
        if not isinstance(self.docs, bool):
            raise ConfigError(f"docs must be True or False, got {self.docs!r}")
        if not isinstance(self.return_tokens_as_token_ids, bool):
            raise ConfigError(f"return_tokens_as_token_ids must be True or False, got "
                              f"{self.return_tokens_as_token_ids!r}")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ConfigError(f"--response-role must be a role's name, got {self.response_role!r}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError(f"--root-path must begin with / and not end with one (such as /llm), got "
                              f"{self.root_path!r}")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    def check_tls(self) -> None:
        """Load the certificate, its key and the CAs as uvicorn will, so that a missing file, a key that is not the
        certificate's or a passphrase-protected key is said at start-up, not after minutes of loading the model."""
        if self.ssl_certfile is None:
            return
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, password=lambda: "")
            if self.ssl_ca_certs is not None:
                context.load_verify_locations(self.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            files = ", ".join(f"{flag} {path}" for flag, path in (("--ssl-certfile", self.ssl_certfile),
                                                                  ("--ssl-keyfile", self.ssl_keyfile),
                                                                  ("--ssl-ca-certs", self.ssl_ca_certs)) if path)
            raise ConfigError(f"cannot serve HTTPS with {files}: {exc}") from None


def check_unix_socket(path: str) -> None:
    """A socket file left at `path` (a stopped server's) is taken over, as uvicorn does, but nothing may listen where
    something else is, nor where a server listens already (it would take its place, silently): rank 0 checks before
    loading the model, and again as it binds the front ends' socket (listeners.py: a server may listen there since)."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ConfigError(f"cannot listen on --uds {path}: its directory does not exist")
    if not os.path.exists(path):
        return _bind_unix(path)
    if not stat.S_ISSOCK(os.stat(path).st_mode):
        raise ConfigError(f"cannot listen on --uds {path}: it exists and is no socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)  # (a live server's full backlog blocks a connect)
        try:
            sock.connect(path)
        except ConnectionRefusedError:
            return  # (no one listens: a stopped server's socket, taken over)
        except OSError as exc:  # (a datagram server's, one we may not connect to: uvicorn would delete a live one)
            raise ConfigError(f"cannot listen on --uds {path}: its server cannot be told gone ({exc.strerror or exc}); "
                              f"remove the socket file if it is stale") from None
    raise ConfigError(f"cannot listen on --uds {path}: a server listens on it already")


def _bind_unix(path: str) -> None:
    """Bind a socket at `path` as uvicorn will, and remove it: a path past the kernel's limit (108 bytes on Linux), or
    in a directory this user may not write, is refused now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(path)
        except OSError as exc:
            raise ConfigError(f"cannot listen on --uds {path}: {exc.strerror or exc}") from None
    os.unlink(path)
