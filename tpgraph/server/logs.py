"""The server's logging, as vLLM's environment variables set it (vllm/envs.py, vllm/logger.py): VLLM_LOGGING_LEVEL
(the server's own loggers' level, default INFO) and VLLM_CONFIGURE_LOGGING (0: the server configures no logging).
Both processes, rank 0's and the HTTP front end's, read them; a value that is none of what vLLM takes is refused at
start-up, naming the variable."""

from __future__ import annotations

import logging
import os

from tpgraph.errors import ConfigError

LEVEL_VARIABLE, CONFIGURE_VARIABLE = "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"
LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
FORMAT = "%(levelname)s %(name)s: %(message)s"


def logging_level() -> int:
    """VLLM_LOGGING_LEVEL as a logging level (unset: INFO); vLLM takes its name in any case."""
    name = os.environ.get(LEVEL_VARIABLE, "").strip().upper() or "INFO"
    if name not in LEVELS:
        raise ConfigError(f"{LEVEL_VARIABLE}={os.environ[LEVEL_VARIABLE]!r} is no logging level: give one of "
                          f"{', '.join(LEVELS)}")
    return logging.getLevelName(name)


def configures_logging() -> bool:
    """VLLM_CONFIGURE_LOGGING: 1 (the default) or 0, as vLLM's int() of it reads."""
    text = os.environ.get(CONFIGURE_VARIABLE, "").strip() or "1"
    try:
        return bool(int(text))
    except ValueError:
        raise ConfigError(f"{CONFIGURE_VARIABLE}={os.environ[CONFIGURE_VARIABLE]!r} must be 1 (the server configures "
                          f"its logging, the default) or 0 (it does not)") from None


def check_environment() -> None:
    """Raise ConfigError for a logging variable no process could take (said once, at start-up)."""
    logging_level()
    configures_logging()


def configure_logging() -> None:
    """Log to stderr, the server's loggers at VLLM_LOGGING_LEVEL (other libraries' at INFO, or quieter with it, so
    that DEBUG is the server's debug lines, not every library's); nothing where VLLM_CONFIGURE_LOGGING=0."""
    if not configures_logging():
        return
    level = logging_level()
    logging.basicConfig(level=max(level, logging.INFO), format=FORMAT)
    logging.getLogger("tpgraph").setLevel(level)
