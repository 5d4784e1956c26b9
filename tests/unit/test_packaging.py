"""What users install must carry every file the code reads: the all-reduce and GEMV tables ship inside the package."""

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_wheel_carries_the_tables_and_an_installed_copy_reads_them(tmp_path):
    """`pip wheel .`, then a plain (non-editable) install of it: the tables are in the wheel and the installed
    package loads its own copy."""
    import importlib.util
    import zipfile

    # the build requirements already here: build in this environment (faster); else pip's isolated one
    here = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel", "pybind11", "ninja"))
    # (the default archs, as users build: after the install's own build, ninja finds its objects and only links)
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                    *(["--no-build-isolation"] if here else [])], cwd=ROOT, check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("tpgraph-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    if shutil.which("nvcc"):  # (setup.py builds the extension wherever it finds nvcc)
        assert any(n.startswith("tpgraph/_C") and n.endswith(".so") for n in names), names
    tables = sorted(p.name for p in (ROOT / "configs" / "allreduce").glob("*.json"))
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("tpgraph/configs/allreduce/")) == tables
    gemv = sorted(p.name for p in (ROOT / "configs" / "gemv").glob("*.json"))
    assert gemv and sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("tpgraph/configs/gemv/")) == gemv
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("from tpgraph.comm.thresholds import config_dir, load_table_for; "
            "from tpgraph.kernels.gemv import table_path; "
            "print(config_dir()); print(load_table_for((9, 0)).source); print(table_path((9, 0)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(site / "tpgraph" / "configs"), str(site / "tpgraph" / "configs" / "allreduce" / "sm90.json"),
                   str(site / "tpgraph" / "configs" / "gemv" / "sm90.json")]


def test_config_dir_override(monkeypatch, tmp_path):
    from tpgraph.comm.thresholds import config_dir

    assert config_dir() == ROOT / "configs"  # the checkout's tables in an editable install
    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path


def test_a_missing_table_stops_start_up(monkeypatch, tmp_path):
    """Not a silent fall back to NCCL: the communicator's setup raises, naming the file."""
    import types

    import pytest
    import torch

    from tpgraph.comm import communicator
    from tpgraph.errors import ConfigError

    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path))  # no tables there
    monkeypatch.setattr("tpgraph._ext.extension_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(communicator, "run_on_all_ranks", lambda state, fn, what: fn())
    state = types.SimpleNamespace(device=torch.device("cuda", 0), world_size=2, rank=0)
    with pytest.raises(ConfigError, match="TPGRAPH_CONFIG_DIR=.* has no allreduce/sm90.json"):
        communicator._try_custom_allreduce(state)


def test_an_sdist_carries_every_file_the_build_and_the_package_read(tmp_path):
    """An sdist without the extension's headers (there was no MANIFEST.in) fails to build: api.h not found. Made
    from a copy of the tree as git sees it, so no egg-info left by an earlier build lists files for it."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    tree = tmp_path / "tree"
    for name in files:
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=tree, check=True,
                   capture_output=True)
    (sdist,) = (tmp_path / "dist").glob("tpgraph-*.tar.gz")
    with tarfile.open(sdist) as tar:
        carried = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = [p.relative_to(tree).as_posix() for d in ("csrc", "configs") for p in (tree / d).rglob("*")
              if p.is_file() and p.suffix in (".h", ".cuh", ".cu", ".cpp", ".json")]
    assert len(needed) > 15 and not [p for p in needed if p not in carried]


def tree_with_failing_nvcc(tmp_path):
    """A copy of the build's sources, and a CUDA_HOME whose nvcc fails if it is ever run: (tree, cuda)."""
    tree, cuda = tmp_path / "tree", tmp_path / "cuda"
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    shutil.copy2(ROOT / "setup.py", tree / "setup.py")
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    return tree, cuda


def test_a_cuda_arch_list_nvcc_cannot_read_is_refused_naming_the_variable(tmp_path):
    """TPGRAPH_CUDA_ARCHS="9.0a" (torch's TORCH_CUDA_ARCH_LIST spelling) went to nvcc as compute_9.0a, whose error
    named no variable, and a blank value built for nvcc's default arch. Checked before anything is compiled (an nvcc
    here that fails if it is ever run)."""
    import os

    tree, cuda = tree_with_failing_nvcc(tmp_path)
    env = {**os.environ, "CUDA_HOME": str(cuda), "TPGRAPH_CUDA_ARCHS": "9.0a;100a"}
    built = subprocess.run([sys.executable, "setup.py", "build_ext"], cwd=tree, env=env, capture_output=True,
                           text=True)
    assert built.returncode != 0
    assert "TPGRAPH_CUDA_ARCHS='9.0a;100a': '9.0a' is no CUDA arch as nvcc names it" in built.stderr
    assert not list((tree / "build").glob("tpgraph_C-*"))  # refused before the build folder is made


def test_the_kept_build_folder_is_one_per_python_abi_and_pybind11(tmp_path):
    """The ninja folder that outlives a build was keyed by the archs alone: builds for two Pythons (or two pybind11s)
    in one checkout shared its objects, build.ninja and pybind11 header link, so one rebuilt or clobbered the other's
    (at once: a race). What an object depends on is the Python ABI (its headers) and pybind11's headers; no torch
    header is compiled. An nvcc here that fails when run: the folder is made before the first compile."""
    import os
    import sysconfig

    import pybind11

    tree, cuda = tree_with_failing_nvcc(tmp_path)
    env = {**os.environ, "CUDA_HOME": str(cuda), "TPGRAPH_CUDA_ARCHS": "90a;100a"}
    built = subprocess.run([sys.executable, "setup.py", "build_ext"], cwd=tree, env=env, capture_output=True,
                           text=True)
    assert built.returncode != 0  # the fake nvcc
    soabi = sysconfig.get_config_var("SOABI")
    assert soabi and [p.name for p in (tree / "build").glob("tpgraph_C-*")] == [
        f"tpgraph_C-90a_100a-{soabi}-pybind11-{pybind11.__version__}"]



# the newest release of a dependency that installs on requires-python's oldest Python, 3.10 (PyPI's Requires-Python:
# every later one needs 3.11)
NEWEST_FOR_PY310 = {"httpx2": "2.14.0"}


def test_every_dependency_has_a_release_for_the_oldest_python_taken():
    """requires-python takes 3.10, so `pip install .` there must find a release of each dependency: httpx2>=2.16 (the
    front ends' Responses API relay) has none for 3.10 (2.15.0 on need 3.11), and the install failed as a whole."""
    import pytest

    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert SpecifierSet(project["requires-python"]).contains("3.10")
    checked = [Requirement(line) for line in project["dependencies"] if Requirement(line).name in NEWEST_FOR_PY310]
    assert [req.name for req in checked] == list(NEWEST_FOR_PY310)
    for req in checked:
        assert req.specifier.contains(NEWEST_FOR_PY310[req.name]), f"{req}: no release of it installs on Python 3.10"
