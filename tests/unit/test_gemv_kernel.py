"""The small-M projection kernel (Triton's interpreter on CPU) against torch.matmul, at the shapes a loader can
produce (odd N and K included)."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from tpgtest.head_norms import assert_within_a_variance_bit, random_head_norm
from tpgtest.launches import spy_launches
from tpgtest.markers import interpreted
from tpgtest.polled import arrive_late, spy_partials, spy_polled_rope
from tpgtest.ptx import (
    NO_ALL_REDUCE,
    assert_semaphore_order,
    branch_sources,
    gemv_signature,
    sm90_ptx,
    sm90_ptx_and_usage,
)

from tpgraph.kernels.gemv import GemvConfig, linear_small_m, tiles

triton = pytest.importorskip("triton")


@interpreted
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(64, 256), (37, 300), (257, 4100), (8200, 64)])
def test_matches_matmul_in_fp32(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = linear_small_m(x, w, use_triton=True)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)


@interpreted
def test_a_bias_is_added_as_f_linear_adds_it():
    """The kernel's product plus the bias (Qwen2's q, k, v): fp32 within F.linear's rounding, into `out` too; where the
    kernel does not apply (more rows than it takes), F.linear's own bits."""
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(3, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(linear_small_m(x, w, use_triton=True, bias=b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    out = torch.full((3, 40), float("nan"))
    assert linear_small_m(x, w, use_triton=True, bias=b, out=out) is out
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    many = torch.randn(40, 96, generator=g)
    assert torch.equal(linear_small_m(many, w, use_triton=True, bias=b), F.linear(many, w, b))
    into = torch.empty(40, 40)
    assert torch.equal(linear_small_m(many, w, use_triton=True, bias=b, out=into), F.linear(many, w, b))


@interpreted
@pytest.mark.parametrize("m", [1, 5])
def test_bf16_within_rounding(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 512, generator=g).to(torch.bfloat16)
    y = linear_small_m(x, w, use_triton=True)
    ref = (x.float() @ w.float().T)
    assert y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() / ref.abs().clamp_min(1.0)).max() < 1e-2


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
def test_resident_weights_within_rounding_of_the_looped_kernel(dtype, m):
    """Resident tiles (asked for, one row, and one step spanning K: the weights loaded whole before the PDL wait, the
    row a reduction over K): within rounding of the K loop's result, odd N and K past a power of two. Only a config
    that asks for them gets them: not the default tiles where they happen to span K. Several rows given a resident
    config run its one whole-K step as a plain tile."""
    from tpgraph.kernels.gemv import resident, resident_or_default

    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 300, generator=g).to(dtype), torch.randn(37, 300, generator=g).to(dtype)
    cfg = GemvConfig(16, 512, 4, 1, 1, resident=True)
    assert resident(cfg, 300) and not resident(GemvConfig(16, 256, 4, 1, 1, resident=True), 300)
    assert resident(cfg, 300, 1) and not resident(cfg, 300, 2)  # (several rows' batched dot lost in whole steps)
    # a table's resident entry: kept for 16-bit data at one row, else the default tiles (not one whole-K step)
    assert resident_or_default(cfg, 37, 300, 1, 2) == cfg
    assert resident_or_default(cfg, 37, 300, 2, 2) == tiles(37, 300, 2)
    assert resident_or_default(cfg, 37, 300, 1, 4) == tiles(37, 300, 1)
    assert not resident(GemvConfig(16, 512, 4, 1, 1), 300) and not resident(tiles(37, 64), 64)
    with pytest.raises(ValueError, match="one split"):
        GemvConfig(16, 512, 4, 1, 2, resident=True)
    y = linear_small_m(x, w, use_triton=True, config=cfg)
    looped = linear_small_m(x, w, use_triton=True, config=GemvConfig(16, 64, 4, 2, 1))
    ref = x.double() @ w.double().T
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for got in (y, looped):
        assert got.dtype == dtype
        assert ((got.double() - ref).abs() / ref.abs().clamp_min(1.0)).max() < tol
    assert ((y.double() - looped.double()).abs() / ref.abs().clamp_min(1.0)).max() < 2 * tol
    assert torch.equal(y, linear_small_m(x, w, use_triton=True, config=cfg))  # the same bits every call


def test_resident_weights_compile_for_sm90_loaded_before_the_wait():
    """Ahead of time, without a GPU: every weight load precedes griddepcontrol.wait (no L2 prefetch), and after it
    only x's one row is loaded; no tensor-core dot, and nothing spilled."""
    ptx, usage = sm90_ptx_and_usage(
        "tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "bf16"), [],
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 2048, "SOFT_BF16": False, "IEEE": False, "GATE_UP": False,
         "EXACT": True, "PDL": True, "PREFETCH_TILES": 0, "LINE": 64, "LAST_REDUCES": False, "SPLITS": 1,
         **NO_ALL_REDUCE, "RESIDENT": True}, num_warps=16, num_stages=1,
        divisible=("x_ptr", "w_ptr", "out_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om"))
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage  # the weights stay in registers: nothing spilled
    wait = ptx.index("griddepcontrol.wait")
    assert "prefetch.global" not in ptx
    assert ptx[:wait].count("ld.global") == 16  # 32 x 2048 bf16 over 512 threads: sixteen 16-byte loads each
    assert "mma" not in ptx
    assert ptx[wait:].count("ld.global") == 1  # x's one row


def test_falls_back_to_linear_where_the_kernel_does_not_apply():
    x, w = torch.randn(17, 64), torch.randn(32, 64)
    torch.testing.assert_close(linear_small_m(x, w, use_triton=True), x @ w.T)  # M > 16: F.linear
    torch.testing.assert_close(linear_small_m(x[:4], w), x[:4] @ w.T)  # CPU tensors by default: F.linear


@interpreted
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("block_k", [64, 256])  # 256 with K = 300: the last split has no K step and adds zeros
def test_split_k_within_bf16_rounding_and_repeatable(m, split_k, block_k):
    g = torch.Generator().manual_seed(31 * m + split_k)
    x = torch.randn(m, 300, generator=g).to(torch.bfloat16)
    w = torch.randn(37, 300, generator=g).to(torch.bfloat16)
    cfg = GemvConfig(block_n=16, block_k=block_k, num_warps=4, num_stages=2, split_k=split_k)
    y = linear_small_m(x, w, use_triton=True, config=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 37)
    torch.testing.assert_close(y, F.linear(x.float(), w.float()).to(torch.bfloat16))  # one bf16 rounding apart
    assert torch.equal(linear_small_m(x, w, use_triton=True, config=cfg), y)  # the splits add in a fixed order


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_output_has_the_same_bits_wherever_its_row_sits_in_the_tile(dtype):
    """Each output sums over K in an order fixed by K alone (one order per column, as on the GPU), so permuting the
    weight's rows permutes the outputs bit for bit: what the gate/up and paired qkv tiles' equal-bits tests rely on.
    (Under the interpreter a tl.dot is numpy's matmul, whose BLAS sums by a column's place on some CPUs.)"""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 256, generator=g).to(dtype)
    w = torch.randn(64, 256, generator=g).to(dtype)
    perm = torch.randperm(64, generator=g)
    cfg = GemvConfig(64, 128, 4, 2, 1)
    y = linear_small_m(x, w, use_triton=True, config=cfg)
    assert torch.equal(linear_small_m(x, w[perm], use_triton=True, config=cfg), y[:, perm])


@interpreted
def test_split_k_sums_every_k_once_in_fp32():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 300, generator=g), torch.randn(37, 300, generator=g)
    y = linear_small_m(x, w, use_triton=True, config=GemvConfig(16, 32, 4, 2, split_k=3))
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)


def test_tiles_give_every_sm_work_on_narrow_matrices():
    assert tiles(2048, 4096).block_n == 16 and 2048 // tiles(2048, 4096).block_n >= 128
    assert tiles(64128, 4096) == GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, split_k=1)


@pytest.mark.parametrize("bad", [dict(block_n=8), dict(block_k=96), dict(num_warps=3), dict(split_k=0),
                                 dict(num_stages=0)])
def test_config_rejects_tiles_the_kernel_cannot_run(bad):
    with pytest.raises(ValueError):
        GemvConfig(**{**dict(block_n=16, block_k=64, num_warps=4, num_stages=2), **bad})


def test_layers_use_it_unless_turned_off(monkeypatch):
    from tpgraph.model.layers import ColumnParallelLinear

    def layer():
        return ColumnParallelLinear(64, [("w", 32, 0, 32)], torch.float32, torch.device("cpu"))

    monkeypatch.setenv("TPGRAPH_GEMV", "0")
    assert layer().small_m is False
    monkeypatch.delenv("TPGRAPH_GEMV")
    lin = layer()
    assert lin.small_m is True
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)  # CPU tensors: F.linear, the same numbers


def test_a_tuned_table_picks_the_config_by_shape_and_largest_m_not_above(tmp_path, monkeypatch):
    from tpgraph.errors import ConfigError
    from tpgraph.kernels.gemv import GemvConfig, table_path, tiles

    table = {"best": {"3072,4096,1": {"block_n": 32, "block_k": 512, "num_warps": 8, "num_stages": 3, "split_k": 2},
                      "3072,4096,8": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 5, "split_k": 1}}}
    path = tmp_path / "gemv.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("TPGRAPH_GEMV_TABLE", str(path))
    assert table_path((9, 0)) == path
    assert tiles(3072, 4096, 1, path) == GemvConfig(32, 512, 8, 3, 2)
    assert tiles(3072, 4096, 7, path) == GemvConfig(32, 512, 8, 3, 2)
    assert tiles(3072, 4096, 16, path) == GemvConfig(64, 128, 4, 5, 1)
    assert tiles(4096, 2048, 1, path) == tiles(4096, 2048, 1) == GemvConfig(16, 256, 4, 4)  # a shape it lacks
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="bench_gemv.py --sweep"):
        tiles(3072, 4096, 1, bad)


@pytest.mark.parametrize("key", ["4096,2048", "4096,2048,1,1", "4096,x,1", "4096,2048,0", "4096,²,1"])
def test_a_table_key_that_is_no_shape_is_refused_naming_the_file_and_the_key(key, tmp_path):
    """A key of two parts was read as (n, k) and failed later, unpacking in tiles(), as a bare ValueError; each key
    is "n,k,m", three positive integers, checked as the file is read."""
    from tpgraph.errors import ConfigError
    from tpgraph.kernels.gemv import _tuned

    path = tmp_path / "gemv.json"
    tile = {"block_n": 32, "block_k": 512, "num_warps": 8, "num_stages": 3}
    path.write_text(json.dumps({"best": {"3072,4096,1": tile, key: tile}}))
    with pytest.raises(ConfigError, match=rf"GEMV table {re.escape(str(path))}: key '{key}' in \"best\" is not "
                                          r"'n,k,m' \(three positive integers"):
        _tuned(str(path))
    path.write_text(json.dumps({"best": {"3072,4096,1": {**tile, "block_n": 3}}}))
    with pytest.raises(ConfigError, match=r"key '3072,4096,1' in \"best\": .*power of two"):
        _tuned.__wrapped__(str(path))


def test_the_shipped_sm90_table_covers_the_tp2_llama3_8b_decode_shapes(monkeypatch):
    from tpgraph.kernels.gemv import _tuned, resident, table_path

    monkeypatch.delenv("TPGRAPH_GEMV_TABLE", raising=False)
    path = table_path((9, 0))
    assert path is not None and path.name == "sm90.json" and path.parent.name == "gemv"
    assert table_path((10, 0)) is None  # nothing measured on SM100: the defaults
    projections = ((3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168))
    shapes = {(n, k, m) for n, k in (*projections, (64128, 4096)) for m in (1, 8)}
    # TPGRAPH_GEMV_MAX_M=32's tiles, keyed at 17: every 17-32-row call runs the 32-row tile they were swept for (no
    # lm_head: it takes one row a sequence)
    wide = {(n, k, 17) for n, k in projections}
    assert set(_tuned(str(path))) == shapes | wide | {(4096, 2048, 2)}
    assert tiles(4096, 7168, 16, path) == tiles(4096, 7168, 8, path) != tiles(4096, 7168, 17, path)
    assert tiles(4096, 7168, 24, path) == tiles(4096, 7168, 32, path) == GemvConfig(32, 512, 4, 3, 1)
    # the epilogue's own tiles for down at one row, chosen by whole steps with the fused epilogue; o_proj at one row
    # with its weights resident (loaded before the PDL wait), from two rows its plain tiles again, and from eight
    # split-K 2 in each chain's own tiles (chosen by whole steps)
    assert set(_tuned(str(path), "epilogue")) <= shapes
    assert resident(tiles(4096, 2048, 1, path, epilogue=True), 2048) and resident(tiles(4096, 2048, 1, path), 2048)
    assert not resident(tiles(4096, 2048, 2, path), 2048)
    assert tiles(4096, 2048, 7, path, epilogue=True) == tiles(4096, 2048, 2, path) == GemvConfig(32, 128, 4, 5)
    assert tiles(4096, 2048, 16, path, epilogue=True) == GemvConfig(32, 128, 4, 5, 2)
    assert tiles(4096, 2048, 8, path) == GemvConfig(64, 128, 4, 4, 2)


def test_epilogue_entries_take_precedence_at_their_rows_only(tmp_path):
    """A projection with the all-reduce in its epilogue takes the "epilogue" entry with the largest M not above its
    rows, unless "best" has a larger one still; the plain projection never sees the epilogue entries; a table
    without the section serves both from "best"."""
    from tpgraph.errors import ConfigError

    def fields(block_n: int, split_k: int) -> dict:
        return {"block_n": block_n, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": split_k}

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"best": {"4096,7168,1": fields(32, 2), "4096,7168,8": fields(64, 2)},
                                "epilogue": {"4096,7168,1": fields(32, 4)}}))
    assert tiles(4096, 7168, 1, path) == GemvConfig(32, 128, 4, 4, 2)
    assert tiles(4096, 7168, 1, path, epilogue=True) == GemvConfig(32, 128, 4, 4, 4)
    assert tiles(4096, 7168, 7, path, epilogue=True) == GemvConfig(32, 128, 4, 4, 4)
    assert tiles(4096, 7168, 8, path, epilogue=True) == GemvConfig(64, 128, 4, 4, 2)  # best's M=8 entry is larger
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"best": {"4096,7168,1": fields(32, 2)}}))
    assert tiles(4096, 7168, 1, plain, epilogue=True) == GemvConfig(32, 128, 4, 4, 2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"best": {}, "epilogue": []}))
    with pytest.raises(ConfigError, match="bench_gemv.py --sweep"):
        tiles(4096, 7168, 1, bad, epilogue=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "block_n", "whole"), [(1, 16, False), (5, 32, False), (16, 64, False), (1, 32, True),
                                                    (5, 16, True)])
def test_gate_up_epilogue_gives_the_two_kernels_bits(dtype, m, block_n, whole):
    """silu_and_mul(gate_up(x)) in one launch: the same bits as the projection (same tiles) and then the activation
    kernel, with an odd inter (the last column block partial) and a partial last K step. Small-integer multiples
    of 1/4 as inputs: the interpreter's dot is numpy's, whose summation order depends on where a column sits in
    the tile (the fused tile interleaves gate and up rows), so only exact sums can show the epilogue's bits; on the
    GPU each column's sum has one order, and tests/gpu checks random-normal inputs bit for bit. whole: one step spans
    K (resident tiles at one row, a plain whole-K tile at several), in both launches."""
    from tpgraph.kernels.activation import silu_and_mul
    from tpgraph.kernels.gemv import gate_up_silu

    g = torch.Generator().manual_seed(m * 7 + block_n)
    inter, k = 37, 300
    x = torch.randint(-4, 5, (m, k), generator=g).to(dtype) / 4
    w = torch.randint(-2, 3, (2 * inter, k), generator=g).to(dtype) / 8  # cat(gate, up)
    cfg = GemvConfig(block_n, 512, 4, 1, resident=True) if whole else GemvConfig(block_n, 64, 4, 2)
    fused = gate_up_silu(x, w, use_triton=True, config=cfg)
    two = silu_and_mul(linear_small_m(x, w, use_triton=True, config=cfg), use_triton=True)
    assert fused is not None and fused.shape == (m, inter) and fused.dtype == dtype
    assert torch.equal(fused, two)
    # and it is the activation of this projection, not of some other rows
    from tpgraph.kernels.activation import silu_and_mul_reference

    torch.testing.assert_close(fused.float(), silu_and_mul_reference(x.float() @ w.float().T),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2)


def test_gate_up_epilogue_declines_what_it_cannot_do():
    from tpgraph.kernels.gemv import gate_up_silu

    x, w = torch.randn(3, 64), torch.randn(32, 64)
    assert gate_up_silu(x, w, use_triton=False) is None  # the kernel is off: the caller runs the two steps
    assert gate_up_silu(torch.randn(20, 64), w, use_triton=True) is None  # 20 rows: above the kernel's 16
    assert gate_up_silu(x, torch.randn(33, 64), use_triton=True) is None  # no (gate, up) halves
    assert gate_up_silu(x, w, use_triton=True, config=GemvConfig(16, 64, 4, 2, split_k=2)) is None  # split sums


@interpreted
@pytest.mark.parametrize("rows", [3, 24])
def test_the_mlp_gives_the_same_bits_fused_or_not(monkeypatch, rows):
    """The model's MLP with the small-M kernel: the activation made in the gate_up epilogue (on by default) and the
    two steps give the same output, and the fused kernel did run; 24 rows with TPGRAPH_GEMV_MAX_M=32."""
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32" if rows > 16 else "16")
    from tpgraph.config import ModelConfig
    from tpgraph.kernels import gemv
    from tpgraph.model.llama import LlamaMLP

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)

    class OneRank:
        rank, world_size = 0, 1

    mlp = LlamaMLP(cfg, "model.layers.0.mlp", OneRank(), torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.small_m = True
    import tpgraph.model.llama as llama
    from tpgraph.kernels.activation import silu_and_mul

    # the unfused side as the GPU runs it: the Triton activation kernel (the model's call defaults to the torch
    # reference for CPU tensors)
    monkeypatch.setattr(llama, "silu_and_mul", lambda t: silu_and_mul(t, use_triton=True))
    ran = []
    real = gemv.gate_up_silu
    linear = gemv.linear_small_m
    def fused_gate_up(x, w):
        out = real(x, w, use_triton=True)
        ran.append(out is not None)  # None: the kernel declined, and the MLP ran the two steps
        return out

    monkeypatch.setattr(gemv, "gate_up_silu", fused_gate_up)
    monkeypatch.setattr(gemv, "linear_small_m",
                        lambda x, w, out=None, bias=None: linear(x, w, use_triton=True, out=out, bias=bias))
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    assert mlp.fused_activation
    fused = mlp(x).run()  # (the MLP leaves its down projection to the all-reduce after it)
    assert ran == [True]
    mlp.fused_activation = False
    assert torch.equal(fused, mlp(x).run())


class _OneRank:  # the communicator's rank and size, all an attention layer reads of it
    rank, world_size = 0, 1


class _EchoAttention:  # decode attention that returns q: what the attention layer tests compare
    name = "echo"

    def decode(self, q, cache, meta, scale):
        return q


def _three_decode_rows():
    """Positions of three decode rows and their metadata (slots 9, 2 and 30; attention that returns q)."""
    from tpgraph.model.attention import AttentionMetadata

    positions, slots = torch.tensor([5, 0, 17]), torch.tensor([9, 2, 30])
    return positions, AttentionMetadata(is_prefill=False, slot_mapping=slots, seq_lens=positions.int() + 1,
                                        block_tables=torch.zeros(3, 1, dtype=torch.int32), backend=_EchoAttention(),
                                        max_seq_len=18)


@interpreted
def test_a_biased_attention_layer_gives_the_same_bits_fused_or_not(monkeypatch):
    """The model's attention with Qwen2's q, k and v biases at decode rows: the fused qkv + rope kernel (the layer
    hands it its bias) and the two steps (the projection with its bias, then rope_and_store) give the same q and
    caches, and the fused kernel did run. (The CPU parity tests run neither: their projections take F.linear.)"""
    from tpgraph.config import ModelConfig
    from tpgraph.kernels import gemv
    from tpgraph.kernels.rope_store import rope_and_store, rope_cos_sin_table
    from tpgraph.model import llama
    from tpgraph.model.attention import KVCache

    cfg = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, qkv_bias=True)

    attn = llama.LlamaAttention(cfg, "model.layers.0.self_attn", _OneRank(), torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    attn.qkv_proj.small_m = True
    tiles = GemvConfig(32, 32, 4, 2, 2)  # the same tiles both ways (the shipped table's may not divide a head)
    ran, fused_call, linear = [], gemv.qkv_rope_store, gemv.linear_small_m

    def fused(*args, **kwargs):
        q = fused_call(*args, **kwargs, use_triton=True, config=tiles)
        ran.append(q is not None)
        return q

    monkeypatch.setattr(gemv, "qkv_rope_store", fused)
    monkeypatch.setattr(gemv, "linear_small_m", lambda x, w, out=None, bias=None: linear(
        x, w, use_triton=True, config=tiles, out=out, bias=bias))
    monkeypatch.setattr(llama, "rope_and_store", lambda *a, **k: rope_and_store(*a, **k, use_triton=True))
    rows = 3
    rope = rope_cos_sin_table(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 64, torch.bfloat16, "cpu")
    positions, meta = _three_decode_rows()
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    results = []
    for fused_on in (True, False):
        attn.fused_qkv_rope = fused_on
        attn.kv_cache = KVCache(*(torch.zeros(8, 4, 2, 64, dtype=torch.bfloat16) for _ in range(2)))
        results.append((attn(positions, rope, x, meta).x, attn.kv_cache.k, attn.kv_cache.v))
    assert ran == [True]
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@interpreted
@pytest.mark.parametrize(("reduced", "fused"), [(False, True), (False, False), (True, False)])
def test_a_qwen3_attention_layer_at_decode_rows_is_transformers_qwen3(monkeypatch, reduced, fused):
    """Qwen3's q and k norms at decode rows on the GPU's paths, the fused qkv + rope kernel norming each head, or
    (fused off) the small-M projection, and rope_and_store norming each head, from a plain input or a
    fused all-reduce's ReducedNorm (its stand-in here carries no squares for the fused kernel: test_lamport_gemv's
    boundaries give it a real one): q and the caches as transformers' Qwen3RMSNorm and rotation make them, in bf16,
    within the variance's last bit (the kernels sum a head's squares by halves), v bit for bit.
    (The CPU parity tests run none of these kernels: their projections take F.linear and their norms the reference.)"""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from tpgraph.config import ModelConfig
    from tpgraph.kernels import gemv
    from tpgraph.kernels.lamport import ReducedNorm
    from tpgraph.kernels.norm import rms_norm, rms_norm_reference
    from tpgraph.kernels.rope_store import rope_and_store, rope_cos_sin_table
    from tpgraph.model import layers, llama
    from tpgraph.model.attention import KVCache

    heads, kv_heads, d, rows, eps = 4, 2, 64, 3, 1e-6
    cfg = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d, rms_norm_eps=eps,
                      qk_norm=True)

    attn = llama.LlamaAttention(cfg, "model.layers.0.self_attn", _OneRank(), torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # (norm weights about 1, apart from one another)
        for name, p in attn.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else noise)
    attn.qkv_proj.small_m = True
    tiles = GemvConfig(32, 32, 4, 2, 2)
    ran, linear, fused_call = [], gemv.linear_small_m, gemv.qkv_rope_store
    monkeypatch.setattr(gemv, "qkv_rope_store", lambda *a, **k: ran.append("fused") or fused_call(
        *a, **k, use_triton=True, config=tiles))
    monkeypatch.setattr(gemv, "linear_small_m", lambda x, w, out=None, bias=None: ran.append("small-m") or linear(
        x, w, use_triton=True, config=tiles, out=out, bias=bias))
    monkeypatch.setattr(layers, "rms_norm", lambda x, w, e: ran.append("norm") or rms_norm(x, w, e, use_triton=True))
    monkeypatch.setattr(llama, "rope_and_store", lambda *a, **k: ran.append("rope") or rope_and_store(
        *a, **k, use_triton=True))
    rope = rope_cos_sin_table(1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d)), 64, torch.bfloat16, "cpu")
    positions, meta = _three_decode_rows()
    slots = meta.slot_mapping
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    weight = (1 + 0.2 * torch.randn(96, generator=g)).to(torch.bfloat16)
    given = ReducedNorm(x * 3, x, x, 1, weight, eps) if reduced else x  # (materialize reads residual_out alone)
    attn.kv_cache = KVCache(*(torch.zeros(8, 4, kv_heads, d, dtype=torch.bfloat16) for _ in range(2)))
    attn.fused_qkv_rope = fused
    q = attn(positions, rope, given, meta).x.view(rows, heads, d)
    assert ran == (["fused"] if fused else ["small-m", "rope"])  # (no norm of the heads of its own)

    # transformers' Qwen3Attention on the same projection: [1, heads, rows, d] after each head's norm, then rotated
    qkv = linear(rms_norm_reference(x * 3, weight, eps) if reduced else x, attn.qkv_proj.weight, use_triton=True,
                 config=tiles)
    hq, hk, hv = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    normed = []
    for norm, h, n in ((attn.q_norm, hq, heads), (attn.k_norm, hk, kv_heads)):
        hf_norm = Qwen3RMSNorm(d, eps).to(torch.bfloat16)
        hf_norm.weight.data.copy_(norm.weight)
        normed.append(hf_norm(h.view(1, rows, n, d)).transpose(1, 2))
    cos, sin = (torch.cat((t[positions], t[positions]), dim=-1)[None] for t in rope)
    want_q, want_k = (t[0].transpose(0, 1) for t in apply_rotary_pos_emb(*normed, cos, sin))
    assert_within_a_variance_bit(q, want_q)
    assert_within_a_variance_bit(attn.kv_cache.k.view(-1, kv_heads, d)[slots], want_k)
    assert torch.equal(attn.kv_cache.v.view(-1, kv_heads, d)[slots], hv.view(rows, kv_heads, d))


def test_prefetch_covers_small_weights_whole_and_caps_large_ones(monkeypatch):
    from tpgraph.kernels.gemv import GemvConfig, prefetch_tiles

    budget = 24 << 20
    assert prefetch_tiles(GemvConfig(32, 128, 4, 5), 4096, 2048, 2, budget) == 16  # o_proj: all 16 K steps (16 MB)
    assert prefetch_tiles(GemvConfig(32, 128, 4, 3, 4), 3072, 4096, 2, budget) == 8  # qkv, split-K 4: 8 steps each
    big = prefetch_tiles(GemvConfig(64, 128, 4, 3), 14336, 4096, 2, budget)  # gate_up, 117 MB: what the budget holds
    assert big == budget // (14336 * 128 * 2) and big < 4096 // 128
    assert prefetch_tiles(GemvConfig(64, 128, 4, 3), 64128 * 64, 4096, 2, budget) == 1  # at least the first tile
    # the shipped default: the first tile of each program only (measured: a larger prefetch slowed decode)
    monkeypatch.delenv("TPGRAPH_PDL_PREFETCH_MB", raising=False)
    assert prefetch_tiles(GemvConfig(32, 128, 4, 5), 4096, 2048, 2) == 1
    monkeypatch.setenv("TPGRAPH_PDL_PREFETCH_MB", "24")
    assert prefetch_tiles(GemvConfig(32, 128, 4, 5), 4096, 2048, 2) == 16
    monkeypatch.setenv("TPGRAPH_PDL_PREFETCH_MB", "4096x2048:24")
    assert prefetch_tiles(GemvConfig(32, 128, 4, 5), 4096, 2048, 2) == 16
    assert prefetch_tiles(GemvConfig(32, 128, 4, 3, 4), 3072, 4096, 2) == 1


def test_the_pdl_variant_compiles_for_sm90_with_its_prefetches_and_waits():
    """Ahead of time, without a GPU: the L2 prefetches precede griddepcontrol.wait, which precedes every load of x."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "fp32"), [],
                   {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": False, "GATE_UP": False,
                    "EXACT": True, "PDL": True, "PREFETCH_TILES": 4, "LINE": 64, "LAST_REDUCES": True, "SPLITS": 2,
                    **NO_ALL_REDUCE})
    assert ptx.count("prefetch.global.L2") == 4
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.rindex("prefetch.global.L2") < wait < ptx.index("ld.global")
    # the kernel after is let in once the K loop's products are done, not at the start
    trigger = ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.launch_dependents") == 1 and ptx.rindex("mma") < trigger
    # the last split's reduction: an acq_rel arrival count, partials read past L1, the counter set back
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
    assert "atom.global" in ptx[ptx.rindex("ld.global.cg"):]
    assert_semaphore_order(ptx)


@pytest.mark.parametrize(("dtype", "block_n", "pdl"), [("bf16", 64, False), ("fp32", 64, False), ("bf16", 16, True)])
def test_the_gate_up_epilogue_compiles_for_sm90_with_its_exact_ops(dtype, block_n, pdl):
    """Ahead of time, without a GPU: the interleaved tile splits into gate and up under the tensor-core layout, and
    the activation's add, division and product are their own round-to-nearest instructions (no FMA absorbs one)."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature(dtype, dtype, dtype), [],
                   {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": dtype == "fp32",
                    "GATE_UP": True, "EXACT": True, "PDL": pdl, "PREFETCH_TILES": 3, "LINE": 64,
                    "LAST_REDUCES": False, "SPLITS": 1, **NO_ALL_REDUCE})
    assert "add.rn.f32" in ptx and "mul.rn.f32" in ptx and "div.rn.f32" in ptx
    if pdl:  # the weight prefetches, then the wait, before any load of x
        assert ptx.count("prefetch.global.L2") == 3
        assert ptx.rindex("prefetch.global.L2") < ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    else:
        assert "griddepcontrol" not in ptx and "prefetch.global" not in ptx


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split_k", [2, 3])
def test_the_last_split_reduces_to_the_sum_kernels_bits_and_resets_its_counters(monkeypatch, dtype, split_k):
    from tpgraph.kernels._counters import split_counters

    g = torch.Generator().manual_seed(split_k)
    x = torch.randn(3, 300, generator=g).to(dtype)
    w = torch.randn(37, 300, generator=g).to(dtype)
    cfg = GemvConfig(16, 64, 4, 2, split_k)
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "0")  # the count (polling is the default: tested below)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")  # the sum kernel first
    two_kernels = linear_small_m(x, w, use_triton=True, config=cfg)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    used = spy_partials(monkeypatch, "gemv")
    for _ in range(2):  # twice: the counters are back at zero after each call
        assert torch.equal(linear_small_m(x, w, use_triton=True, config=cfg), two_kernels)
        assert not split_counters(x.device, 3).any()
    assert not used  # counted: no partials buffer taken


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "block_n", "split_k", "early"), [(1, 16, 1, False), (3, 32, 2, True),
                                                                (5, 64, 3, False), (5, 64, 3, True)])
def test_qkv_rope_store_gives_the_two_steps_bits(monkeypatch, dtype, m, block_n, split_k, early):
    """The projection and rope_store in one launch, its heads found by the count (TPGRAPH_POLLED_ROPE=0; polled
    below): q, the K and V caches, bit for bit the GEMV (same tiles) and then rope_and_store; the counters back at
    zero. early: the rotation inputs read before the wait (inputs_early, written before x as the model's metadata
    is)."""
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "0")
    _check_qkv_rope_bits(m, dtype, GemvConfig(block_n, 32, 4, 2, split_k), early, torch.Generator().manual_seed(
        m * 10 + split_k))


@interpreted
def test_qkv_rope_store_reads_strided_positions_and_slots_as_given():
    """positions and slot_mapping as views with non-unit steps (every other element of a wider tensor): the same q
    and caches as from their contiguous copies."""
    from tpgraph.kernels.gemv import qkv_rope_store
    from tpgraph.kernels.rope_store import rope_cos_sin_table

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, hidden, block_size, m = 2, 1, 32, 64, 4, 3
    x, w = torch.randn(m, hidden, generator=g), torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=g) * 0.1
    tables = rope_cos_sin_table(1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), 64, torch.float32, "cpu")
    positions, slots = torch.tensor([3, 40, 7]), torch.tensor([1, 13, 6])
    caches = [torch.zeros(4, block_size, kv_heads, dim) for _ in range(4)]
    cfg = GemvConfig(16, 64, 4, 1)
    q = qkv_rope_store(x, w, torch.stack([positions, positions * 0], dim=1)[:, 0], tables,
                       torch.stack([slots, slots * 0], dim=1)[:, 0], caches[0], caches[1], heads, kv_heads, dim,
                       use_triton=True, config=cfg)
    rq = qkv_rope_store(x, w, positions, tables, slots, caches[2], caches[3], heads, kv_heads, dim, use_triton=True,
                        config=cfg)
    assert q is not None and torch.equal(q, rq)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _check_qkv_rope_bits(m: int, dtype: torch.dtype, cfg: GemvConfig, early: bool, g: torch.Generator,
                         biased: bool = False) -> None:
    """qkv_rope_store on m random rows (4 + 2 * 2 heads of 64) against linear_small_m (the same tiles) and then
    rope_and_store: q and both caches bit for bit, and the counters back at zero. biased: with a bias (Qwen2's q, k, v)
    given to both."""
    from tpgraph.kernels._counters import split_counters
    from tpgraph.kernels.gemv import qkv_rope_store
    from tpgraph.kernels.rope_store import rope_and_store, rope_cos_sin_table

    heads, kv_heads, dim, hidden, block_size = 4, 2, 64, 96, 4
    x = torch.randn(m, hidden, generator=g).to(dtype)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=g) * 0.1).to(dtype)
    tables = rope_cos_sin_table(1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), 64, dtype, "cpu")
    positions = torch.randint(0, 64, (m,), generator=g)
    slots = torch.randperm(8 * block_size, generator=g)[:m]
    caches = [torch.zeros(8, block_size, kv_heads, dim, dtype=dtype) for _ in range(4)]
    bias = torch.randn(w.shape[0], generator=g).to(dtype) if biased else None
    q = qkv_rope_store(x, w, positions, tables, slots, caches[0], caches[1], heads, kv_heads, dim,
                       inputs_early=early, use_triton=True, config=cfg, bias=bias)
    qkv = linear_small_m(x, w, use_triton=True, config=cfg, bias=bias)
    rq, _ = rope_and_store(qkv, positions, tables, slots, caches[2], caches[3], heads, kv_heads, dim, use_triton=True)
    assert q is not None and torch.equal(q, rq)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not split_counters(x.device, w.shape[0] // cfg.block_n).any()  # (a count per head or per column block)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("polled", "paired"), [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")])
def test_qkv_rope_store_with_a_bias_gives_the_two_steps_bits(monkeypatch, dtype, polled, paired):
    """Qwen2's q, k and v biases in the fused kernel: added to the rounded projection and rounded again before the
    rotation, as linear_small_m's bias and then rope_and_store do it, bit for bit, whichever reducer rotates (a head's,
    counted or polled; a paired column block's)."""
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", polled)
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", polled)
    monkeypatch.setenv("TPGRAPH_QKV_PAIRED", paired)
    _check_qkv_rope_bits(3, dtype, GemvConfig(32, 32, 4, 2, 2), True, torch.Generator().manual_seed(11), biased=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "split_k", "polled"), [(1, 1, "0"), (3, 2, "0"), (5, 3, "1")])
def test_qkv_rope_store_with_head_norms_gives_the_three_steps_values(monkeypatch, dtype, m, split_k, polled):
    """Qwen3's q and k norms in the fused kernel (TPGRAPH_QKV_PAIRED set, and declined: a head's reducer norms it): q
    and the caches as the projection, rms_norm over each q and k head and then rope_and_store give them, within the
    variance's last bit (the kernel sums each head's squares by halves), v bit for bit."""
    from tpgraph.kernels.gemv import qkv_rope_store
    from tpgraph.kernels.norm import rms_norm
    from tpgraph.kernels.rope_store import rope_and_store, rope_cos_sin_table

    monkeypatch.setenv("TPGRAPH_QKV_PAIRED", "1")
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", polled)
    g = torch.Generator().manual_seed(m + split_k)
    heads, kv_heads, dim, hidden, block_size, eps = 4, 2, 64, 96, 4, 1e-6
    cfg = GemvConfig(32, 32, 4, 2, split_k)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=g) * 0.1).to(dtype)
    head_norm = random_head_norm(dim, dtype, g, eps=eps)
    tables = rope_cos_sin_table(1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim)), 64, dtype, "cpu")
    positions, slots = torch.randint(0, 64, (m,), generator=g), torch.randperm(8 * block_size, generator=g)[:m]
    caches = [torch.zeros(8, block_size, kv_heads, dim, dtype=dtype) for _ in range(4)]
    q = qkv_rope_store(x, w, positions, tables, slots, caches[0], caches[1], heads, kv_heads, dim, use_triton=True,
                       config=cfg, head_norm=head_norm)
    hq, hk, hv = linear_small_m(x, w, use_triton=True, config=cfg).split([heads * dim, kv_heads * dim, kv_heads * dim],
                                                                         dim=-1)
    normed = (rms_norm(h.reshape(-1, dim), weight, eps, use_triton=True).view(m, -1)
              for h, weight in zip((hq, hk), head_norm[:2], strict=True))
    want, _ = rope_and_store(torch.cat((*normed, hv), dim=-1), positions, tables, slots, caches[2], caches[3], heads,
                             kv_heads, dim, use_triton=True)
    assert q is not None
    assert_within_a_variance_bit(q, want)
    assert_within_a_variance_bit(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3]) and caches[1].any()


def test_qkv_rope_store_declines_a_bias_it_cannot_add():
    from tpgraph.kernels.gemv import qkv_rope_store
    from tpgraph.kernels.rope_store import rope_cos_sin_table

    x, w = torch.randn(2, 96), torch.randn(8 * 64, 96)
    tables = rope_cos_sin_table(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 64, torch.float32, "cpu")
    caches = [torch.zeros(8, 4, 2, 64) for _ in range(2)]
    args = (torch.arange(2), tables, torch.arange(2), *caches, 4, 2, 64)
    for bias in (torch.zeros(8 * 64 - 1), torch.zeros(8 * 64, dtype=torch.bfloat16), torch.zeros(8 * 64 * 2)[::2]):
        assert qkv_rope_store(x, w, *args, use_triton=True, bias=bias) is None
    for norm in (torch.ones(63), torch.ones(64, dtype=torch.bfloat16), torch.ones(128)[::2],  # nor such head norms
                 torch.ones(64, device="meta")):  # (nor one on another device: rope_and_store says what is wrong)
        assert qkv_rope_store(x, w, *args, use_triton=True, head_norm=(torch.ones(64), norm, 1e-6)) is None


@interpreted
@pytest.mark.parametrize("polled", ["0", "1"])
@pytest.mark.parametrize(("m", "block_n", "split_k", "early", "dtype"), [
    (1, 16, 1, False, torch.bfloat16), (3, 16, 2, True, torch.float32), (5, 32, 3, False, torch.bfloat16),
    (2, 64, 2, True, torch.float32), (16, 32, 4, False, torch.bfloat16)])
def test_paired_tiles_rotate_their_own_rows_with_the_two_steps_bits(monkeypatch, polled, m, block_n, split_k, early,
                                                                     dtype):
    """TPGRAPH_QKV_PAIRED=1: each tile holds dims j and j + 32 of a 64-dim head (16-, 32- and 64-wide tiles: 4, 2
    and 1 column blocks a head), and each column block reduces its own splits (by the count, or polled where the
    projections poll: TPGRAPH_POLLED_PARTIALS) and rotates its own outputs: q and both caches bit for bit the GEMV
    (the same tiles, row-major) and then rope_and_store, twice over (counters back at zero, polled slots re-armed)."""
    monkeypatch.setenv("TPGRAPH_QKV_PAIRED", "1")
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", polled)
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "0" if polled == "1" else "1")  # (the heads' rule: not the paired one)
    kernels = spy_paired(monkeypatch)
    for seed in range(2):
        _check_qkv_rope_bits(m, dtype, GemvConfig(block_n, 32, 4, 2, split_k), early,
                             torch.Generator().manual_seed(m * 10 + split_k + seed))
        assert _all_sentinel(torch.device("cpu"))
    assert kernels == [(True, polled == "1")] * 2


def spy_paired(monkeypatch) -> list[tuple]:
    """(PAIRED, POLLED) of each _qkv_rope_kernel launch from now on."""
    from tpgraph.kernels import gemv

    return spy_launches(monkeypatch, gemv, "_qkv_rope_kernel", ("PAIRED", "POLLED"))


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "block_n", "split_k"), [(1, 16, 1), (3, 32, 2), (5, 64, 3)])
def test_qkv_rope_store_with_polled_partials_gives_the_two_steps_bits(monkeypatch, dtype, m, block_n, split_k):
    """TPGRAPH_POLLED_ROPE=1: each head's fixed reducer polls the head's partials in the sentinel buffer instead of
    the last of them counting in: the two steps' bits, twice over, every slot back at the sentinel after each
    call, no counter touched, and both qkv_rope_store calls really polled."""
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "1")
    polled = spy_polled_rope(monkeypatch)
    for seed in range(2):
        _check_qkv_rope_bits(m, dtype, GemvConfig(block_n, 32, 4, 2, split_k), seed == 1,
                             torch.Generator().manual_seed(m * 10 + split_k + seed))
        assert _all_sentinel(torch.device("cpu"))
    assert polled == [split_k * m * (4 + 2 * 2) * 64] * 2


@interpreted
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # sums of the sentinel, discarded
@pytest.mark.parametrize("late", [1, 3, None])
@pytest.mark.parametrize("kernel", ["projection", "qkv_rope", "qkv_rope_paired"])
def test_the_polled_reducers_wait_for_a_late_partial(monkeypatch, kernel, late):
    """A partner's partial still on its way when the reducer first polls (the first `late` loads of one of its
    elements see the sentinel): the plain projection's reducer, and the qkv + rope kernel's head reducer and paired
    column block's reducer (TPGRAPH_QKV_PAIRED), poll again
    and give the count's bits with every slot re-armed; a partial that never arrives raises (on a GPU, the trap)."""
    from triton.runtime.errors import InterpreterError

    from tpgraph.kernels._counters import PARTIAL_SENTINEL, partials_buffer

    rows, g = 3, torch.Generator().manual_seed(5)
    if kernel == "projection":  # split 1 of 3, row 2, column 20 of a [3, 3, 37] partials view
        x, w = torch.randn(rows, 300, generator=g), torch.randn(37, 300, generator=g)
        cfg = GemvConfig(16, 64, 4, 2, 3)
        monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "0")
        counted = linear_small_m(x, w, use_triton=True, config=cfg)
        monkeypatch.delenv("TPGRAPH_POLLED_PARTIALS")
        element = 1 * rows * 37 + 2 * 37 + 20

        def call():
            assert torch.equal(linear_small_m(x, w, use_triton=True, config=cfg), counted)
    elif kernel == "qkv_rope":  # split 1 of 2, row 1, head 2's column 7, in a partner's column block (the head's
        # reducer has 160-191)
        monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "1")
        element = 1 * rows * 512 + 1 * 512 + 2 * 64 + 7
    else:  # paired: split 0 of 2 (split 1 reduces and never stores its own), row 1, column 135
        monkeypatch.setenv("TPGRAPH_QKV_PAIRED", "1")
        element = 0 * rows * 512 + 1 * 512 + 2 * 64 + 7
    if kernel != "projection":

        def call():  # (qkv_rope_store polls first, then its linear_small_m twin)
            _check_qkv_rope_bits(rows, torch.float32, GemvConfig(32, 32, 4, 2, 2), False, g)
    buf = partials_buffer(torch.device("cpu"), 1)
    seen = arrive_late(monkeypatch, buf.data_ptr() + 4 * element, late)
    if late is None:
        with pytest.raises(InterpreterError, match="inline_asm"):  # the trap's asm, which the interpreter refuses
            call()
        buf.view(torch.int32).fill_(PARTIAL_SENTINEL)  # (the failed reduction re-armed nothing)
    else:
        call()
        assert len(seen) > late and _all_sentinel(torch.device("cpu"))


def test_qkv_rope_store_keeps_the_count_where_its_partials_do_not_fit(monkeypatch):
    """A launch whose partials do not fit the sentinel buffer counts, as _gemv_kernel's launches do."""
    from tpgraph.kernels import _counters

    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "1")
    monkeypatch.setattr(_counters, "PARTIAL_WORDS", 10)
    polled = spy_polled_rope(monkeypatch)
    _check_qkv_rope_bits(3, torch.float32, GemvConfig(32, 32, 4, 2, 2), False, torch.Generator().manual_seed(4))
    assert polled == []


def test_the_qkv_rope_heads_poll_at_2_to_16_rows_by_default(monkeypatch):
    from tpgraph.kernels._counters import polled_rope

    monkeypatch.delenv("TPGRAPH_POLLED_ROPE", raising=False)
    monkeypatch.delenv("TPGRAPH_POLLED_PARTIALS", raising=False)
    assert [rows for rows in range(1, 33) if polled_rope(rows)] == list(range(2, 17))
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "1")
    assert all(polled_rope(rows) for rows in (1, 8, 32))
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "0")  # no partials buffer: the count
    assert not polled_rope(8)
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "1")
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "0")
    assert not polled_rope(8)
    monkeypatch.setenv("TPGRAPH_POLLED_ROPE", "yes")
    with pytest.raises(Exception, match="TPGRAPH_POLLED_ROPE must be 0 or 1"):
        polled_rope(8)


def test_qkv_rope_store_declines_what_it_cannot_do():
    from tpgraph.kernels.gemv import qkv_rope_store

    x, w = torch.randn(20, 96), torch.randn(8 * 64, 96)  # 20 rows: above the kernel's 16
    cache = torch.zeros(8, 4, 2, 64)
    rows = torch.zeros(20, dtype=torch.long)
    args = (rows, (torch.ones(64, 32), torch.ones(64, 32)), rows, cache, cache.clone(), 4, 2, 64)
    assert qkv_rope_store(x, w, *args, use_triton=True) is None
    assert qkv_rope_store(x[:2], w, *args, use_triton=False) is None  # no Triton asked for
    assert qkv_rope_store(x[:2], w[:-64], *args, use_triton=True) is None  # not (Hq + 2 Hkv) heads of the weight
    assert qkv_rope_store(x[:2], w, *args, use_triton=True, config=GemvConfig(128, 32, 4, 2)) is None  # > head_dim
    # resident tiles (one tile spans K) sum without tensor cores, which would not give the two steps' bits
    assert qkv_rope_store(x[:1], w, *args, use_triton=True, config=GemvConfig(32, 128, 4, 1, resident=True)) is None


def _qkv_rope_ptx(splits: int, rope_early: bool = False, block_m: int = 16, polled: bool = False,
                  paired: bool = False, bias: bool = False, qk_norm: bool = False) -> str:
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*fp32", "counter_ptr": "*i32", "pos_ptr": "*i64",
                "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64", "k_cache_ptr": "*bf16",
                "v_cache_ptr": "*bf16", "q_out_ptr": "*bf16", "bias_ptr": "*bf16", "qn_ptr": "*bf16", "kn_ptr": "*bf16",
                "head_eps": "fp32"}
    ints = {name: "i32" for name in ["M", "N", "K", "stride_xm", "stride_wn", "stride_os", "stride_cos", "stride_sin",
                                     "stride_cb", "stride_ct", "stride_ch", "stride_qo"]}
    scale = {"sq_ptr": "*fp32", "tiles": "i32", "eps": "fp32", "mean_scale": "fp32"}
    return sm90_ptx("tpgraph.kernels.gemv", "_qkv_rope_kernel", {**pointers, **ints, **scale}, [],
                    {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": False,
                     "PDL": True, "PREFETCH_TILES": 4, "LINE": 64, "NUM_HEADS": 16, "NUM_KV_HEADS": 4, "HEAD_DIM": 128,
                     "BLOCK_SIZE": 16, "EXACT_MUL": True, "STAGED": False, "PIECES": 1, "SPLITS": splits,
                     "ROPE_EARLY": rope_early, "POLLED": polled, "PAIRED": paired, "HAS_BIAS": bias,
                     "QK_NORM": qk_norm})


def _loads_after_the_count(ptx: str) -> list[str]:
    return re.findall(r"ld\.global[.\w]*", ptx[ptx.index("atom.global.gpu.acq_rel.add"):])


def test_the_fused_qkv_rope_kernel_compiles_for_sm90_without_contracting_rope():
    """Ahead of time, without a GPU: rope's products are their own mul.rn.f32 (no FMA may skip a rounding), the
    head's last program counts in with an acq_rel atomic, and after it loads nothing but the partials (.cg, past L1:
    the positions, slots and cos/sin rows came in before the K loop), unrolled: twice the splits, twice the loads,
    so that they are in flight together instead of a loop's one split at a time."""
    ptx = _qkv_rope_ptx(4)
    assert ptx.count("mul.rn.f32") >= 4 and "mul.rn.ftz" not in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx and "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("atom.global")
    assert_semaphore_order(ptx)
    four = _loads_after_the_count(ptx)
    assert four and all(".cg" in ld for ld in four)
    assert len(four) == 2 * len(_loads_after_the_count(_qkv_rope_ptx(2)))


def _loads_before_the_wait(ptx: str) -> list[str]:
    return re.findall(r"ld\.global[.\w]*", ptx[:ptx.index("griddepcontrol.wait")])


def test_a_biased_qkv_rope_kernel_adds_its_bias_as_its_own_rounded_add():
    """sm_90a with a bias (Qwen2's): each rotated half takes its bias by an add.rn.f32 of its own (no FMA may fold it
    into a product), loaded before the PDL wait (a weight no kernel writes), so that after the count the reducer loads
    only what the unbiased kernel loads."""
    biased, plain = _qkv_rope_ptx(4, bias=True), _qkv_rope_ptx(4)
    assert biased.count("add.rn.f32") >= plain.count("add.rn.f32") + 2
    assert len(_loads_before_the_wait(biased)) > len(_loads_before_the_wait(plain))
    assert _loads_after_the_count(biased) == _loads_after_the_count(plain)


def test_a_qk_normed_qkv_rope_kernel_squares_by_rounded_products_after_the_count():
    """sm_90a with Qwen3's head norms: the squares are mul.rn.f32 products of their own (an FMA into their sum would
    skip the norm kernel's rounding), an rsqrt the plain kernel lacks, and the norms' weights loaded before the PDL
    wait, so that after the count the reducer loads only what the plain kernel loads."""
    normed, plain = _qkv_rope_ptx(4, qk_norm=True), _qkv_rope_ptx(4)
    assert normed.count("mul.rn.f32") >= plain.count("mul.rn.f32") + 2
    assert normed.count("rsqrt") > plain.count("rsqrt")
    assert len(_loads_before_the_wait(normed)) > len(_loads_before_the_wait(plain))
    assert _loads_after_the_count(normed) == _loads_after_the_count(plain)


def test_the_polled_qkv_rope_reducer_compiles_for_sm90_without_a_count():
    """sm_90a, POLLED: no atomic; the head's partials are read volatile (past L1) after the wait, all of a poll's
    loads issued before the one reduction that counts the stale elements, and a trap behind the poll's limit."""
    ptx = _qkv_rope_ptx(4, polled=True)
    assert "atom.global" not in ptx and "trap;" in ptx
    volatile = [m.start() for m in re.finditer(r"ld\.volatile\.global", ptx)]
    assert len(volatile) >= 2 * 2 * 4  # two halves x four splits, in the first poll and in the loop
    assert ptx.index("griddepcontrol.wait") < volatile[0]


def test_paired_tiles_count_and_load_one_tile_a_split_after_the_count():
    """sm_90a, PAIRED with the count: the column block's last split loads its block's partials only (one [16, 32]
    tile a split, .cg), a quarter of what a head's reducer loads for the same tiles (its 128-dim head: four 32-wide
    column blocks a split), and rotates (mul.rn.f32) after; polled, no atomic and a trap behind the poll."""
    ptx = _qkv_rope_ptx(4, paired=True)
    loads = _loads_after_the_count(ptx)
    assert loads and all(".cg" in ld for ld in loads)
    assert 4 * len(loads) == len(_loads_after_the_count(_qkv_rope_ptx(4)))
    assert ptx[ptx.index("atom.global"):].count("mul.rn.f32") >= 4  # the rotation after the count
    polled = _qkv_rope_ptx(4, polled=True, paired=True)
    assert "atom.global" not in polled and "trap;" in polled and "ld.volatile.global" in polled


@pytest.mark.parametrize("early", [False, True])
def test_the_rotation_inputs_come_before_the_wait_where_the_caller_vouches_for_them(early):
    """ROPE_EARLY (TPGRAPH_QKV_ROPE_EARLY's model path): the positions (ld.global of the i64 pointer's rows) and
    the cos/sin rows at them load before griddepcontrol.wait, so that after it no load of theirs holds the K loop's
    weight loads back; without it, they follow the wait."""
    ptx = _qkv_rope_ptx(4, rope_early=early)
    wait = ptx.index("griddepcontrol.wait")
    assert ("ld.global.b64" in ptx[:wait]) == early  # the positions (and slots), i64
    assert ("ld.global.b64" in ptx[wait:ptx.index("atom.global")]) != early


@pytest.mark.parametrize(("name", "switch"), [("TPGRAPH_QKV_ROPE_EARLY", "gemv.rope_inputs_early"),
                                              ("TPGRAPH_POLLED_PARTIALS", "_counters.polled_partials")])
def test_a_default_on_switch_turns_off_with_0_and_refuses_anything_else(monkeypatch, name, switch):
    """The rope inputs read early, and polled partials: on unless the variable is 0; a malformed value is refused
    with its name."""
    import importlib

    from tpgraph.errors import ConfigError

    module, function = switch.split(".")
    on = getattr(importlib.import_module(f"tpgraph.kernels.{module}"), function)
    monkeypatch.delenv(name, raising=False)
    assert on()
    monkeypatch.setenv(name, "0")
    assert not on()
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ConfigError, match=f"{name} must be 0 or 1"):
        on()


def test_by_default_it_runs_only_where_the_gpu_can_take_it(monkeypatch):
    from types import SimpleNamespace

    from tpgraph.kernels import gemv

    gpus = {0: SimpleNamespace(major=7, shared_memory_per_block_optin=98304),  # V100: no bf16 tensor-core dot
            1: SimpleNamespace(major=8, shared_memory_per_block_optin=101376),  # sm_86: bf16 yes, fp32 tiles too big
            2: SimpleNamespace(major=9, shared_memory_per_block_optin=232448)}  # H200: both
    monkeypatch.setattr(gemv.torch.cuda, "get_device_properties", lambda index: gpus[index])
    gemv._device_takes.cache_clear()
    try:
        assert [gemv._device_takes(i, 2) for i in range(3)] == [False, True, True]
        assert [gemv._device_takes(i, 4) for i in range(3)] == [False, False, True]
    finally:
        gemv._device_takes.cache_clear()


def test_the_kernel_after_is_let_in_once_after_the_k_loop():
    """sm_90a, the split-K down tiles: one launch_dependents, after the K loop (not inside it: the next kernel's
    programs would take SM slots and L2 from the weight stream; letting it in two steps early was timed and lost,
    bench/results/2026-12-02_h200_trigger_ahead)."""
    ptx = sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "bf16"), [],
                   {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": False,
                    "GATE_UP": False, "EXACT": True, "PDL": True, "PREFETCH_TILES": 1, "LINE": 64,
                    "LAST_REDUCES": True, "SPLITS": 4, **NO_ALL_REDUCE}, num_stages=4,
                   divisible=("x_ptr", "w_ptr", "out_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om"))
    loop, after = ptx.index("Inner Loop Header"), ptx.index("_crit_edge")
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.index("griddepcontrol.launch_dependents") > after > loop


def test_the_prefetch_budget_setting(monkeypatch):
    from tpgraph.errors import ConfigError
    from tpgraph.kernels.gemv import PREFETCH_BUDGET, prefetch_budget

    for unset in ("", "  "):
        monkeypatch.setenv("TPGRAPH_PDL_PREFETCH_MB", unset)
        assert prefetch_budget() == PREFETCH_BUDGET
    monkeypatch.setenv("TPGRAPH_PDL_PREFETCH_MB", "1.5")
    assert prefetch_budget() == 3 << 19
    monkeypatch.setenv("TPGRAPH_PDL_PREFETCH_MB", "lots")
    with pytest.raises(ConfigError, match="TPGRAPH_PDL_PREFETCH_MB"):
        prefetch_budget()
    # per weight shape: the named shapes get theirs, the others the default
    monkeypatch.setenv("TPGRAPH_PDL_PREFETCH_MB", "4096x2048:17/ 3072x4096:0.5")
    assert prefetch_budget(4096, 2048) == 17 << 20
    assert prefetch_budget(3072, 4096) == 1 << 19
    assert prefetch_budget(14336, 4096) == prefetch_budget() == PREFETCH_BUDGET
    # (inf was an OverflowError traceback from the first projection, and -4 read as 0 without a word)
    for bad in ("4096:17", "4096x2048:many", "ax2048:1", "4096x2048:17/garbage", "inf", "-4", "nan", "4096x2048:inf"):
        monkeypatch.setenv("TPGRAPH_PDL_PREFETCH_MB", bad)
        with pytest.raises(ConfigError, match="TPGRAPH_PDL_PREFETCH_MB"):
            prefetch_budget(4096, 2048)


def test_wide_rows_are_the_default_for_16_bit_elements(monkeypatch):
    """17-32 rows in 32-row tiles (bf16/fp16 only) unless TPGRAPH_GEMV_MAX_M=16; 32 as well; nothing else."""
    from tpgraph.errors import ConfigError
    from tpgraph.kernels.gemv import block_m, max_rows

    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "16")
    assert max_rows(2) == max_rows(4) == 16
    for value in ("32", ""):
        monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", value)
        assert max_rows(2) == 32 and max_rows(4) == 16  # fp32's 32-row x tiles would outgrow its stages' shared memory
    assert [block_m(m) for m in (1, 16, 17, 32)] == [16, 16, 32, 32]
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "24")
    with pytest.raises(ConfigError, match="TPGRAPH_GEMV_MAX_M must be one of 16, 32, got '24'"):
        max_rows(2)


def _launches(monkeypatch) -> list[int]:
    """The row tile of every small-M kernel launch from here on."""
    from tpgraph.kernels import gemv

    seen: list[int] = []
    real = gemv._tile_args
    monkeypatch.setattr(gemv, "_tile_args", lambda x, *a: seen.append(gemv.block_m(x.shape[0])) or real(x, *a))
    return seen


@interpreted
@pytest.mark.parametrize("m", [17, 24, 32])
@pytest.mark.parametrize("split_k", [1, 3])
def test_wide_rows_within_bf16_rounding_and_repeatable(monkeypatch, m, split_k):
    """17-32 rows in one 32-row tile, with split-K reduced by the last split (the default) too; with
    TPGRAPH_GEMV_MAX_M=16 the same call takes F.linear."""
    g = torch.Generator().manual_seed(m + split_k)
    x = torch.randn(m, 300, generator=g).to(torch.bfloat16)
    w = torch.randn(37, 300, generator=g).to(torch.bfloat16)
    cfg = GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=2, split_k=split_k)
    launches = _launches(monkeypatch)
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "16")
    torch.testing.assert_close(linear_small_m(x, w, use_triton=True, config=cfg), F.linear(x, w))
    assert launches == []
    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32")
    y = linear_small_m(x, w, use_triton=True, config=cfg)
    assert launches == [32] and y.shape == (m, 37)
    torch.testing.assert_close(y, F.linear(x.float(), w.float()).to(torch.bfloat16))  # one bf16 rounding apart
    assert torch.equal(linear_small_m(x, w, use_triton=True, config=cfg), y)


@interpreted
def test_wide_rows_fuse_the_activation_and_rope_with_the_two_steps_bits(monkeypatch):
    """gate_up + SiLU·mul and qkv + rope + cache store at 23 rows: the same bits as the projection and then the
    activation / rope_store kernel (exact inputs, as in the 16-row tests: see the gate_up test's note)."""
    from tpgraph.kernels.activation import silu_and_mul
    from tpgraph.kernels.gemv import gate_up_silu

    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32")
    launches = _launches(monkeypatch)
    m, dtype = 23, torch.bfloat16
    g = torch.Generator().manual_seed(23)
    x = torch.randint(-4, 5, (m, 300), generator=g).to(dtype) / 4
    w = torch.randint(-2, 3, (74, 300), generator=g).to(dtype) / 8
    cfg = GemvConfig(32, 64, 4, 2)
    fused = gate_up_silu(x, w, use_triton=True, config=cfg)
    assert fused is not None and torch.equal(
        fused, silu_and_mul(linear_small_m(x, w, use_triton=True, config=cfg), use_triton=True))

    _check_qkv_rope_bits(m, dtype, GemvConfig(32, 32, 4, 2, split_k=2), True, g)
    assert set(launches) == {32} and len(launches) == 4


def test_wide_rows_compile_for_sm90():
    """Ahead of time, without a GPU: the projection and the qkv + rope kernel at a 32-row tile; the projection's
    tensor-core dot covers twice the rows of a 16-row tile's (twice its mma instructions), and x is read after the
    PDL wait."""
    def gate_up_ptx(rows: int) -> str:
        return sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "bf16"), [],
                        {"BLOCK_M": rows, "BLOCK_N": 32, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": False,
                         "GATE_UP": True, "EXACT": True, "PDL": True, "PREFETCH_TILES": 1, "LINE": 64,
                         "LAST_REDUCES": False, "SPLITS": 1, **NO_ALL_REDUCE})

    ptx = gate_up_ptx(32)
    assert ptx.count("mma.sync") == 2 * gate_up_ptx(16).count("mma.sync") > 0
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    rope = _qkv_rope_ptx(4, rope_early=True, block_m=32)
    assert "mma" in rope and "mul.rn.f32" in rope
    assert_semaphore_order(rope)


@interpreted
def test_a_fused_all_reduces_squares_must_match_the_row_tile(monkeypatch):
    """The kernels read a ReducedNorm's squares with their row tile as the stride: squares written for 16-row tiles
    and 24 staged rows (a 32-row tile) are refused, not misread."""
    from tpgraph.kernels.gemv import gate_up_silu
    from tpgraph.kernels.lamport import ReducedNorm

    monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32")
    rows, hidden = 24, 64
    h = torch.randn(rows, hidden).to(torch.bfloat16)
    reduced = ReducedNorm(h, h.clone(), torch.zeros(4, 16), 4, torch.ones(hidden, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="24 staged rows take a 32-row tile; .* written for 16"):
        gate_up_silu(reduced, torch.randn(32, hidden).to(torch.bfloat16), use_triton=True,
                     config=GemvConfig(16, 64, 4, 2))


def _all_sentinel(device) -> bool:
    from tpgraph.kernels._counters import PARTIAL_SENTINEL, partials_buffer

    return bool((partials_buffer(device, 1).view(torch.int32) == PARTIAL_SENTINEL).all())


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "split_k"), [(1, 2), (3, 3), (5, 4)])
def test_polled_partials_give_the_counted_bits_and_rearm_their_slots(monkeypatch, dtype, m, split_k):
    """Polled partials (the default): the last split polls its partners' partials in the sentinel buffer instead of
    being found by a count: the same bits as the count (TPGRAPH_POLLED_PARTIALS=0) and as the separate sum kernel,
    twice over (each call leaves every slot at the sentinel again), and the counters untouched."""
    from tpgraph.kernels._counters import split_counters

    g = torch.Generator().manual_seed(m * 10 + split_k)
    x = torch.randn(m, 300, generator=g).to(dtype)
    w = torch.randn(37, 300, generator=g).to(dtype)
    cfg = GemvConfig(16, 64, 4, 2, split_k)
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "0")
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")
    two_kernels = linear_small_m(x, w, use_triton=True, config=cfg)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "1")
    counted = linear_small_m(x, w, use_triton=True, config=cfg)
    monkeypatch.delenv("TPGRAPH_POLLED_PARTIALS")  # the default
    used = spy_partials(monkeypatch, "gemv")
    for _ in range(2):
        polled = linear_small_m(x, w, use_triton=True, config=cfg)
        assert torch.equal(polled, counted) and torch.equal(polled, two_kernels)
        assert _all_sentinel(x.device)
        assert not split_counters(x.device, 3).any()
    assert used == [split_k * m * 37] * 2  # both calls polled (the bits alone would not show it)


@interpreted
def test_polled_partials_across_changing_shapes_and_the_fallback(monkeypatch):
    """Polled calls one after another with other rows, columns, K and splits (fp16 too) each give the count's bits
    and leave every slot at the sentinel for the next; a launch whose partials do not fit the buffer keeps the
    count."""
    from tpgraph.kernels import _counters

    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "0")  # the count's bits first
    g = torch.Generator().manual_seed(2)
    cases = [(1, 37, 300, 2, torch.bfloat16), (7, 50, 1000, 5, torch.float16), (3, 16, 64, 8, torch.float32),
             (16, 45, 257, 3, torch.bfloat16)]
    want = []
    for m, n, k, splits, dtype in cases:
        x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
        want.append((x, w, GemvConfig(16, 64, 4, 2, splits), linear_small_m(x, w, use_triton=True,
                                                                          config=GemvConfig(16, 64, 4, 2, splits))))
    monkeypatch.setenv("TPGRAPH_POLLED_PARTIALS", "1")
    used = spy_partials(monkeypatch, "gemv")
    for x, w, cfg, counted in want:
        assert torch.equal(linear_small_m(x, w, use_triton=True, config=cfg), counted)
        assert _all_sentinel(x.device)
    assert len(used) == len(cases)
    monkeypatch.setattr(_counters, "PARTIAL_WORDS", 10)  # too small for any of them: the count again
    x, w, cfg, counted = want[0]
    assert torch.equal(linear_small_m(x, w, use_triton=True, config=cfg), counted)
    assert len(used) == len(cases) and not _counters.split_counters(x.device, 8).any()


def _polled_gemv_ptx(block_m: int = 16) -> str:
    return sm90_ptx("tpgraph.kernels.gemv", "_gemv_kernel", gemv_signature("bf16", "fp32"), [],
                    {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 128, "SOFT_BF16": False, "IEEE": False,
                     "GATE_UP": False, "EXACT": True, "PDL": True, "PREFETCH_TILES": 1, "LINE": 64,
                     "LAST_REDUCES": True, "SPLITS": 4, **NO_ALL_REDUCE, "POLLED": True}, num_stages=4,
                    divisible=("x_ptr", "w_ptr", "out_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om"))


@pytest.mark.parametrize("kernel", ["projection", "qkv_rope"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_the_polled_reducers_branch_on_counts_their_warps_share(kernel, block_m):
    """sm_90a: every branch of the polled projection's and qkv + rope head's reducers is taken on a stale count that
    went through shared memory (the block's), never on a register loaded from the partials: warps that read a
    partial a moment apart must not part ways, or one would poll a slot another has set back to the sentinel (as
    decode attention's merge did: test_the_polled_merge_branches_on_counts_its_warps_share)."""
    ptx = _polled_gemv_ptx(block_m) if kernel == "projection" else _qkv_rope_ptx(4, polled=True, block_m=block_m)
    branches = branch_sources(ptx)
    assert sum("ld.shared.b32" in sources for sources in branches) >= 3  # the first poll, the loop's, the trap's
    for sources in branches:
        assert not any(op.startswith("ld.volatile") for op in sources), sorted(sources)


def test_the_polled_reducer_compiles_for_sm90_without_a_count():
    """sm_90a: with POLLED, no acq_rel count; the partners' partials are read volatile (past L1), and a trap stands
    behind the poll's limit."""
    ptx = _polled_gemv_ptx()
    assert "atom.global.gpu.acq_rel" not in ptx and "trap;" in ptx
    # a poll's loads of the three partners go out together: no block barrier between them
    poll = ptx[ptx.index("ld.volatile.global"):]
    assert poll[:poll.index("bar.sync")].count("ld.volatile.global") >= 3


def test_the_kernels_workspaces_are_counted_for_the_memory_log():
    from tpgraph.kernels._counters import MAX_COUNTERS, PARTIAL_WORDS, partials_buffer, split_counters, workspace_bytes

    cpu = torch.device("cpu")
    split_counters(cpu, 1)
    partials_buffer(cpu, 1)
    assert workspace_bytes(cpu) == MAX_COUNTERS * 4 + PARTIAL_WORDS * 4  # int32 counters, fp32 partials
    assert workspace_bytes(torch.device("meta")) == 0  # nothing made there
    assert partials_buffer(cpu, PARTIAL_WORDS + 1) is None  # too many partials: the launch keeps the count
