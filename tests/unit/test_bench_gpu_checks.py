"""bench/gpu_graph_checks.sh's bookkeeping, on CPU: unknown steps refused before the build, failing steps reported."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_graph_checks.sh"


def _run(out: Path, *steps: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TPG_SKIP_BUILD": "1"}
    return subprocess.run(["bash", str(SCRIPT), str(out), *steps], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done = _run(tmp_path / "out", "kernels", "kernel-bnech")
    assert done.returncode == 2 and "unknown step: 'kernel-bnech'" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before the output folder, the build or any step


def test_a_step_whose_command_fails_is_reported_and_the_script_fails(tmp_path):
    # on CPU bench_kernels.py fails at once (no CUDA); its output goes through tail and tee, which exit 0
    done = _run(tmp_path / "out", "kernel-bench")
    assert "=== kernel-bench: FAILED" in done.stdout and "failed steps: kernel-bench" in done.stdout
    assert done.returncode == 1
