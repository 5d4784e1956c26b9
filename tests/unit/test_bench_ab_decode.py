"""bench/ab_decode.py's pure parts: variants, the run command, the table, --prepare, and its refusals."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tpgtest.bench_modules import load_bench_module

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ab():
    return load_bench_module("ab_decode")


def test_a_variant_is_a_label_a_tree_and_settings(ab):
    v = ab.parse_variant("nolr=ab/head:TPGRAPH_LAST_SPLIT_REDUCES=0,TPGRAPH_PDL_PREFETCH_MB=4")
    assert (v.label, v.tree, v.env) == ("nolr", Path("ab/head"),
                                        {"TPGRAPH_LAST_SPLIT_REDUCES": "0", "TPGRAPH_PDL_PREFETCH_MB": "4"})
    assert ab.parse_variant("new=.") == ab.Variant("new", Path("."), {})


@pytest.mark.parametrize("text", ["new", "=.", "new=", "a/b=.", "x=.:NOVALUE", "x=.:=1"])
def test_a_malformed_variant_is_refused_with_the_form(ab, text):
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=DIR|label|NAME=VALUE"):
        ab.parse_variant(text)


def test_each_run_imports_its_variants_tree_with_its_settings(ab, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    v = ab.Variant("old", tmp_path, {"TPGRAPH_TRITON_PDL": "0"})
    cmd, env = ab.run_command(v, 2, ["--batches", "1,8"], tmp_path / "old_r1.json")
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path.resolve()) and env["PYTHONPATH"].endswith("/elsewhere")
    assert env["TPGRAPH_TRITON_PDL"] == "0"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[-4:] == ["--batches", "1,8", "--out", str(tmp_path / "old_r1.json")]
    assert Path(cmd[cmd.index("--nproc-per-node") + 2]) == REPO / "bench" / "bench_decode.py"


def test_a_variants_own_arguments_follow_the_common_ones(ab, tmp_path):
    label, args = ab.parse_args_entry("b32=--block-size 32 --context '4096'")
    assert (label, args) == ("b32", ("--block-size", "32", "--context", "4096"))
    v = ab.Variant("b32", tmp_path, {}, args)
    cmd, _ = ab.run_command(v, 1, ["--context", "512", "--batches", "1"], tmp_path / "b32_r1.json")
    # after the common arguments, so that argparse keeps the variant's --context; --out last, as for every run
    assert cmd[-8:] == ["--batches", "1", "--block-size", "32", "--context", "4096", "--out",
                        str(tmp_path / "b32_r1.json")]


@pytest.mark.parametrize("text", ["b32", "=--block-size 32", "b32=", "b32=--out x", "b32=--out=x",
                                  "b32=--context '512"])
def test_a_malformed_args_entry_is_refused_with_the_form(ab, text):
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=ARGS|--out|quotation"):
        ab.parse_args_entry(text)


def test_a_tile_table_keeps_the_variants_own_arguments(ab, tmp_path):
    (tmp_path / "configs" / "gemv").mkdir(parents=True)
    (tmp_path / "configs" / "gemv" / "sm90.json").write_text("{}")
    v = ab.write_tiles(ab.Variant("d", tmp_path, {"A": "1"}, ("--block-size", "32")),
                       [("best", "4096,2048,1", {"block_n": 32})], "sm90", tmp_path / "out")
    assert v.args == ("--block-size", "32") and v.env["A"] == "1" and "TPGRAPH_GEMV_TABLE" in v.env


FAKE_BENCH = """
import json, os, sys
import marker  # from the variant's tree: which tree this run imported
out = sys.argv[sys.argv.index("--out") + 1]
fail = os.environ.get("FAKE_FAIL") == "1"
if not fail:
    ms = marker.MS + float(os.environ.get("FAKE_EXTRA", "0"))
    if "--extra" in sys.argv:  # a variant's own argument (--args)
        ms += float(sys.argv[sys.argv.index("--extra") + 1])
    json.dump({"tpot": [{"allreduce": "custom", "mode": "full", "batch": 1, "tpot_ms": ms}]}, open(out, "w"))
"""


def test_the_variants_alternate_and_the_table_is_written(ab, tmp_path, monkeypatch):
    """End to end through torchrun with a stand-in benchmark: each variant imports its own tree with its settings
    and its own arguments, a run that fails is left out (and said), and ab.md / ab.json hold the rest."""
    trees = {}
    for label, ms in (("a", 2.0), ("b", 3.0)):
        trees[label] = tmp_path / label
        (trees[label] / "tpgraph").mkdir(parents=True)
        (trees[label] / "tpgraph" / "__init__.py").write_text("")
        (trees[label] / "tpgraph" / "_C.fake.so").write_text("")  # stands in for the built extension
        (trees[label] / "marker.py").write_text(f"MS = {ms}\n")
    (tmp_path / "bench.py").write_text(FAKE_BENCH)
    monkeypatch.setattr(ab, "BENCH", tmp_path / "bench.py")
    out = tmp_path / "out"
    out.mkdir()  # an earlier comparison's folder: its c_r1.json is not this run's result
    (out / "c_r1.json").write_text(json.dumps({"tpot": [{"allreduce": "custom", "mode": "full", "batch": 1,
                                                          "tpot_ms": 9.0}]}))
    with pytest.raises(SystemExit, match="2 run\\(s\\) left out: c round 1 \\(no results written\\), c round 2"):
        ab.main(["--out", str(out), "--rounds", "2", "--variant", f"a={trees['a']}",
                 "--variant", f"b={trees['b']}:FAKE_EXTRA=0.5", "--variant", f"c={trees['a']}:FAKE_FAIL=1",
                 "--args", "b=--extra 0.25", "--", "--batches", "1"])
    lines = (out / "ab.md").read_text().splitlines()
    assert lines[2] == "| custom full bs 1 | 2.000 (2.000 / 2.000) | 3.750 (3.750 / 3.750) | - | +1.750 | - |"
    recorded = json.loads((out / "ab.json").read_text())["variants"]
    assert [v["args"] for v in recorded] == [[], ["--extra", "0.25"], []]
    assert recorded[1]["env"] == {"FAKE_EXTRA": "0.5"}
    assert json.loads((out / "ab.json").read_text())["left_out"] == ["c round 1 (no results written)",
                                                                "c round 2 (no results written)"]
    assert sorted(p.name for p in out.glob("*_r*.json")) == ["a_r1.json", "a_r2.json", "b_r1.json", "b_r2.json"]


def test_ab_json_names_a_tiles_table_relative_to_its_folder(ab, tmp_path):
    """A --tiles table lives under --out: ab.json names it from there, not by the machine's absolute path."""
    out = tmp_path / "out"
    env = {"TPGRAPH_GEMV_TABLE": str(out / "tables" / "d.json"), "OTHER": "/elsewhere/x.json", "X": "1"}
    assert ab.recorded_env(env, out) == {"TPGRAPH_GEMV_TABLE": "tables/d.json", "OTHER": "/elsewhere/x.json",
                                         "X": "1"}


def test_the_table_gives_medians_rounds_and_the_change_against_the_first(ab):
    result = {"tpot": [{"allreduce": "custom+gemv", "mode": "full", "batch": 1, "tpot_ms": 2.6},
                       {"allreduce": "custom+gemv", "mode": "full", "batch": 8, "tpot_ms": 2.9}]}
    new = ab.tpots(result)
    assert new == {"custom+gemv full bs 1": 2.6, "custom+gemv full bs 8": 2.9}
    runs = {"new": [new, {"custom+gemv full bs 1": 2.5}],
            "old": [{"custom+gemv full bs 1": 2.7, "custom+gemv full bs 8": 3.0}]}
    lines = ab.table(runs).splitlines()
    assert lines[0] == "| point | new (ms) | old (ms) | old - new |"
    assert lines[2] == "| custom+gemv full bs 1 | 2.550 (2.600 / 2.500) | 2.700 (2.700) | +0.150 |"
    assert lines[3] == "| custom+gemv full bs 8 | 2.900 (2.900) | 3.000 (3.000) | +0.100 |"
    assert ab.table({"new": [new], "old": []}).splitlines()[2].endswith("| - | - |")  # a variant with no run


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "ab_decode.py"), *args], capture_output=True,
                          text=True, cwd=REPO)


@pytest.mark.parametrize(("args", "reason"), [
    (["--out", "x", "--variant", "a=."], "at least two"),
    (["--out", "x", "--variant", "a=.", "--variant", "a=."], "labels must differ"),
    (["--out", "x", "--variant", "a=.", "--variant", "b=.", "--nproc", "0"], "--nproc must be at least 1"),
    (["--out", "x", "--variant", "a=.", "--variant", "b=.", "--timeout", "-5"], "--timeout must be positive"),
    (["--out", "x", "--variant", "a=.", "--variant", "b=.", "--", "--out", "y"], "set per run"),
    (["--out", "x", "--variant", "a=.", "--variant", "b=.", "--", "--out=y"], "set per run"),
    (["--out", "x", "--variant", "a=.", "--variant", "b=no/such/tree"], "holds no tpgraph package"),
    (["--out", "x", "--variant", "a=.", "--variant", "b=.", "--args", "c=--block-size 32"], "no such variant: ['c']"),
    (["--out", "x", "--variant", "a=.", "--variant", "b=.", "--args", "b=--context 1", "--args", "b=--context 2"],
     "given twice: ['b']"),
])
def test_mistakes_are_refused_before_anything_runs(args, reason, tmp_path):
    done = _main(*[str(tmp_path / a) if a in ("x", "y") else a for a in args])
    assert done.returncode == 2 and reason in done.stderr
    assert not (tmp_path / "x").exists()


def test_prepare_unpacks_a_revisions_package(tmp_path):
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    done = _main("--prepare", "HEAD", str(tmp_path / "head"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "head" / "tpgraph" / "__init__.py").is_file()
    assert (tmp_path / "head" / "tpgraph" / "kernels" / "gemv.py").is_file()
    # its tables beside it, where thresholds.config_dir looks for a package's configs
    assert (tmp_path / "head" / "configs" / "gemv" / "sm90.json").is_file()
    again = _main("--prepare", "HEAD", str(tmp_path / "head"))
    assert again.returncode != 0 and "exists" in again.stderr
    bad = _main("--prepare", "no-such-revision", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "git archive no-such-revision" in bad.stderr and not (tmp_path / "bad").exists()


def test_a_tiles_spec_names_entries_of_either_section(ab):
    label, entries = ab.parse_tiles("d2=4096,7168,1=32x128x4x5x2/epilogue:4096, 7168, 1=32x128x4x4x4")
    assert label == "d2"
    assert entries == [("best", "4096,7168,1", dict(block_n=32, block_k=128, num_warps=4, num_stages=5, split_k=2)),
                       ("epilogue", "4096,7168,1",
                        dict(block_n=32, block_k=128, num_warps=4, num_stages=4, split_k=4))]
    _, entries = ab.parse_tiles("r=4096,2048,1=32x2048x16x1x1x1")  # a sixth field: resident tiles
    assert entries == [("best", "4096,2048,1", dict(block_n=32, block_k=2048, num_warps=16, num_stages=1, split_k=1,
                                                    resident=True))]
    with pytest.raises(argparse.ArgumentTypeError, match="resident tiles take one row"):
        ab.parse_tiles("r=4096,2048,2=32x2048x16x1x1x1")  # more rows would silently take the default tiles


@pytest.mark.parametrize("text", ["d2", "d2=", "d2=4096,7168=32x128x4x5x2", "d2=4096,7168,1=32x128x4x5",
                                  "d2=4096,7168,1=32x128x4x5x2x1x1",
                                  "d2=prologue:4096,7168,1=32x128x4x5x2", "d2=4096,7168,1:32x128x4x5x2", "d2=/"])
def test_a_malformed_tiles_spec_is_refused_with_the_form(ab, text):
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=SPEC|an entry is|no entries"):
        ab.parse_tiles(text)


def test_a_variants_tiles_start_from_its_trees_table(ab, tmp_path):
    """The variant's own tree's table, the named entries replaced (a section added where missing), the rest kept;
    the variant's environment then names the written table, its other settings kept."""
    import json

    tree = tmp_path / "tree"
    (tree / "configs" / "gemv").mkdir(parents=True)
    keep = dict(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=1)
    (tree / "configs" / "gemv" / "sm90.json").write_text(json.dumps(
        {"arch": "sm90", "best": {"4096,7168,1": keep, "14336,4096,1": keep}}))
    _, entries = ab.parse_tiles("d=4096,7168,1=32x128x4x5x2/epilogue:4096,7168,1=32x128x4x4x4")
    v = ab.write_tiles(ab.Variant("d", tree, {"X": "1"}), entries, "sm90", tmp_path / "out")
    assert v.env["X"] == "1" and Path(v.env["TPGRAPH_GEMV_TABLE"]) == (tmp_path / "out" / "tables" / "d.json")
    table = json.loads(Path(v.env["TPGRAPH_GEMV_TABLE"]).read_text())
    assert table["arch"] == "sm90" and table["best"]["14336,4096,1"] == keep
    assert table["best"]["4096,7168,1"]["split_k"] == 2 and table["epilogue"]["4096,7168,1"]["split_k"] == 4
    with pytest.raises(SystemExit, match="not found"):
        ab.write_tiles(ab.Variant("d", tmp_path / "bare", {}), entries, "sm90", tmp_path / "out")


def test_tiles_only_for_a_given_variant_once(tmp_path):
    spec = "4096,7168,1=32x128x4x5x2"
    for args in (["--tiles", f"z={spec}"], ["--tiles", f"a={spec}", "--tiles", f"a={spec}"]):
        done = _main("--out", str(tmp_path / "x"), "--variant", "a=.", "--variant", "b=.", *args)
        assert done.returncode == 2 and "--tiles: one per variant" in done.stderr
        assert not (tmp_path / "x").exists()


HANGING_BENCH = """
import os, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
open(out + ".pid", "w").write(str(os.getpid()))
time.sleep(120)  # a rank that hangs (a collective waiting for a dead peer)
"""


def test_a_run_past_its_timeout_leaves_no_rank_behind(ab, tmp_path, monkeypatch):
    """A timed-out run's ranks are ended with it: left running, they hold the GPU while the next variant is timed."""
    import os
    import time

    tree = tmp_path / "tree"
    (tree / "tpgraph").mkdir(parents=True)
    (tree / "tpgraph" / "__init__.py").write_text("")
    (tree / "tpgraph" / "_C.fake.so").write_text("")
    (tmp_path / "bench.py").write_text(HANGING_BENCH)
    monkeypatch.setattr(ab, "BENCH", tmp_path / "bench.py")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="past 8 s"):
        ab.main(["--out", str(out), "--rounds", "1", "--timeout", "8", "--variant", f"a={tree}", "--variant",
                 f"b={tree}"])
    pids = [int(p.read_text()) for p in out.glob("*.pid")]
    assert len(pids) == 2  # both runs started a rank
    time.sleep(0.5)
    for pid in pids:
        alive = True
        try:
            os.kill(pid, 0)
            # a zombie (ended, not yet reaped by its exited parent's reaper) counts as ended
            alive = "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        assert not alive, f"rank {pid} of a timed-out run still runs"
