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


def test_the_summary_log_is_whole_when_the_script_has_exited(tmp_path):
    """Its console goes to summary.log through a process substitution's tee, which bash did not wait for: a caller
    that reads the log once the script has exited (the device call packs OUTDIR) could miss its last lines, the
    ok/FAILED summary. A tee slowed down (a wrapper that starts it late) makes that certain; the script must wait."""
    import shutil

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tee").write_text(f"#!/bin/sh\nsleep 0.5\nexec {shutil.which('tee')} \"$@\"\n")
    (fake / "tee").chmod(0o755)
    env = {**os.environ, "TPG_SKIP_BUILD": "1", "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "out"
    with open(tmp_path / "console.txt", "w") as console:  # not a pipe: run() returns when bash exits, not tee
        done = subprocess.run(["bash", str(SCRIPT), str(out)], stdout=console, stderr=subprocess.STDOUT, cwd=REPO,
                              env=env, timeout=120)
    assert done.returncode == 0
    assert (out / "summary.log").read_text().splitlines()[-1].startswith("=== done")
