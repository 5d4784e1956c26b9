import argparse

import pytest

from tpgraph.errors import ConfigError
from tpgraph.graphs.config import GraphConfig, add_graph_args, graph_config_from_args


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_graph_args(parser)
    return graph_config_from_args(parser.parse_args(list(argv)))


def test_defaults():
    cfg = GraphConfig()
    assert (cfg.decode_mode, cfg.prefill_mode, cfg.ladder, cfg.warmups) == ("full", "piecewise", "sglang", 1)
    assert cfg.prefill_sizes == (16, 32, 64, 128, 256, 512, 640, 768, 896, 1024)
    assert cfg.calibrate_prefill and not cfg.enforce_eager and not cfg.check_addresses
    assert parse() == cfg  # the CLI defaults are the dataclass defaults


def test_ladder_normalized():
    assert GraphConfig(ladder="VLLM").ladder == "vllm"
    assert GraphConfig(ladder="1,2,4").ladder == (1, 2, 4)
    assert GraphConfig(ladder=[4, 1]).ladder == (1, 4)
    assert GraphConfig(ladder="1,2,4") == GraphConfig(ladder=(1, 2, 4))
    assert GraphConfig(prefill_sizes=[8, 16]).prefill_sizes == (8, 16)
    # any ascending sequence (a range was refused as "not ascending", offering the very same sizes)
    assert GraphConfig(prefill_sizes=range(128, 1025, 128)).prefill_sizes == (128, 256, 384, 512, 640, 768, 896, 1024)


def test_decode_sizes():
    assert GraphConfig(ladder="vllm").decode_sizes(100)[-1] == 104
    assert GraphConfig(ladder="sglang").decode_sizes(9) == (1, 2, 4, 8, 12)
    assert GraphConfig(ladder="1,2,4").decode_sizes(8) == (1, 2, 4)  # (batches 5..8 run eagerly, as vLLM's)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(decode_mode="fast"), "decode_mode must be one of full, piecewise, breakable, none, got 'fast'"),
        (dict(prefill_mode="full"), "prefill_mode must be one of piecewise, none, got 'full'"),
        (dict(ladder="1,0"), "ladder: .*0 is not positive"),
        (dict(ladder="huge"), "ladder: .*'huge' is not an integer"),
        (dict(ladder=()), "ladder: .*empty"),
        (dict(ladder="2,2"), r"ladder: .*repeats \[2\]"),
        (dict(prefill_sizes=(32, 16)), r"prefill_sizes must be ascending, got \[32, 16\]; did you mean \[16, 32\]"),
        (dict(prefill_sizes=(16, 16)), r"prefill_sizes repeats \[16\]"),
        (dict(prefill_sizes=(0, 16)), "prefill_sizes entry 0 is not positive"),
        (dict(prefill_sizes=()), "prefill_sizes is empty"),
        (dict(prefill_sizes=64), "prefill_sizes must be a sequence"),
        (dict(warmups=-1), r"warmups must be a positive integer .*, got -1"),
        (dict(warmups=0), r"warmups must be a positive integer \(a size's kernels load in an eager run before its "
                          r"capture\), got 0"),
        (dict(warmups=1.5), "warmups must be a positive integer"),
        (dict(enforce_eager="yes"), "enforce_eager must be True or False"),
        (dict(check_addresses=1), "check_addresses must be True or False"),
        (dict(calibrate_prefill="no"), "calibrate_prefill must be True or False"),
    ],
)
def test_validation_names_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GraphConfig(**kwargs)


def test_frozen():
    with pytest.raises(AttributeError):
        GraphConfig().warmups = 3


def test_cli_mapping():
    cfg = parse("--cuda-graph-mode", "breakable", "--prefill-graph-mode", "none", "--cuda-graph-ladder", "1,2,8",
                "--graph-warmups", "3", "--enforce-eager", "--check-graph-addresses", "--no-prefill-calibration")
    assert cfg == GraphConfig(decode_mode="breakable", prefill_mode="none", ladder=(1, 2, 8), warmups=3,
                              enforce_eager=True, check_addresses=True, calibrate_prefill=False)
    assert parse("--cuda-graph-ladder", "vllm").ladder == "vllm"
    assert parse("--cuda-graph-mode", "piecewise").decode_mode == "piecewise"
    assert parse("--prefill-capture-sizes", "16,64,512").prefill_sizes == (16, 64, 512)
    assert parse().prefill_sizes == GraphConfig().prefill_sizes


def test_cli_bad_values():
    with pytest.raises(SystemExit):  # argparse refuses modes outside the choices
        parse("--cuda-graph-mode", "fast")
    with pytest.raises(SystemExit):
        parse("--prefill-graph-mode", "full")
    with pytest.raises(ConfigError, match="ladder: .*'x' is not an integer"):
        parse("--cuda-graph-ladder", "1,x")
    with pytest.raises(ConfigError, match="warmups"):
        parse("--graph-warmups", "-2")
    with pytest.raises(ConfigError, match="comma-separated integers, got '16,x'"):
        parse("--prefill-capture-sizes", "16,x")
    with pytest.raises(ConfigError, match="--prefill-capture-sizes must be ascending"):
        parse("--prefill-capture-sizes", "64,16")


@pytest.mark.parametrize("argv,message", [
    (("--graph-warmups", "0"), "--graph-warmups must be a positive integer"),
    (("--prefill-capture-sizes", "64,16"), "--prefill-capture-sizes must be ascending"),
    (("--prefill-capture-sizes", "0"), "--prefill-capture-sizes entry 0 is not positive"),
    (("--prefill-capture-sizes", "16,x"), "--prefill-capture-sizes must be comma-separated integers"),
    (("--cuda-graph-ladder", "1,x"), "--cuda-graph-ladder: .*'x' is not an integer"),
])
def test_a_graph_flags_refusal_names_the_flag_typed(argv, message):
    """`--graph-warmups 0` was refused as "warmups must be ...", and `--prefill-capture-sizes 64,16` as "prefill_sizes
    must be ascending": GraphConfig's field names, which no command line has, where every other flag's refusal names
    the flag (vLLM's --cuda-graph-sizes beside them already did)."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        parse(*argv)


def test_prefill_sizes_past_a_forwards_budget_are_not_captured():
    """A forward holds at most max_num_batched_tokens rows: the sizes below it, and the first that holds it."""
    from tpgraph.graphs.ladder import within_budget

    sizes = GraphConfig().prefill_sizes
    assert within_budget(sizes, 8192) == sizes
    assert within_budget(sizes, 512) == (16, 32, 64, 128, 256, 512)
    assert within_budget(sizes, 300) == (16, 32, 64, 128, 256, 512)
    assert within_budget(sizes, 600) == (16, 32, 64, 128, 256, 512, 640)
    assert within_budget(sizes, 700) == (16, 32, 64, 128, 256, 512, 640, 768)
    assert within_budget((16, 32), 100) == (16, 32)


def test_vllms_cuda_graph_sizes_set_the_decode_capture_sizes():
    """vLLM's --cuda-graph-sizes: one value N is 1, 2, 4 and every 8 up to N; several are the sizes themselves."""
    assert parse("--cuda-graph-sizes", "32").ladder == (1, 2, 4, 8, 16, 24, 32)
    assert parse("--cuda-graph-sizes", "2").ladder == (1, 2)
    assert parse("--cuda-graph-sizes", "1", "2", "128").ladder == (1, 2, 128)
    assert parse("--cuda-graph-sizes", "16").decode_sizes(10) == (1, 2, 4, 8, 16)
    with pytest.raises(ConfigError, match="--cuda-graph-sizes entry 0 is not positive"):
        parse("--cuda-graph-sizes", "0")
    with pytest.raises(ConfigError, match="give --cuda-graph-ladder or --cuda-graph-sizes, not both"):
        parse("--cuda-graph-sizes", "8", "--cuda-graph-ladder", "vllm")
    assert parse("--cuda-graph-sizes", "8").decode_sizes(16) == (1, 2, 4, 8)  # (9..16 eager, as vLLM runs them)


def test_vllms_newer_capture_size_flags_set_the_decode_capture_sizes():
    """vLLM's --cudagraph-capture-sizes (the sizes themselves, one value too) and --max-cudagraph-capture-size N (its
    default sizes, 1, 2, 4, every 8 below 256 and every 16 from 256, up to N) were refused as unrecognized."""
    assert parse("--cudagraph-capture-sizes", "1", "2", "128").ladder == (1, 2, 128)
    assert parse("--cudagraph-capture-sizes", "8").ladder == (8,)
    assert parse("--max-cudagraph-capture-size", "32").ladder == (1, 2, 4, 8, 16, 24, 32)
    ladder = parse("--max-cudagraph-capture-size", "300").ladder
    assert ladder[:4] == (1, 2, 4, 8) and ladder[-4:] == (248, 256, 272, 288) and 264 not in ladder
    assert parse("--max-cudagraph-capture-size", "3").ladder == (1, 2)
    for flags in (("--cudagraph-capture-sizes", "8", "--cuda-graph-sizes", "8"),
                  ("--max-cudagraph-capture-size", "8", "--cuda-graph-ladder", "vllm")):
        with pytest.raises(ConfigError, match="not both"):
            parse(*flags)


def test_vllms_capture_sizes_and_their_max_are_taken_together_where_they_agree():
    """vLLM takes --cudagraph-capture-sizes beside --max-cudagraph-capture-size where the max is the list's largest
    (its CompilationConfig checks them for consistency): a launch command giving both was refused here as two flags
    setting the same sizes. A max that is not the largest is refused, saying what it must be."""
    assert parse("--cudagraph-capture-sizes", "1", "4", "16", "--max-cudagraph-capture-size", "16").ladder == (1, 4, 16)
    with pytest.raises(ConfigError, match=r"size 32 .*largest of --cudagraph-capture-sizes \(16\)"):
        parse("--cudagraph-capture-sizes", "1", "4", "16", "--max-cudagraph-capture-size", "32")
    with pytest.raises(ConfigError, match="--max-cudagraph-capture-size must be a positive"):
        parse("--max-cudagraph-capture-size", "0")


def test_the_default_ladder_spelt_out_beside_vllms_sizes_is_refused_not_ignored():
    """--cuda-graph-ladder sglang (the default, spelt out) beside --cuda-graph-sizes 8 captured 1, 2, 4, 8 and ignored
    the ladder without a word, where any other ladder beside it is refused as a second setting of the same sizes."""
    for flags in (("--cuda-graph-ladder", "sglang", "--cuda-graph-sizes", "8"),
                  ("--cuda-graph-ladder", "sglang", "--max-cudagraph-capture-size", "8")):
        with pytest.raises(ConfigError, match="not both"):
            parse(*flags)
    assert parse("--cuda-graph-ladder", "sglang").ladder == "sglang"


def test_vllms_compilation_config_flag_sets_the_cuda_graphs():
    """vLLM's --compilation-config / -O (JSON) was refused as unrecognized, though its capture sizes have flags here
    and TPEngine takes it as compilation_config: its cudagraph_capture_sizes and max_cudagraph_capture_size set the
    decode ladder, its cudagraph_mode the graph modes. A flag here setting the same beside it is refused."""
    from tpgraph.engine.cli import engine_kwargs
    from tpgraph.serve import parse_args

    assert parse("--compilation-config", '{"cudagraph_capture_sizes": [8, 1, 2, 4]}').ladder == (1, 2, 4, 8)
    assert parse("-O", '{"max_cudagraph_capture_size": 16}').ladder == (1, 2, 4, 8, 16)
    graphs = parse("-O", '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 8]}')
    assert (graphs.decode_mode, graphs.prefill_mode, graphs.ladder) == ("full", "none", (1, 8))
    assert parse("-O", '{"cudagraph_capture_sizes": [1, 8]}', "--cuda-graph-mode", "piecewise").decode_mode == \
        "piecewise"
    for flags in (("-O", '{"cudagraph_capture_sizes": [1, 8]}', "--cuda-graph-sizes", "8"),
                  ("-O", '{"cudagraph_mode": "NONE"}', "--prefill-graph-mode", "none")):
        with pytest.raises(ConfigError, match="or --compilation-config, not both"):
            parse(*flags)
    # vLLM's -O3 (its compilation level 3, or its newer optimization level 3, both its default graphs) asks nothing
    # more; -O0 (either reading) captures no graphs
    assert parse("-O3") == parse("-O", '{"level": 3}') == parse("--compilation-config", "3") == parse()
    assert (parse("-O0").decode_mode, parse("-O0").prefill_mode) == ("none", "none")
    with pytest.raises(ConfigError, match="or --compilation-config, not both"):
        parse("-O0", "--cuda-graph-mode", "piecewise")
    with pytest.raises(ConfigError, match=r"compilation.config's mode 1 \(vLLM's torch.compile mode\) is not taken"):
        parse("-O1")
    with pytest.raises(ConfigError, match=r"compilation_config's splitting_ops \(vLLM's\) is not taken"):
        parse("-O", '{"splitting_ops": []}')
    with pytest.raises(SystemExit):
        parse("-O", "[3]")
    # sizes below --max-num-seqs are taken, as vLLM takes them (the larger batches run eagerly)
    assert engine_kwargs(parse_args(["--device", "cuda", "--max-num-seqs", "16", "-O",
                                     '{"cudagraph_capture_sizes": [1, 8]}']))["graphs"].ladder == (1, 8)
