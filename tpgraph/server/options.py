"""HttpOptions: how the HTTP server answers, beside what it serves (vLLM's front-end flags), validated once. serve.py
maps the flags to it; the front end's process gets it in its FrontendSpec."""

from __future__ import annotations

from dataclasses import dataclass

from tpgraph.errors import ConfigError

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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

    def __post_init__(self) -> None:
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ConfigError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got "
                              f"{self.uvicorn_log_level!r}")
        if not isinstance(self.access_log, bool):
            raise ConfigError(f"access_log must be True or False, got {self.access_log!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name} must be a tuple of strings, got {value!r}")
        if not isinstance(self.allow_credentials, bool):
            raise ConfigError(f"allow_credentials must be True or False, got {self.allow_credentials!r}")
