import json
import os

import pytest
import torch

from tpgraph.comm.multicast import DISABLING_VARIABLES, multicast_disabled_reason
from tpgraph.comm.thresholds import (
    MODES,
    WORLD_SIZES,
    Algo,
    config_dir,
    load_table,
    load_table_for,
    parse_table,
    pick_algo,
)
from tpgraph.errors import ConfigError

ARCHS = {"sm90": (9, 0), "sm100": (10, 0), "other": (8, 0)}


def multicast_allowed(env: dict[str, str]) -> bool:
    return multicast_disabled_reason(env) is None


KB, MB = 1 << 10, 1 << 20
# A row with every band open: push <= 64 KB, 1shot_pull <= 1 MB, multicast 2..8 MB (when live), 2shot_pull <= 32 MB.
ROW = {"push_max": 64 * KB, "pull1_max": 1 * MB, "pull2_max": 32 * MB, "multicast": [2 * MB, 8 * MB]}
# (bytes, multicast live) -> the answer, written out by hand
ANSWERS = [
    (16, False, Algo.PUSH_1SHOT), (64 * KB, False, Algo.PUSH_1SHOT), (64 * KB + 16, False, Algo.PULL_1SHOT),
    (1 * MB, False, Algo.PULL_1SHOT), (1 * MB + 16, False, Algo.PULL_2SHOT), (2 * MB, False, Algo.PULL_2SHOT),
    (2 * MB, True, Algo.MULTICAST_2SHOT), (8 * MB, True, Algo.MULTICAST_2SHOT), (8 * MB + 16, True, Algo.PULL_2SHOT),
    (1 * MB + 16, True, Algo.PULL_2SHOT), (32 * MB, True, Algo.PULL_2SHOT), (32 * MB + 16, False, Algo.NCCL),
    (32 * MB + 16, True, Algo.NCCL), (64 * KB, True, Algo.PUSH_1SHOT), (24, False, Algo.NCCL),  # not 16-byte whole
]


def table_with_row(row: dict):
    doc = json.loads((config_dir() / "allreduce" / "sm90.json").read_text())
    for r in doc["rows"]:
        if r["world_size"] == 4:
            r.update(row)
    return parse_table(doc, "test")


@pytest.mark.parametrize(("nbytes", "mc_live", "answer"), ANSWERS)
@pytest.mark.parametrize("graph", [True, False])
def test_pick_algo_gives_the_written_answers(nbytes, mc_live, answer, graph):
    assert pick_algo(nbytes, graph, table_with_row(ROW), 4, multicast_live=mc_live) == answer


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_shipped_bounds_are_inclusive(arch, ws, mode):
    table = load_table_for(ARCHS[arch])
    b = table.bands(ws, mode == "graph")
    graph = mode == "graph"
    if b.push_max:
        assert pick_algo(b.push_max, graph, table, ws) == Algo.PUSH_1SHOT
    if b.pull1_max > b.push_max:
        assert pick_algo(b.pull1_max, graph, table, ws) == Algo.PULL_1SHOT
        assert pick_algo(b.push_max + 16, graph, table, ws) == Algo.PULL_1SHOT
    if b.pull2_max > b.pull1_max:
        assert pick_algo(b.pull2_max, graph, table, ws) == Algo.PULL_2SHOT
    assert pick_algo(b.pull2_max + 16, graph, table, ws, multicast_live=False) == Algo.NCCL


def test_published_sm100_ws2_rows():
    t = load_table_for((10, 0))
    assert pick_algo(8 << 20, True, t, 2) == Algo.PUSH_1SHOT
    assert pick_algo((8 << 20) + 16, True, t, 2) == Algo.PULL_1SHOT
    assert pick_algo((32 << 20) + 16, True, t, 2) == Algo.PULL_2SHOT
    assert pick_algo((128 << 20) + 16, True, t, 2) == Algo.NCCL
    assert pick_algo((8 << 20) + 16, False, t, 2) == Algo.PUSH_1SHOT  # eager push bound is 16 MB


def test_graph_and_eager_differ_and_multicast_needs_liveness():
    t = load_table_for((9, 0))
    n = 1 << 20  # ws=8: graph row has multicast 512KB..128MB, eager 0..128MB; push/pull1 128KB
    assert pick_algo(n, True, t, 8) == Algo.PULL_2SHOT
    assert pick_algo(n, True, t, 8, multicast_live=True) == Algo.MULTICAST_2SHOT
    assert pick_algo(256 << 10, True, t, 8, multicast_live=True) == Algo.PULL_2SHOT  # below the graph mc range
    assert pick_algo(256 << 10, False, t, 8, multicast_live=True) == Algo.MULTICAST_2SHOT


@pytest.mark.parametrize("kwargs", [
    dict(nbytes=8200),  # not a multiple of 16
    dict(nbytes=8192, contiguous=False),
    dict(nbytes=8192, dtype=torch.int32),
    dict(nbytes=8192, dtype=torch.float64),
    dict(nbytes=8192, multi_node=True),
    dict(nbytes=0),
    dict(nbytes=1 << 40),  # above every band
])
def test_falls_back_to_nccl(kwargs):
    t = load_table_for((9, 0))
    n = kwargs.pop("nbytes")
    assert pick_algo(n, True, t, 2, **kwargs) == Algo.NCCL
    assert pick_algo(n, False, t, 2, **kwargs) == Algo.NCCL


def test_unsupported_world_size_is_nccl():
    t = load_table_for((9, 0))
    assert pick_algo(8192, True, t, 1) == Algo.NCCL
    assert pick_algo(8192, True, t, 16) == Algo.NCCL


def test_every_row_has_provenance():
    for name in ("sm90", "sm100", "other"):
        t = load_table(config_dir() / "allreduce" / f"{name}.json")
        assert all(b.provenance for b in t.rows.values())
        assert len(t.rows) == len(WORLD_SIZES) * len(MODES)


def good_doc():
    return json.loads((config_dir() / "allreduce" / "sm90.json").read_text())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["rows"][0].update(push_max=1000), "multiples of 16"),
    (lambda d: d["rows"][0].update(push_max=-16), "non-negative"),
    (lambda d: d["rows"][0].update(push_max="16MB"), "multiples of 16"),
    (lambda d: d["rows"][0].update(pull1_max=16), "push_max <= pull1_max <= pull2_max"),
    (lambda d: d["rows"][0].update(mode="warm"), "mode must be 'graph' or 'eager'"),
    (lambda d: d["rows"][0].update(world_size=9), "world_size must be an integer in 2..8"),
    (lambda d: d["rows"][0].update(multicast=[64, 32]), "is empty"),
    (lambda d: d["rows"][0].update(multicast=[64]), "multicast must be null or"),
    (lambda d: d["rows"][0].update(provenance=""), "provenance"),
    (lambda d: d["rows"][0].update(bogus=1), "unknown keys \\['bogus'\\]"),
    (lambda d: d["rows"][0].pop("pull2_max"), "missing keys \\['pull2_max'\\]"),
    (lambda d: d["rows"].append(dict(d["rows"][0])), "duplicate row for world_size=2, mode=graph"),
    (lambda d: d["rows"].pop(3), "rows missing for world_size/mode 3/eager"),
    (lambda d: d.pop("rows"), "'rows' \\(list\\)"),
])
def test_loader_rejects_malformed_tables(mutate, message):
    doc = good_doc()
    mutate(doc)
    with pytest.raises(ConfigError, match=message):
        parse_table(doc, "test.json")


def test_loader_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_table(tmp_path / "sm90.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_table(tmp_path / "bad.json")


def test_a_table_that_is_not_text_or_not_a_file_is_named(tmp_path):
    """A corrupt copy (bytes that are not UTF-8) or a folder in the table's place came out of the engine's start as a
    UnicodeDecodeError or IsADirectoryError traceback, not the ConfigError the launchers print in one line."""
    (tmp_path / "sm90.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match="sm90.json is not valid JSON"):
        load_table(tmp_path / "sm90.json")
    (tmp_path / "sm100.json").mkdir()
    with pytest.raises(ConfigError, match="cannot read the all-reduce table .*sm100.json"):
        load_table(tmp_path / "sm100.json")


LAUNCH = {"push_blocks": {"default": [[1 << 20, 4], [4 << 20, 32], [16 << 20, "num_sms"], [1 << 30, "num_sms*2"]]},
          "pull1_blocks": {"default": [[1 << 30, 64]]},
          "pull2_blocks": {"2": [[1 << 30, "num_sms"]], "default": [[1 << 30, 96]]},
          "multicast_blocks": {"8": [[1 << 30, 32]]}}


def launch_table(launch=LAUNCH):
    doc = good_doc()
    doc["launch"] = launch
    return parse_table(doc, "test.json")


def test_launch_blocks():
    t = launch_table()
    assert t.blocks(Algo.PULL_1SHOT, 2, 132) == 64
    assert t.blocks(Algo.PULL_2SHOT, 2, 148) == 148
    assert t.blocks(Algo.PULL_2SHOT, 4, 148) == 96
    assert t.blocks(Algo.MULTICAST_2SHOT, 8, 148) == 32
    assert t.blocks(Algo.MULTICAST_2SHOT, 4, 148) == 64  # absent: the default
    assert t.blocks(Algo.PULL_1SHOT, 2, 32) == 32  # never more blocks than SMs


def test_launch_block_bands_pick_the_first_that_holds_the_message():
    t = launch_table()
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=1 << 20) == 4
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=(1 << 20) + 16) == 32
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=4 << 20) == 32
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=(4 << 20) + 16) == 132
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=16 << 20) == 132
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=64 << 20) == 264  # two blocks per SM
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=1 << 31) == 264  # beyond the last band: the last band


@pytest.mark.parametrize(("launch", "message"), [
    ({"pull_blocks": {}}, "unknown launch keys \\['pull_blocks'\\]"),
    ({"push_blocks": 64}, "must be an object of world size"),  # the one spelling: no bare grids
    ({"push_blocks": [[1024, 4]]}, "must be an object of world size"),
    ({"push_blocks": {"default": 64}}, "non-empty list of \\[max_bytes, grid\\] bands"),
    ({"push_blocks": {"default": []}}, "non-empty list"),
    ({"push_blocks": {"default": [[1024, 0]]}}, "a grid is 1..1024"),
    ({"push_blocks": {"default": [[1024, "all"]]}}, "a grid is 1..1024"),
    ({"push_blocks": {"default": [[1024, "num_sms*0"]]}}, "a grid is 1..1024"),
    ({"push_blocks": {"default": [[1024, 4], [512, 8]]}}, "growing max_bytes"),
    ({"push_blocks": {"default": [[1024, [[2048, 4]]]]}}, "a grid is 1..1024"),
    ({"pull2_blocks": {"9": [[1024, 4]]}}, "world sizes 2..8"),
    # spellings that would pass as a world size, a length or k but that blocks() never reads (or int() refuses)
    ({"pull2_blocks": {"02": [[1024, 4]]}}, "world sizes 2..8"),
    ({"pull2_blocks": {"\u00b2": [[1024, 4]]}}, "world sizes 2..8"),
    ({"push_blocks": {"default": [[1024, "num_sms*\u00b2"]]}}, "a grid is 1..1024"),
    ({"push_blocks": {"default": [[True, 4]]}}, "growing max_bytes"),
    ([], "'launch' must be an object"),
])
def test_loader_rejects_malformed_launch(launch, message):
    with pytest.raises(ConfigError, match=message):
        launch_table(launch)


def test_shipped_launch_specs_resolve_everywhere():
    for cap in ((9, 0), (10, 0), (8, 0)):
        t = load_table_for(cap)
        for algo in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT, Algo.MULTICAST_2SHOT):
            for ws in range(2, 9):
                for nbytes in (16, 8192, 1 << 20, 64 << 20):
                    assert 1 <= t.blocks(algo, ws, 132, nbytes) <= 8 * 132


@pytest.mark.parametrize(("name", "value"), DISABLING_VARIABLES)
def test_multicast_unavailable_under_each_variable(name, value):
    assert multicast_allowed({})
    reason = multicast_disabled_reason({name: value})
    assert reason is not None and name in reason
    assert not multicast_allowed({name: value})


def test_clear_enabling_values_leave_multicast_on_and_true_switches_it_off():
    assert multicast_allowed({"NCCL_NVLS_ENABLE": "1", "TPGRAPH_DISABLE_MULTICAST": "0"})
    assert not multicast_allowed({"TPGRAPH_DISABLE_MULTICAST": "true"})


@pytest.mark.parametrize("value", ["0", "00", "0x0", " 0 ", "false", "off", "no", "abc", "+", " ", "\xa01"])
def test_nccls_switch_is_off_wherever_nccl_reads_0(value):
    """NCCL reads NCCL_NVLS_ENABLE with strtoll(value, NULL, 0): these all turn NVLS off there, so here too."""
    assert not multicast_allowed({"NCCL_NVLS_ENABLE": value})


@pytest.mark.parametrize("value", ["1", "2", "0x10", "-1", "1abc", ""])
def test_nccls_switch_stays_on_at_a_nonzero_number_or_empty(value):
    assert multicast_allowed({"NCCL_NVLS_ENABLE": value})


@pytest.mark.parametrize(("value", "off"), [("1", True), ("2", True), ("on", True), ("y", True), ("abc", True),
                                            ("0", False), ("00", False), ("false", False), ("No", False),
                                            ("off", False), ("n", False), ("", False)])
def test_off_switches_are_set_by_any_value_but_a_clear_no(value, off):
    for name in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "TPGRAPH_DISABLE_MULTICAST"):
        assert multicast_allowed({name: value}) is not off, name


@pytest.mark.parametrize("value", ["0abc", "0.5", "08", "0x", "0 1", "0,1", "-0x"])
def test_a_value_that_only_starts_with_a_0_is_no_clear_no(value):
    """TPGRAPH_DISABLE_MULTICAST=0.5 (or 08, 0abc) was read as the number it starts with, 0, so a value that is no
    clear no left multicast allowed, against the rule that any value but a clear no turns it off; as a whole number 0
    ("00", "0x0", "-0") it still reads as no."""
    for name in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "TPGRAPH_DISABLE_MULTICAST"):
        assert not multicast_allowed({name: value}), name
    for clear in ("00", "0x0", "-0", " 0 "):
        assert multicast_allowed({"TPGRAPH_DISABLE_MULTICAST": clear}), clear


def test_the_gate_is_passed_on_to_every_librarys_variable():
    """TPGRAPH_DISABLE_MULTICAST=1 alone would leave NCCL free to build NVLS communicators: init_distributed sets
    the other variables too, before NCCL starts; an allowed environment is left alone."""
    from tpgraph.comm.multicast import pass_gate_on

    env = {"TPGRAPH_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert pass_gate_on(env) == ["NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"]
    assert env == {"TPGRAPH_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                   "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    allowed = {"NCCL_NVLS_ENABLE": "1"}
    assert pass_gate_on(allowed) == [] and allowed == {"NCCL_NVLS_ENABLE": "1"}


@pytest.mark.parametrize("name,value", [("TORCH_SYMM_MEM_DISABLE_MULTICAST", "true"), ("NVSHMEM_DISABLE_NVLS", "yes"),
                                        ("TPGRAPH_DISABLE_MULTICAST", "on"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1 "),
                                        ("NCCL_NVLS_ENABLE", "false"), ("NCCL_NVLS_ENABLE", "0x0")])
def test_the_gate_rewrites_every_variable_to_the_value_its_library_reads_as_off(name, value):
    """torch reads only "1" as on: a TORCH_SYMM_MEM_DISABLE_MULTICAST=true that this gate reads as off must not stay
    as it is, or torch's symmetric memory would still make multicast objects."""
    from tpgraph.comm.multicast import DISABLING_VARIABLES, pass_gate_on

    env = {name: value}
    assert name in pass_gate_on(env)
    assert env == dict(DISABLING_VARIABLES)


def test_the_gate_is_passed_on_where_the_process_group_already_exists(monkeypatch, caplog):
    """A program that made its own process group before TPEngine still gets the libraries' variables set, and a
    warning that a communicator made before may use multicast."""
    import torch.distributed as dist

    from tpgraph.distributed import init_distributed

    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(name, "")  # (empty reads as unset; monkeypatch then restores what was there)
    monkeypatch.setenv("TPGRAPH_DISABLE_MULTICAST", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda **kw: None)
    with caplog.at_level("WARNING"):
        init_distributed("cpu", 0, 2)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert "the process group existed before tpgraph" in caplog.text


def test_launch_blocks_shrink_to_the_work():
    t = launch_table({"push_blocks": {"default": [[1 << 30, "num_sms"]]}, "pull1_blocks": {"default": [[1 << 30, 64]]},
                      "pull2_blocks": {"default": [[1 << 30, 64]]}})
    # push deals 32-vector chunks round-robin over blocks: at most one block per chunk
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=8192) == 16  # 512 vectors, 16 chunks
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=512) == 1
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=528) == 2  # a partial second chunk
    assert t.blocks(Algo.PUSH_1SHOT, 2, 132, nbytes=16 << 20) == 132
    assert t.blocks(Algo.PULL_2SHOT, 2, 132, nbytes=16 * 1024) == 1  # 1024 vectors, 512 per shard
    assert t.blocks(Algo.PULL_2SHOT, 2, 132, nbytes=32 * 1024) == 2
    assert t.blocks(Algo.PULL_1SHOT, 8, 132, nbytes=16) == 1


@pytest.mark.parametrize(("name", "value"), DISABLING_VARIABLES)
def test_cpp_multicast_gate_reads_the_same_variables(name, value, monkeypatch):
    from tpgraph._ext import extension_available, load_ext

    if not extension_available():
        pytest.skip("tpgraph._C not built")
    ext = load_ext()
    for var, _ in DISABLING_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    assert ext.multicast_env_allowed()
    monkeypatch.setenv(name, value)
    assert not ext.multicast_env_allowed()


@pytest.mark.parametrize("spelling", ["{v}", " {v} ", "{v}\n", "TRUE", "Yes", "false", "2", "", "00", "0x0", "off",
                                      "n", "abc", "1abc", "-1", "+", " ", "\vfalse", "no\f", "off\xa0", "\xa01",
                                      "\x1cno", "0abc", "0.5", "08", "0x", "0 1", "-0", "+0x0"])
def test_python_and_cpp_gates_read_spellings_alike(spelling, monkeypatch):
    from tpgraph._ext import extension_available, load_ext

    if not extension_available():
        pytest.skip("tpgraph._C not built")
    ext = load_ext()
    for name, value in DISABLING_VARIABLES:
        for var, _ in DISABLING_VARIABLES:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv(name, spelling.format(v=value))
        assert ext.multicast_env_allowed() == multicast_allowed({name: spelling.format(v=value)}), (name, spelling)


def test_config_dir_and_the_gemv_table_expand_a_home_written_as_a_tilde(tmp_path, monkeypatch):
    """TPGRAPH_CONFIG_DIR=~/tables in an env file (no shell to expand it) named a folder "~" under the working
    directory: the engine then refused the all-reduce table as missing; TPGRAPH_GEMV_TABLE=~/g.json likewise."""
    from tpgraph.kernels.gemv import table_path

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", "~/tables")
    assert config_dir() == tmp_path / "tables"
    monkeypatch.setenv("TPGRAPH_GEMV_TABLE", "~/g.json")
    assert table_path((9, 0)) == tmp_path / "g.json"


def test_a_config_dir_without_the_gemv_tiles_the_package_ships_is_refused_naming_the_variable(tmp_path, monkeypatch):
    """TPGRAPH_CONFIG_DIR naming a folder without gemv/sm90.json (a typo, or allreduce/ copied alone) ran every
    projection on the default tiles without a word (at TP=1, where no all-reduce table is read, nothing else looked
    in the folder); as a missing all-reduce table there is, it is refused, naming the variable."""
    from tpgraph.errors import ConfigError
    from tpgraph.kernels.gemv import table_path

    monkeypatch.delenv("TPGRAPH_GEMV_TABLE", raising=False)
    monkeypatch.setenv("TPGRAPH_CONFIG_DIR", str(tmp_path / "tables"))
    with pytest.raises(ConfigError, match=r"TPGRAPH_CONFIG_DIR=.*tables has no gemv/sm90\.json: copy"):
        table_path((9, 0))
    assert table_path((10, 0)) is None  # (the package ships no SM100 tiles: nothing is missing)
    (tmp_path / "tables" / "gemv").mkdir(parents=True)
    (tmp_path / "tables" / "gemv" / "sm90.json").write_text("{}")
    assert table_path((9, 0)) == tmp_path / "tables" / "gemv" / "sm90.json"
