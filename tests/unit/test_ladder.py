import numpy as np
import pytest

from tpgraph.errors import ConfigError
from tpgraph.graphs.ladder import LADDERS, capture_sizes, eager_above, parse_ladder, sglang_ladder, vllm_ladder

VLLM_512 = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, 168,
            176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256, 272, 288, 304, 320, 336, 352, 368, 384, 400, 416,
            432, 448, 464, 480, 496, 512)
SGLANG_256 = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160,
              168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256)


def test_vllm_ladder_exact():
    assert vllm_ladder() == VLLM_512
    assert len(vllm_ladder(512)) == 51
    assert 12 not in vllm_ladder()


def test_sglang_ladder_exact():
    assert sglang_ladder() == SGLANG_256
    assert len(sglang_ladder(256)) == 36
    assert 12 in sglang_ladder()


def test_sglang_ladder_beyond_256():
    big = sglang_ladder(640)
    assert big[:36] == SGLANG_256
    assert big[36:] == (272, 288, 304, 320, 336, 352, 368, 384, 400, 416, 432, 448, 464, 480, 496, 512, 544, 576,
                        608, 640)


@pytest.mark.parametrize("gen", [vllm_ladder, sglang_ladder])
@pytest.mark.parametrize("max_size", [1, 3, 12, 100, 257, 1024])
def test_ladders_cut_at_max_size(gen, max_size):
    rungs = gen(max_size)
    assert rungs == tuple(sorted(set(rungs)))
    assert rungs[-1] <= max_size
    assert rungs == tuple(s for s in gen(2048) if s <= max_size)


@pytest.mark.parametrize("bad", [0, -4, True])
def test_ladder_max_size_refused(bad):
    with pytest.raises(ConfigError, match="max_size"):
        vllm_ladder(bad)


def test_parse_named_and_lists():
    assert LADDERS == ("vllm", "sglang")
    assert parse_ladder("vllm") == "vllm"
    assert parse_ladder(" SGLang ") == "sglang"
    assert parse_ladder("1,2,4,8") == (1, 2, 4, 8)
    assert parse_ladder(" 8, 1 ,2") == (1, 2, 8)
    assert parse_ladder([4, 1, 2]) == (1, 2, 4)
    assert parse_ladder((np.int64(3), 1)) == (1, 3)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty"),
        ("  ", "empty"),
        ([], "empty"),
        ("1,,2", "'' is not an integer"),
        ("1,two", "'two' is not an integer"),
        ("fast", "'fast' is not an integer"),
        ("1,2.5", "'2.5' is not an integer"),
        ([1, 2.0], "2.0 is not an integer"),
        ([1, True], "True is not an integer"),
        (["1", "2"], "'1' is not an integer"),
        ("0,1", "0 is not positive"),
        ([4, -8], "-8 is not positive"),
        ("1,2,2,4,4", r"repeats \[2, 4\]"),
        (8, "must be a sequence"),
    ],
)
def test_parse_refuses(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_ladder(spec)


def test_capture_sizes_covers_max_batch_vllm_100():
    sizes = capture_sizes("vllm", 100)
    assert sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104)


def test_capture_sizes_exact_rung_ends_there():
    assert capture_sizes("sglang", 12) == (1, 2, 4, 8, 12)
    assert capture_sizes("vllm", 512) == VLLM_512
    assert capture_sizes("sglang", 256) == SGLANG_256
    assert capture_sizes("vllm", 1) == (1,)


@pytest.mark.parametrize("name", LADDERS)
@pytest.mark.parametrize("max_batch", [1, 3, 9, 13, 100, 255, 257, 500, 511, 513, 1000, 4000])
def test_named_ladders_cover_any_max_batch(name, max_batch):
    sizes = capture_sizes(name, max_batch)
    assert sizes == tuple(sorted(set(sizes)))
    assert sizes[-1] >= max_batch
    assert all(s < max_batch for s in sizes[:-1])  # exactly one rung at or above max_batch


def test_named_ladder_grows_past_its_default_max():
    assert capture_sizes("sglang", 300)[-3:] == (272, 288, 304)
    assert capture_sizes("sglang", 500)[-2:] == (496, 512)
    assert capture_sizes("vllm", 600)[-2:] == (592, 608)


def test_capture_sizes_explicit_list():
    assert capture_sizes("1,2,4,8,64", 5) == (1, 2, 4, 8)
    assert capture_sizes([64, 1, 8], 64) == (1, 8, 64)
    assert capture_sizes([32], 7) == (32,)


def test_an_explicit_list_below_max_batch_is_kept_whole_and_the_rest_runs_eagerly():
    assert capture_sizes("1,2,4,8", 9) == (1, 2, 4, 8)
    assert eager_above((1, 2, 4, 8), 9) == 8
    assert eager_above((1, 2, 4, 8), 8) is None and eager_above((1, 16), 9) is None and eager_above((), 9) is None


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_capture_sizes_refuses_bad_max_batch(bad):
    with pytest.raises(ConfigError, match="max_batch"):
        capture_sizes("vllm", bad)


def test_capture_sizes_refuses_bad_spec():
    with pytest.raises(ConfigError, match="repeats"):
        capture_sizes([1, 1], 1)
