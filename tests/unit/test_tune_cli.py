"""tpgraph-tune's command line and its writing step, on synthetic measurements (the measuring itself needs GPUs)."""

import json
import os
import re
import shutil
from argparse import Namespace

import pytest

from tpgraph.comm.thresholds import Algo, config_dir, load_table
from tpgraph.tune.cli import _write, main
from tpgraph.tune.measure import Measurement, grids_for

SIZES = [4096 << i for i in range(15)]


def synthetic() -> list[Measurement]:
    out = []
    for mode in ("graph", "eager"):
        for i, n in enumerate(SIZES):
            winner = "1shot_push" if i < 5 else ("1shot_pull" if i < 8 else ("2shot_pull" if i < 12 else "nccl"))
            for algo in ("1shot_push", "1shot_pull", "2shot_pull", "nccl"):
                us = 10.0 if algo == winner else 20.0
                blocks = None if algo == "nccl" else (2 if n <= 65536 else 132)
                out.append(Measurement(mode, algo, n, us, blocks))
    return out


def args(tmp_path, **kw):
    base = dict(tolerance=0.03, min_points=2, dry_run=False, plot=None, log=tmp_path / "tune.json")
    return Namespace(**{**base, **kw})


def torchrun_ranks(monkeypatch) -> list:
    """A two-rank torchrun on an SM90 machine, as far as the CLI can tell: the ranks it starts are recorded (in the
    list returned), not run."""
    import torch

    from tpgraph.tune import cli

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(cli, "run_rank", lambda args, init: started.append(args) or 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    return started


def test_write_updates_this_world_size_only_and_logs(tmp_path):
    table = tmp_path / "sm90.json"
    shutil.copy(config_dir() / "allreduce" / "sm90.json", table)
    before = json.loads(table.read_text())
    _write(args(tmp_path), 2, 132, synthetic(), table, "synthetic provenance")
    t = load_table(table)
    for graph in (True, False):
        b = t.bands(2, graph)
        assert (b.push_max, b.pull1_max, b.pull2_max) == (SIZES[4], SIZES[7], SIZES[11])
        assert "synthetic provenance" in b.provenance
    after = json.loads(table.read_text())
    assert [r for r in after["rows"] if r["world_size"] != 2] == [r for r in before["rows"] if r["world_size"] != 2]
    # push is measured to 64 MB (above the 16 MiB slot, in pieces, as the product runs it): its grids reach there
    assert after["launch"]["push_blocks"]["2"] == [[65536, 2], [64 << 20, "num_sms"]]
    # the grids' provenance says so: the shipped note (ws=2 grids from bench_allreduce --sweep, 2026-11-29) stayed
    # as it was over the tuner's grids; a note for another world size stays
    assert after["launch_provenance"] == "world size 2 grids: synthetic provenance"
    doc = {**after, "launch_provenance": "world size 4 grids: by hand; world size 2 grids: old"}
    table.write_text(json.dumps(doc))
    _write(args(tmp_path), 2, 132, synthetic(), table, "again")
    note = json.loads(table.read_text())["launch_provenance"]
    assert note == "world size 4 grids: by hand; world size 2 grids: again"
    log = json.loads((tmp_path / "tune.json").read_text())
    assert len(log["measurements"]) == 2 * 4 * len(SIZES) and log["rows"]["graph"]["push_max"] == SIZES[4]


def test_the_measurements_are_logged_where_the_bands_cannot_be_derived(tmp_path):
    """The log was written after the bands: a run whose figures give none (no algorithm timed at a size) lost
    minutes of measurements with the error."""
    table = tmp_path / "sm90.json"
    shutil.copy(config_dir() / "allreduce" / "sm90.json", table)
    untimed = [m if m.nbytes != SIZES[3] else Measurement(m.mode, m.algo, m.nbytes, float("nan"), m.blocks)
               for m in synthetic()]
    with pytest.raises(ValueError):
        _write(args(tmp_path), 2, 132, untimed, table, "p")
    log = json.loads((tmp_path / "tune.json").read_text())
    assert len(log["measurements"]) == len(untimed) and "rows" not in log


def test_dry_run_prints_the_diff_and_writes_nothing(tmp_path, capsys):
    table = tmp_path / "sm90.json"
    shutil.copy(config_dir() / "allreduce" / "sm90.json", table)
    text = table.read_text()
    _write(args(tmp_path, dry_run=True, log=None), 2, 132, synthetic(), table, "synthetic provenance")
    assert table.read_text() == text
    out = capsys.readouterr().out
    assert "synthetic provenance" in out and f"+++ {table} (tuned)" in out


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    table = tmp_path / "sm90.json"
    shutil.copy(config_dir() / "allreduce" / "sm90.json", table)
    _write(args(tmp_path, plot=tmp_path / "tune.png", dry_run=True), 2, 132, synthetic(), table, "p")
    assert (tmp_path / "tune.png").stat().st_size > 10_000


def test_command_line_mistakes_are_refused(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([]) == 2 and "--world-size" in capsys.readouterr().err
    assert main(["--world-size", "2", "--runs", "5"]) == 2 and "at least 20" in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_measuring(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--world-size", "2", "--plot", "t.png"]) == 2 and "--plot needs matplotlib" in capsys.readouterr().err


def test_a_bad_table_is_refused_before_any_rank_starts(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--world-size", "2", "--table", str(config_dir() / "allreduce" / "sm100.json")]) == 2
    assert "is the 'sm100' table; these GPUs are sm90" in capsys.readouterr().err
    (tmp_path / "t.json").write_text("[1]")
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: each rank refuses alike, before its first collective
    assert main(["--table", str(tmp_path / "t.json")]) == 2 and "a table is an object" in capsys.readouterr().err


def test_max_bytes_is_checked_before_any_rank_starts_and_a_short_range_writes_no_table(monkeypatch, capsys, tmp_path):
    """--max-bytes 1 MiB measured up to 1 MiB only, and the row written from it sent every larger message to NCCL
    (the rule's last band) over the shipped table's bands, with nothing measured there: such a run only shows its
    diff. A size the kernels cannot take (or below the smallest measured) is refused before the ranks start."""


    started = torchrun_ranks(monkeypatch)
    assert main(["--max-bytes", str(1 << 20)]) == 2 and "--dry-run" in capsys.readouterr().err
    assert main(["--max-bytes", "100000008"]) == 2 and "multiple of 16" in capsys.readouterr().err
    assert main(["--max-bytes", "1024", "--dry-run"]) == 2 and "at least 4096" in capsys.readouterr().err
    assert not started
    assert main(["--max-bytes", str(1 << 20), "--dry-run"]) == 0 and main([]) == 0 and len(started) == 2


def test_world_sizes_the_table_has_no_rows_for_are_refused_before_any_rank_starts(monkeypatch, capsys):
    """torchrun with one rank (or nine), or --world-size 9 on a host of 16 GPUs: every rank used to start NCCL, then
    fail in CustomAllReduce with a traceback."""
    import torch
    import torch.multiprocessing as mp

    from tpgraph.tune import cli

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(cli, "run_rank", lambda args, init: started.append(args) or 0)
    monkeypatch.setattr(mp, "start_processes", lambda *a, **kw: started.append(kw))
    for world in ("1", "9"):
        monkeypatch.setenv("WORLD_SIZE", world)
        assert main([]) == 2 and f"torchrun started {world}" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["--world-size", "9"]) == 2 and "rows for 2..8 ranks" in capsys.readouterr().err
    assert not started
    assert main(["--world-size", "8"]) == 0 and len(started) == 1


def test_without_gpus_it_says_so_under_torchrun_or_not(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--world-size", "2"]) == 2 and "none is visible here" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")  # as under torchrun: refused before any rank looks for its GPU
    assert main([]) == 2 and "none is visible here" in capsys.readouterr().err


def test_the_table_is_replaced_whole_and_a_missing_one_is_named(tmp_path, monkeypatch):
    from tpgraph.errors import ConfigError

    table = tmp_path / "sm90.json"
    shutil.copy(config_dir() / "allreduce" / "sm90.json", table)
    before = table.read_bytes()

    def interrupted(src, dst):
        raise KeyboardInterrupt  # stopped between writing the new file and moving it into place

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _write(args(tmp_path), 2, 132, synthetic(), table, "p")
    assert table.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["sm90.json", "tune.json"]
    monkeypatch.undo()
    _write(args(tmp_path), 2, 132, synthetic(), table, "p")
    assert table.read_bytes() != before and load_table(table)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sm90.json", "tune.json"]  # no temp file left
    with pytest.raises(ConfigError, match="no such table to update"):
        _write(args(tmp_path, dry_run=True, log=None), 2, 132, synthetic(), tmp_path / "absent.json", "p")


def test_grids_stop_at_the_work_a_message_has():
    assert grids_for(Algo.PUSH_1SHOT, 4096, 2, 132) == [1, 2, 4, 8]  # 8 chunks of 512 bytes
    assert grids_for(Algo.PUSH_1SHOT, 64 << 20, 2, 132) == [1, 2, 4, 8, 16, 32, 64, 132, 264]
    assert grids_for(Algo.PULL_2SHOT, 8192 * 16 * 2, 2, 132) == [1, 2, 4, 8, 16]


def test_provenance_keeps_file_arguments_by_name_only():
    from tpgraph.tune.cli import _without_paths

    argv = ["--world-size", "2", "--plot", "/some/dir/tune.png", "--log=/other/dir/tune.json", "--dry-run"]
    assert _without_paths(argv) == ["--world-size", "2", "--plot", "tune.png", "--log=tune.json", "--dry-run"]


def test_a_table_of_another_architecture_is_refused(tmp_path):
    from tpgraph.errors import ConfigError
    from tpgraph.tune.cli import check_table_arch

    check_table_arch(config_dir() / "allreduce" / "sm90.json", "sm90")
    with pytest.raises(ConfigError, match="is the 'sm100' table; these GPUs are sm90"):
        check_table_arch(config_dir() / "allreduce" / "sm100.json", "sm90")
    with pytest.raises(ConfigError, match="no such table"):
        check_table_arch(tmp_path / "none.json", "sm90")


def test_tables_refuse_unknown_keys_and_another_architectures_file(tmp_path, monkeypatch):
    from tpgraph.comm.thresholds import load_table_for
    from tpgraph.errors import ConfigError

    (tmp_path / "allreduce").mkdir()
    doc = json.loads((config_dir() / "allreduce" / "sm90.json").read_text())
    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path))
    (tmp_path / "allreduce" / "sm90.json").write_text(json.dumps({**doc, "arch": "sm100"}))
    with pytest.raises(ConfigError, match="says arch 'sm100', but it is the sm90.json table"):
        load_table_for((9, 0))
    doc["Launch"] = doc.pop("launch")  # misspelt: would fall back to the default grids
    (tmp_path / "allreduce" / "sm90.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"unknown keys \['Launch'\]"):
        load_table_for((9, 0))


def test_a_config_dir_without_the_table_names_the_variable_and_a_fix_that_works(tmp_path, monkeypatch):
    """TPGRAPH_CONFIG_DIR pointing at the wrong folder said "does not exist (run tpgraph-tune or restore it)", but
    tpgraph-tune refuses a table that does not exist: the message named neither the variable nor a fix that works."""
    from tpgraph.comm.thresholds import load_table_for
    from tpgraph.errors import ConfigError

    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path))
    named = re.escape(f"TPGRAPH_CONFIG_DIR={tmp_path} has no allreduce/sm90.json")
    with pytest.raises(ConfigError, match=named) as err:
        load_table_for((9, 0))
    assert "unset TPGRAPH_CONFIG_DIR" in str(err.value) and "run tpgraph-tune" not in str(err.value)
    with pytest.raises(ConfigError, match="restore it from tpgraph's configs/allreduce") as err:
        load_table(tmp_path / "sm90.json")
    assert "run tpgraph-tune" not in str(err.value)


@pytest.mark.parametrize("flag", ["--log", "--plot"])
def test_a_log_or_plot_that_cannot_be_written_is_refused_before_measuring(flag, monkeypatch, capsys, tmp_path):
    """They are written after minutes of measuring, and before the table: a --log in a folder that does not exist
    ended the run there with a FileNotFoundError traceback, its measurements and the table's update lost."""


    started = torchrun_ranks(monkeypatch)
    assert main([flag, str(tmp_path / "absent" / "tune.out")]) == 2
    assert f"there is no folder {tmp_path / 'absent'} to write it in" in capsys.readouterr().err
    folder = tmp_path / "out.png"  # (with a suffix: a --plot without one is written with ".png" added, beside it)
    folder.mkdir()
    assert main([flag, str(folder)]) == 2 and "a folder, not a file" in capsys.readouterr().err
    assert not started
    if flag == "--log":
        assert main([flag, str(tmp_path / "tune.json")]) == 0 and len(started) == 1


@pytest.mark.parametrize("flag", ["--log", "--plot"])
def test_a_log_or_plot_in_a_folder_or_file_that_is_not_writable_is_refused_before_measuring(flag, monkeypatch, capsys,
                                                                                           tmp_path):
    """Only the folder's existence was checked: a --log or --plot in a read-only folder (or over a read-only file)
    passed, and after minutes of measuring its write ended the run in a PermissionError traceback, before the table
    was written."""
    started = torchrun_ranks(monkeypatch)
    locked, kept = tmp_path / "locked", tmp_path / "kept.png"
    locked.mkdir()
    kept.write_text("")
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) in (str(locked), str(kept)) else
                        real(path, mode, **kw))
    assert main([flag, str(locked / "tune.png")]) == 2
    assert f"the folder {locked} is not writable" in capsys.readouterr().err
    assert main([flag, str(kept)]) == 2 and "the file is not writable" in capsys.readouterr().err
    assert not started
    assert main([flag, str(tmp_path / "tune.png")]) == 0 and len(started) == 1


def test_a_log_and_a_plot_naming_one_file_are_refused_before_measuring(monkeypatch, capsys, tmp_path):
    """--log tune.png --plot tune.png: the plot was written over the log, and the measurements it kept (the only
    record of minutes of measuring where deriving the bands failed) were lost."""
    pytest.importorskip("matplotlib")
    started = torchrun_ranks(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["--log", "tune.png", "--plot", str(tmp_path / "tune.png")]) == 2
    err = capsys.readouterr().err
    assert "--log tune.png and --plot" in err and "name one file" in err
    assert not started
    assert main(["--log", "tune.json", "--plot", "tune.png"]) == 0 and len(started) == 1


def test_a_plot_named_without_a_suffix_is_checked_where_matplotlib_writes_it(monkeypatch, capsys, tmp_path):
    """--plot tune: matplotlib writes tune.png, but the checks before the measuring judged "tune": a folder
    tune.png passed them and the plot's write failed after the measuring (an IsADirectoryError traceback, the
    table not written), while a folder "tune" refused a plot that would have been written beside it."""
    pytest.importorskip("matplotlib")
    started = torchrun_ranks(monkeypatch)
    (tmp_path / "tune.png").mkdir()
    assert main(["--plot", str(tmp_path / "tune")]) == 2
    assert f"--plot {tmp_path / 'tune.png'}: a folder, not a file" in capsys.readouterr().err and not started
    (tmp_path / "other").mkdir()
    assert main(["--plot", str(tmp_path / "other")]) == 0 and started[0].plot == tmp_path / "other.png"


@pytest.mark.parametrize("tolerance", ["3", "1", "nan", "-0.1"])
def test_a_tolerance_that_is_not_a_fraction_is_refused_before_measuring(tolerance, monkeypatch, capsys):
    """--tolerance 3 (meant as 3%) counted anything within 4x of the fastest as fast, and nan everything: the fewest
    bands then won, and on synthetic()'s curves the row written sent every size to 1shot_push, twice as slow as the
    winner at 10 of the 15 sizes."""


    started = torchrun_ranks(monkeypatch)
    assert main(["--tolerance", tolerance]) == 2 and "--tolerance is a fraction" in capsys.readouterr().err
    assert not started
    assert main(["--tolerance", "0"]) == 0 and len(started) == 1


def test_max_bytes_above_the_largest_size_measured_is_refused(monkeypatch, capsys):
    """--max-bytes 128 MiB (help: "largest size measured") measured up to 64 MiB all the same, wrote rows as if
    128 MiB had been, and sized every rank's staging buffer for it."""


    started = torchrun_ranks(monkeypatch)
    assert main(["--max-bytes", str(128 << 20)]) == 2 and "at most 67108864" in capsys.readouterr().err
    assert not started
    assert main(["--max-bytes", str(64 << 20)]) == 0 and len(started) == 1


def test_a_world_size_that_differs_from_torchruns_is_refused(monkeypatch, capsys):
    """Under torchrun --nproc-per-node 2, --world-size 4 was ignored without a word: the rows written were for 2."""


    started = torchrun_ranks(monkeypatch)
    assert main(["--world-size", "4"]) == 2
    assert "--world-size 4, but torchrun started 2" in capsys.readouterr().err and not started
    assert main(["--world-size", "2"]) == 0 and len(started) == 1


def test_a_table_that_cannot_be_written_is_refused_before_measuring(monkeypatch, capsys, tmp_path):
    """The shipped table of an install in a read-only site-packages: minutes of measuring, then a PermissionError
    traceback moving the new table into place, and without --log the run was lost. --dry-run writes no table."""
    import shutil as sh


    table = tmp_path / "sm90.json"
    sh.copy(config_dir() / "allreduce" / "sm90.json", table)
    started = torchrun_ranks(monkeypatch)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(tmp_path) else
                        real(path, mode, **kw))
    assert main(["--table", str(table)]) == 2
    assert f"cannot write a new {table} there" in capsys.readouterr().err and not started
    assert main(["--table", str(table), "--dry-run"]) == 0 and len(started) == 1


def test_a_machine_without_the_custom_all_reduce_is_told_so_not_shown_a_traceback(monkeypatch, capsys):
    """tpgraph-tune where the custom all-reduce cannot run (NCCL_P2P_DISABLE=1, GPUs without NVLink at 3 ranks up)
    ended every rank in a traceback of its AllReduceUnavailable, and the launcher in another of the ranks' exit."""
    from types import SimpleNamespace

    import torch
    import torch.multiprocessing as mp

    import tpgraph.comm.custom_ar as custom_ar
    import tpgraph.distributed as td
    from tpgraph.errors import AllReduceUnavailable
    from tpgraph.tune.cli import parse_args, run_rank

    state = SimpleNamespace(is_driver=True)

    def unavailable(*a, **kw):
        raise AllReduceUnavailable("custom all-reduce disabled: NCCL_P2P_DISABLE=1 forbids peer-to-peer traffic")

    closed = []
    monkeypatch.setattr(td, "init_distributed", lambda *a, **kw: state)
    monkeypatch.setattr(td, "destroy_distributed", lambda s: closed.append(s))
    monkeypatch.setattr(custom_ar, "CustomAllReduce", unavailable)
    assert run_rank(parse_args([]), (0, 2, "tcp://x")) == 2 and closed == [state]
    assert "error: nothing to tune here: custom all-reduce disabled: NCCL_P2P_DISABLE=1" in capsys.readouterr().err

    def exited(*a, **kw):
        raise mp.ProcessExitedException("process 0 terminated with exit code 2", 0, 1234, 2)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(mp, "start_processes", exited)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--world-size", "2", "--dry-run"]) == 2


@pytest.mark.parametrize("flag", ["--log", "--plot"])
def test_a_log_or_plot_written_over_the_table_being_tuned_is_refused(flag, monkeypatch, capsys, tmp_path):
    """--log naming the table itself (--dry-run too) wrote the measurements over the table first, then failed reading
    it back as a table: the table was lost."""
    import shutil as sh


    if flag == "--plot":
        pytest.importorskip("matplotlib")
    name = "sm90.json" if flag == "--log" else "sm90.png"  # (a table may have any name; a plot, a figure's suffix)
    table = tmp_path / name
    sh.copy(config_dir() / "allreduce" / "sm90.json", table)
    started = torchrun_ranks(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["--table", str(table), "--dry-run", flag, name]) == 2
    assert f"{flag} {name} is the table being tuned" in capsys.readouterr().err and not started


def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused_before_measuring(monkeypatch, capsys, tmp_path):
    """--plot tune.txt measured for minutes, then matplotlib refused the format while plotting, before the table was
    written: the run's table update was lost."""
    pytest.importorskip("matplotlib")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--world-size", "2", "--plot", str(tmp_path / "tune.txt")]) == 2
    assert "--plot" in (err := capsys.readouterr().err) and "not .txt" in err and "png" in err


def test_the_config_dir_fix_names_every_table_the_folder_serves(tmp_path, monkeypatch):
    """TPGRAPH_CONFIG_DIR without the all-reduce table said "copy tpgraph's configs/allreduce there": a folder made so
    has no gemv/ tables, which the GEMV kernels then read from it no more, falling back to default tiles silently."""
    from tpgraph.comm.thresholds import load_table_for
    from tpgraph.errors import ConfigError

    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"copy tpgraph's configs folder \(allreduce/ and gemv/\) there"):
        load_table_for((9, 0))


@pytest.mark.parametrize("points", ["0", "-3"])
def test_a_min_points_below_one_is_refused_before_measuring(points, monkeypatch, capsys):
    """--min-points 0 or -3 was taken and derived bands as --min-points 1 would (a band of one noisy size), unsaid."""


    started = torchrun_ranks(monkeypatch)
    assert main(["--min-points", points]) == 2
    assert f"--min-points must be at least 1, got {points}" in capsys.readouterr().err
    assert not started
    assert main(["--min-points", "1"]) == 0 and len(started) == 1


def test_a_world_size_variable_that_is_no_integer_is_refused_by_name(monkeypatch, capsys):
    """WORLD_SIZE=two (a launcher's, or a leftover export) ended tpgraph-tune in a ValueError traceback."""
    import torch

    from tpgraph.tune import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(cli, "run_rank", lambda args, init: pytest.fail("a rank ran"))
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main([]) == 2 and "environment variable WORLD_SIZE='two' is not an integer" in capsys.readouterr().err


@pytest.mark.parametrize("error", ["cudaErrorNoKernelImageForDevice", "cudaErrorOperatingSystem"])
def test_a_cuda_error_of_the_machine_in_the_set_up_is_told_so_not_shown_a_traceback(error, monkeypatch, capsys):
    """The engine falls back to NCCL on a CUDA error that is the machine's (topology.UNAVAILABLE_CUDA_ERRORS: a GPU
    tpgraph._C has no kernels for, CUDA IPC refused); tpgraph-tune caught only tpgraph's own errors, so on such a
    machine every rank ended in a traceback of the extension's RuntimeError. Any other RuntimeError is still raised."""
    from types import SimpleNamespace

    import tpgraph.comm.custom_ar as custom_ar
    import tpgraph.distributed as td
    from tpgraph.tune.cli import parse_args, run_rank

    state, raised = SimpleNamespace(is_driver=True), []

    def failing(*a, **kw):
        raise raised[-1]

    closed = []
    monkeypatch.setattr(td, "init_distributed", lambda *a, **kw: state)
    monkeypatch.setattr(td, "destroy_distributed", lambda s: closed.append(s))
    monkeypatch.setattr(custom_ar, "CustomAllReduce", failing)
    raised.append(RuntimeError(f"CUDA error {error} (from the driver) in `ar_create`"))
    assert run_rank(parse_args([]), (0, 2, "tcp://x")) == 2 and closed == [state]
    assert f"error: nothing to tune here: CUDA error {error}" in capsys.readouterr().err
    raised.append(RuntimeError("CUDA error cudaErrorIllegalAddress (a bug) in `ar_create`"))
    with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress"):
        run_rank(parse_args([]), (0, 2, "tcp://x"))


def test_ranks_sharing_one_gpu_write_no_table(monkeypatch, capsys):
    """TPGRAPH_SHARED_GPU=1 (left set from the one-GPU TP tests) puts every rank on GPU 0, where the ranks take the GPU
    in turns and NCCL talks over sockets: "results, never timings". tpgraph-tune measured there and wrote its figures
    into the table every real run reads. --dry-run still shows them."""
    started = torchrun_ranks(monkeypatch)
    monkeypatch.setenv("TPGRAPH_SHARED_GPU", "1")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "TPGRAPH_SHARED_GPU=1" in err and "--dry-run" in err and not started
    assert main(["--dry-run"]) == 0 and len(started) == 1


def test_torchrun_starting_more_ranks_on_a_host_than_it_has_gpus_is_refused_before_any_rank_starts(monkeypatch,
                                                                                                    capsys):
    """torchrun --nproc-per-node 4 on a host of 2 GPUs: the spawn path says "needs 2..2 GPUs here", but under torchrun
    the ranks without a GPU ended in a ConfigError traceback from the process group's start, and the others in a
    PeerError traceback about them."""
    import torch

    started = torchrun_ranks(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "torchrun started 4 ranks on this host" in err and "2 GPUs are visible" in err and not started
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # (two hosts of two GPUs: each rank has its GPU)
    assert main([]) == 0 and len(started) == 1


def test_a_table_that_is_a_link_or_shared_by_a_group_stays_so_when_written(tmp_path, monkeypatch, capsys):
    """The new table was moved into place over the table's path: a table kept as a link (TPGRAPH_CONFIG_DIR's
    allreduce/sm90.json pointing into a checkout of tables) became a file of its own there, the link's target kept the
    old rows, and a group-writable table became one only its writer could change."""
    shared = tmp_path / "tables"
    shared.mkdir()
    target = shared / "sm90.json"
    shutil.copy(config_dir() / "allreduce" / "sm90.json", target)
    os.chmod(target, 0o664)
    link = tmp_path / "sm90.json"
    link.symlink_to(target)
    _write(args(tmp_path), 2, 132, synthetic(), link, "p")
    assert link.is_symlink() and link.resolve() == target
    assert load_table(target).bands(2, True).push_max == SIZES[4]
    assert os.stat(target).st_mode & 0o777 == 0o664
    assert sorted(p.name for p in shared.iterdir()) == ["sm90.json"]  # no temp file left
    # and the folder checked before the measuring is the one the new file is written in
    started = torchrun_ranks(monkeypatch)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == str(shared) else
                        real(path, mode, **kw))
    assert main(["--table", str(link)]) == 2 and f"cannot write a new {target} there" in capsys.readouterr().err
    assert not started


def test_a_config_dir_without_the_table_is_named_with_a_fix_that_works(tmp_path, monkeypatch, capsys):
    """TPGRAPH_CONFIG_DIR naming a folder without the table (mistyped, or made empty to tune into): tpgraph-tune said
    "no such table to update (give --table an existing one)", but with --table the ranks' set-up still read the
    variable's table (sizing the workspace) and failed there, after the process group had started."""
    started, shipped = torchrun_ranks(monkeypatch), config_dir() / "allreduce" / "sm90.json"
    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path))
    for extra in ([], ["--table", str(shipped)]):
        assert main(extra) == 2
        err = capsys.readouterr().err
        assert f"TPGRAPH_CONFIG_DIR={tmp_path} has no allreduce/sm90.json" in err and "give --table" not in err
    assert not started


@pytest.mark.parametrize("gpus, world, said", [
    (1, "2", "--world-size 2 starts one rank per GPU, but 1 GPU is visible: the all-reduce is tuned across 2 "
             "GPUs at least"),
    (2, "4", "--world-size 4 starts one rank per GPU, but 2 GPUs are visible: give --world-size 2"),
    (4, "3", None)])
def test_a_world_size_beyond_the_gpus_here_says_what_to_give(gpus, world, said, monkeypatch, capsys):
    """--world-size 2 on one GPU said "--world-size 2 needs 2..1 GPUs here", and --world-size 4 on two "needs 2..2
    GPUs here": ranges that say neither what is wrong nor what to give."""
    import torch
    import torch.multiprocessing as mp

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(mp, "start_processes", lambda *a, **kw: started.append(kw))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if said is None:
        assert main(["--world-size", world]) == 0 and len(started) == 1
    else:
        assert main(["--world-size", world]) == 2 and said in capsys.readouterr().err and not started


def test_a_rank_killed_by_a_signal_is_named_and_the_exit_status_says_failure(monkeypatch, capsys):
    """A rank killed by a signal (the OOM killer's SIGKILL, a SIGSEGV) said nothing, unlike a rank that exits with an
    error of its own; tpgraph-tune swallowed torch's "process 1 terminated with signal SIGKILL" and returned its
    negative exit code: the run ended without a word, in exit status 247."""
    import torch
    import torch.multiprocessing as mp

    raised = []

    def exited(*a, **kw):
        raise raised[-1]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(mp, "start_processes", exited)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    raised.append(mp.ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 1234, -9, "SIGKILL"))
    assert main(["--world-size", "2", "--dry-run"]) == 1
    assert "error: rank 1 was killed by signal SIGKILL" in capsys.readouterr().err
    raised.append(mp.ProcessExitedException("process 0 terminated with exit code 2", 0, 1234, 2))
    assert main(["--world-size", "2", "--dry-run"]) == 2 and capsys.readouterr().err == ""  # (it said why itself)


def test_a_plot_in_a_format_this_machine_cannot_render_is_refused_before_measuring(monkeypatch, capsys, tmp_path):
    """--plot tune.pgf: matplotlib lists pgf, so the check passed, but it renders pgf through xelatex, which a GPU
    server seldom has: minutes of measuring, then a RuntimeError while plotting, before the table was written."""
    pytest.importorskip("matplotlib")
    if shutil.which("xelatex"):
        pytest.skip("xelatex is installed: pgf renders here")
    started = torchrun_ranks(monkeypatch)
    assert main(["--plot", str(tmp_path / "tune.pgf")]) == 2
    err = capsys.readouterr().err
    assert f"--plot {tmp_path / 'tune.pgf'}: matplotlib cannot write .pgf here" in err and "xelatex" in err
    assert not started
    assert main(["--plot", str(tmp_path / "tune.svg")]) == 0 and len(started) == 1
    assert not (tmp_path / "tune.svg").exists()  # (the trial render wrote nothing there)


def test_two_tuners_writing_one_table_keep_each_others_rows(tmp_path, monkeypatch):
    """Two world sizes tuned at once on one host (GPUs 0-1 and 2-5) write one table: each read it, plotted (a second
    or so), then moved its copy into place, so the one that read first and wrote last dropped the other's rows."""
    import threading
    import time

    from tpgraph.tune import writer

    table = tmp_path / "sm90.json"
    shutil.copy(config_dir() / "allreduce" / "sm90.json", table)
    real, others = writer.updated_table, []

    def meanwhile(doc, world_size, *a, **kw):  # the other tuner finishes while this one holds what it read
        if not others:
            others.append(threading.Thread(target=_write, args=(args(tmp_path, log=None), 4, 132, synthetic(), table,
                                                                "other")))
            others[0].start()
            time.sleep(0.5)
        return real(doc, world_size, *a, **kw)

    monkeypatch.setattr(writer, "updated_table", meanwhile)
    _write(args(tmp_path, log=None), 2, 132, synthetic(), table, "this")
    others[0].join(timeout=30)
    t = load_table(table)
    assert "this" in t.bands(2, True).provenance and "other" in t.bands(4, True).provenance
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sm90.json"]  # no temp or lock file left
