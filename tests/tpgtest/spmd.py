"""The SPMD check's digest of a generate call as processes with different str hash seeds make it: under torchrun each
rank is a process of its own, and a digest that follows a set's iteration order refuses calls every rank made alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])


def digests_across_hash_seeds(params_code: str, seeds: tuple[int, ...]) -> set[str]:
    """The digests of generate([[256, 104]], <params_code>) made in a process for each PYTHONHASHSEED in `seeds`.
    `params_code`: a Python expression that may use SamplingParams and StructuredOutputsParams."""
    code = ("import types; from tpgraph import SamplingParams; from tpgraph.engine import tp_engine; "
            "from tpgraph.engine.sampling_params import StructuredOutputsParams; seen = []; "
            "tp_engine.gather_objects = lambda state, digest: seen.append(digest) or [digest]; "
            "rank = types.SimpleNamespace(service=None, state=types.SimpleNamespace(world_size=2)); "
            f"tp_engine.TPEngine._agreed_call(rank, 'generate', lambda: [[256, 104]], {params_code}); "
            "print(seen[0])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    return {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                           env={**env, "PYTHONHASHSEED": str(seed)}).stdout for seed in seeds}
