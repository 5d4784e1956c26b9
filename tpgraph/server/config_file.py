"""vLLM's `--config FILE.yaml`: a YAML mapping of flag names to values, read as flags placed before the command
line's own (so that the command line overrides the file)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpgraph.errors import ConfigError

# the file's model goes here, not to --model: a model on the command line (positionally too) overrides it, as in vLLM
CONFIG_MODEL_FLAG = "--config-model"


def expand_config(argv: list[str], has_flag: Callable[[str], bool],
                  takes_one: Callable[[str], bool] = lambda flag: False) -> list[str]:
    """argv with `--config FILE` (or --config=FILE) replaced by the file's flags, put first (after the positional
    model, where the rest begins with it). has_flag says whether a flag exists: a false boolean becomes --no-X where
    there is one, and is left out (the default) where there is none. takes_one says whether a flag takes one value
    alone: a list of several for it is refused."""
    where = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not where:
        return argv
    if len(where) > 1:
        raise ConfigError("--config is given more than once: give one file")
    i = where[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            raise ConfigError("--config needs a file: --config FILE.yaml")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    # (the model first, as vLLM puts it: after the file's flags, a list's last value would take it for its own)
    model = rest[:1] if rest and not rest[0].startswith("-") else []
    return model + config_flags(load_config(path), has_flag, takes_one) + rest[len(model):]


def load_config(path: str) -> dict[str, Any]:
    if Path(path).suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--config {path}: the file must be YAML (.yaml or .yml), as vLLM's")
    try:
        import yaml
    except ImportError:
        raise ConfigError("--config needs PyYAML to read the file: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: cannot be read: {exc}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(f"--config {path}: must be a mapping of flag names to values (port: 8000), got "
                          f"{type(config).__name__}")
    return config


def config_flags(config: dict[str, Any], has_flag: Callable[[str], bool],
                 takes_one: Callable[[str], bool] = lambda flag: False) -> list[str]:
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model":
            flag = CONFIG_MODEL_FLAG
        # (its values after the first were read as the positional model: `max-num-seqs: [4, 8]` served a model "8")
        if isinstance(value, list) and len(value) > 1 and takes_one(flag):
            raise ConfigError(f"--config: {key} takes one value, got a list of {len(value)}: {value}")
        flags += flag_words(flag, value, has_flag)
    return flags


def flag_words(flag: str, value: Any, has_flag: Callable[[str], bool]) -> list[str]:
    """One key's command-line words, as vLLM writes them; one value goes as --X=VALUE, which argparse never reads as
    another flag where it begins with a dash (a key "-k3y"). A null is the flag left out (its default), as vLLM's
    optional flags read it: not the text "None" (an API key, a served name). A key naming no flag is refused by
    argparse, whatever its value."""
    if not has_flag(flag) and (value is None or value is False or value == []):
        # (left out, a typo's false or null went unsaid: `enable-prefix-cachng: false` left the prefix cache on)
        return [f"{flag}={json.dumps(value)}"]
    if value is None:
        return []
    if isinstance(value, bool):
        negated = "--no-" + flag[2:]
        return [flag] if value else [negated] if has_flag(negated) else []
    if isinstance(value, list):
        return [flag, *map(str, value)] if value else []
    return [f"{flag}={json.dumps(value) if isinstance(value, dict) else value}"]
