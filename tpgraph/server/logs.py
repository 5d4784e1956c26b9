"""The server's logging, as vLLM's environment variables set it (vllm/envs.py, vllm/logger.py): VLLM_LOGGING_LEVEL (the
server's own loggers' level, default INFO), VLLM_CONFIGURE_LOGGING (0: the server configures no logging),
VLLM_LOGGING_PREFIX and VLLM_LOGGING_STREAM (each line's prefix, and stdout or stderr), VLLM_LOG_STATS_INTERVAL (the
seconds between the engine's stats lines), and VLLM_LOGGING_CONFIG_PATH (a JSON logging configuration in place of the
server's). Both processes, rank 0's and the HTTP front end's, read them; a value that is none of what vLLM takes is
refused at start-up, naming the variable."""

from __future__ import annotations

import json
import logging
import logging.config
import math
import os
import re
import subprocess
import sys
from typing import Any

from tpgraph.errors import ConfigError

LEVEL_VARIABLE, CONFIGURE_VARIABLE = "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"
STATS_INTERVAL_VARIABLE, CONFIG_PATH_VARIABLE = "VLLM_LOG_STATS_INTERVAL", "VLLM_LOGGING_CONFIG_PATH"
STATS_INTERVAL_S = 10.0  # (vLLM's default, and what it takes for a value that is not positive)
# (the names Python's logging takes, as vLLM's dictConfig does: WARN and FATAL too, and NOTSET, which at vLLM's
# handler passes every line of its "vllm" logger, a DEBUG one)
LEVELS = {"CRITICAL": logging.CRITICAL, "FATAL": logging.FATAL, "ERROR": logging.ERROR, "WARNING": logging.WARNING,
          "WARN": logging.WARN, "INFO": logging.INFO, "DEBUG": logging.DEBUG, "NOTSET": logging.DEBUG}
FORMAT = "%(levelname)s %(name)s: %(message)s"
# vLLM's VLLM_LOGGING_PREFIX (text before each line) and VLLM_LOGGING_STREAM (where lines go, as dictConfig names a
# stream; the server's default is stderr, vLLM's stdout)
PREFIX_VARIABLE, STREAM_VARIABLE = "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_STREAM"
STREAMS = {"ext://sys.stdout": "stdout", "ext://sys.stderr": "stderr"}
VLLM_LOGGER, SERVER_LOGGER = "vllm", "tpgraph"  # (vLLM's loggers' root, and the server's)
# in a prefix: a percent sign written twice, a field's beginning, or any other % (one the format would choke on)
PERCENT = re.compile(r"%%|%\(|%")


def logging_level() -> int:
    """VLLM_LOGGING_LEVEL as a logging level (unset: INFO); vLLM takes its name in any case."""
    name = os.environ.get(LEVEL_VARIABLE, "").strip().upper() or "INFO"
    if name not in LEVELS:
        raise ConfigError(f"{LEVEL_VARIABLE}={os.environ[LEVEL_VARIABLE]!r} is no logging level: give one of "
                          f"CRITICAL, ERROR, WARNING, INFO, DEBUG")
    return LEVELS[name]


def logging_stream() -> str:
    """VLLM_LOGGING_STREAM's stream, "stdout" or "stderr" (unset: stderr)."""
    text = os.environ.get(STREAM_VARIABLE, "").strip()
    if not text:
        return "stderr"
    if text not in STREAMS:
        raise ConfigError(f"{STREAM_VARIABLE}={os.environ[STREAM_VARIABLE]!r} must be {' or '.join(STREAMS)}")
    return STREAMS[text]


def logging_prefix() -> str:
    """VLLM_LOGGING_PREFIX as the beginning of the logging format, as vLLM puts it there: its log record fields
    (%(process)d, %(asctime)s, ...) filled in for each line, %% a percent sign. A % that begins neither is the
    character itself ("100%"), where vLLM's format failed every line with it; a field no record fills is refused."""
    text = os.environ.get(PREFIX_VARIABLE, "")
    prefix = PERCENT.sub(lambda m: m[0] if len(m[0]) == 2 else "%%", text)
    try:  # (a record's every field is there at once: a prefix one record takes, every record takes)
        logging.Formatter(prefix + FORMAT).format(logging.LogRecord(SERVER_LOGGER, logging.INFO, "", 0, "", (), None))
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{PREFIX_VARIABLE}={text!r} cannot begin a log line: {exc} (its fields are a log "
                          f"record's, such as %(process)d; %% is a percent sign)") from None
    return prefix


def configures_logging() -> bool:
    """VLLM_CONFIGURE_LOGGING: 1 (the default) or 0, as vLLM's int() of it reads."""
    text = os.environ.get(CONFIGURE_VARIABLE, "").strip() or "1"
    try:
        return bool(int(text))
    except ValueError:
        raise ConfigError(f"{CONFIGURE_VARIABLE}={os.environ[CONFIGURE_VARIABLE]!r} must be 1 (the server configures "
                          f"its logging, the default) or 0 (it does not)") from None


def stats_interval_s() -> float:
    """VLLM_LOG_STATS_INTERVAL: the seconds between the engine's stats lines (unset, or not positive: 10, as vLLM's)."""
    text = os.environ.get(STATS_INTERVAL_VARIABLE, "").strip()
    try:
        value = float(text) if text else STATS_INTERVAL_S
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise ConfigError(f"{STATS_INTERVAL_VARIABLE}={os.environ[STATS_INTERVAL_VARIABLE]!r} is not a number of "
                          f"seconds")
    return value if value > 0 else STATS_INTERVAL_S


def logging_config(path: str | None = None) -> dict[str, Any] | None:
    """The logging configuration of vLLM's --log-config-file `path`, else VLLM_LOGGING_CONFIG_PATH's file (a JSON
    object, as logging.config.dictConfig takes it): called with the flag's path, uvicorn's (as vLLM's); without, the
    server's own, in place of its default (as vLLM's variable). None where neither is given."""
    flag = bool(path)
    path = path or os.environ.get(CONFIG_PATH_VARIABLE, "").strip()
    if not path:
        return None
    named = f"--log-config-file {path}" if flag else f"{CONFIG_PATH_VARIABLE}={path!r}"
    # (as vLLM refuses the variable's file with VLLM_CONFIGURE_LOGGING=0, which it would configure nothing with; the
    # flag's is uvicorn's, which that leaves to it)
    if not flag and not configures_logging():
        raise ConfigError(f"{named} is given, but {CONFIGURE_VARIABLE}=0 says not to configure logging: leave out "
                          f"one of them")
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{named} cannot be read as a JSON logging configuration: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{named} must hold a JSON object (logging.config.dictConfig's schema), not a "
                          f"{type(config).__name__}")
    config = with_servers_logger(config)
    if flag:  # (the variable's is applied in this process at start-up, before any rank or weight: configure_logging)
        # (after the server's own, as the front end applies them: an incremental file may change its handlers)
        check_uvicorn_config(config, named, logging_config() if configures_logging() else None)
    return config


# configurations applied as the front end applies them, the server's own (where given) then uvicorn's (its TRACE
# level named first), in a process of its own: dictConfig changes the logging of the process it runs in. It says
# dictConfig's refusal, and its cause, on stdout.
UVICORN_CHECK = """
import json, logging, logging.config, sys
server, uvicorn = json.load(sys.stdin)
try:
    if server is not None:
        logging.config.dictConfig(server)
except Exception:
    sys.exit(0)  # (the server's own, refused as the server applies it: configure_logging says so)
logging.addLevelName(5, "TRACE")
try:
    logging.config.dictConfig(uvicorn)
except Exception as exc:
    print(exc if exc.__cause__ is None else f"{exc}: {exc.__cause__}", end="")
    sys.exit(1)
"""
UVICORN_CHECK_S = 60.0


def check_uvicorn_config(config: dict[str, Any], named: str, server: dict[str, Any] | None = None) -> None:
    """Raise ConfigError for a logging configuration uvicorn's dictConfig would refuse (a handler class that does not
    exist, a file handler's missing directory), applied after `server`, the server's own: else found only as the
    front end starts, after the weights load."""
    # (the front end is spawned with this process's sys.path: the check imports what the file names from there too)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        run = subprocess.run([sys.executable, "-c", UVICORN_CHECK], input=json.dumps([server, config]),
                             capture_output=True, text=True, env=env, timeout=UVICORN_CHECK_S)
    except (subprocess.TimeoutExpired, OSError):
        # (a handler that waits on something at start-up, or no interpreter to run: the front end says, should it fail)
        return
    if run.returncode != 0:
        crash = run.stderr.strip().splitlines()  # (the check itself failed: its traceback's last line)
        reason = run.stdout.strip() or (crash[-1] if crash else f"exit code {run.returncode}")
        raise ConfigError(f"{named} is no logging configuration uvicorn takes: {reason}")


def with_servers_logger(config: dict[str, Any]) -> dict[str, Any]:
    """A vLLM logging configuration's "vllm" logger (its documented example's, which leaves disable_existing_loggers
    at dictConfig's True) as the server's own "tpgraph" too, where the file does not name that one: else it configured
    none of the server's lines and disabled its loggers, so that nothing was logged, errors included."""
    loggers = config.get("loggers")
    if not isinstance(loggers, dict) or VLLM_LOGGER not in loggers or SERVER_LOGGER in loggers:
        return config
    return {**config, "loggers": {**loggers, SERVER_LOGGER: loggers[VLLM_LOGGER]}}


def check_environment() -> None:
    """Raise ConfigError for a logging variable no process could take (said once, at start-up)."""
    logging_level()
    configures_logging()
    logging_stream()
    logging_prefix()
    stats_interval_s()


def configure_logging(config: dict[str, Any] | None = None) -> None:
    """Log to stderr, the server's loggers at VLLM_LOGGING_LEVEL (other libraries' at INFO, or quieter with it, so
    that DEBUG is the server's debug lines, not every library's); as `config` says where one is given (logging_config:
    VLLM_LOGGING_CONFIG_PATH's); nothing where VLLM_CONFIGURE_LOGGING=0. Raises ConfigError
    for a configuration dictConfig refuses."""
    if not configures_logging():
        return
    if config is not None:
        try:
            logging.config.dictConfig(config)
        except (ValueError, TypeError, AttributeError, ImportError) as exc:
            raise ConfigError(f"the logging configuration file (--log-config-file, {CONFIG_PATH_VARIABLE}) is none "
                              f"dictConfig takes: {exc}") from None
        return
    level = logging_level()
    # (the stream looked up now, not at import: a test's or a caller's replaced sys.stdout is the one written to)
    logging.basicConfig(level=max(level, logging.INFO), format=logging_prefix() + FORMAT,
                        stream=getattr(sys, logging_stream()))
    logging.getLogger(SERVER_LOGGER).setLevel(level)
