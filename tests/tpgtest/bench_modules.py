"""Import a script from bench/ (not a package) by file path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_bench_module(name: str) -> ModuleType:
    """bench/<name>.py as a module, with bench/ on sys.path as when the script runs (they import one another)."""
    bench_dir = Path(__file__).resolve().parents[2] / "bench"
    if str(bench_dir) not in sys.path:
        sys.path.append(str(bench_dir))
    path = bench_dir / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
