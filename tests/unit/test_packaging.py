"""What users install must carry every file the code reads: the all-reduce tables ship inside the package."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_installed_package_reads_its_own_tables(tmp_path):
    # build_py lays out the package exactly as a wheel or `pip install .` does (without compiling the extension)
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True)
    tables = sorted(p.name for p in (tmp_path / "tpgraph" / "configs" / "allreduce").glob("*.json"))
    assert tables == sorted(p.name for p in (ROOT / "configs" / "allreduce").glob("*.json"))
    code = ("from tpgraph.comm.thresholds import config_dir, load_table_for; "
            "print(config_dir()); print(load_table_for((9, 0)).source)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path / "tpgraph" / "configs"), str(tmp_path / "tpgraph" / "configs" / "allreduce" /
                                                                   "sm90.json")]


def test_config_dir_override(monkeypatch, tmp_path):
    from tpgraph.comm.thresholds import config_dir

    assert config_dir() == ROOT / "configs"  # the checkout's tables in an editable install
    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path
