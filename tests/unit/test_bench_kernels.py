"""bench/bench_kernels.py's pure parts: the bytes each kernel must move, the table and the plot."""

import pytest
from tpgtest.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def bench():
    return load_bench_module("bench_kernels")


def test_bytes_moved_at_tp2_llama3_8b_shapes(bench):
    mb = bench.moved_bytes
    assert mb("o_proj (Triton)", 1) == (4096 * 2048 + 2048 + 4096) * 2  # the weight once, x in, y out
    assert mb("qkv", 1) == mb("qkv (cuBLAS)", 1) == (3072 * 4096 + 4096 + 3072) * 2
    assert mb("gate_up", 8) - mb("gate_up+silu", 8) == 8 * 7168 * 2  # the activation written, not gate and up
    assert mb("attention", 1, 4096) == (2 * 4096 * 4 * 128 + 2 * 16 * 128) * 2  # K and V of the context
    assert mb("attention", 8, 512) == 8 * mb("attention", 1, 512)
    assert mb("add_rms_norm", 1) == (4 * 4096 + 4096) * 2
    assert mb("rope_and_store", 2) == (2 * 3072 + 2 * 2560 + 2 * 2 * 512 + 2 * 128) * 2
    with pytest.raises(KeyError):
        mb("softmax", 1)


def test_table_and_plot(bench, tmp_path):
    rows = [bench.KernelRow("rms_norm", 1, None, 16384, 4.0, 2.0),
            bench.KernelRow("attention (ours, paged)", 1, 512, 1 << 20, 10.0, 5.0),
            bench.KernelRow("attention (SDPA, contiguous)", 1, 512, 1 << 20, 20.0, 5.0)]
    assert rows[0].of_floor == 0.5
    text = bench.table(rows, 4e12)
    assert "| rms_norm | 1 |  | 16,384 | 4.00 | 2.00 | 50% |" in text
    assert "| attention (SDPA, contiguous) | 1 | 512 |" in text
    pytest.importorskip("matplotlib")
    bench.plot(rows, tmp_path / "k.png")
    assert (tmp_path / "k.png").stat().st_size > 0


@pytest.mark.parametrize(("argv", "reason"), [
    (["--batches", "0,8"], "--batches: each must be >= 1"),
    (["--batches", "1,x"], "--batches: comma-separated whole numbers"),
    (["--contexts", ""], "--contexts: each must be >= 1"),
    (["--contexts", "512,-4"], "--contexts: each must be >= 1"),
    (["--prefill-tokens", "256,,1024"], "--prefill-tokens: comma-separated"),
    (["--out", "kernels.md"], "would overwrite it"),
])
def test_bad_arguments_are_refused_by_name(bench, argv, reason, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code not in (0, None) and reason in capsys.readouterr().err + str(e.value.code)


def test_arguments_parse_and_the_output_folder_is_made(bench, tmp_path):
    out = tmp_path / "a" / "b" / "kernels.json"
    args = bench.parse_args(["--out", str(out), "--batches", "1,8", "--contexts", "512", "--prefill-tokens", ""])
    assert (args.batches, args.contexts, args.prefill_tokens) == ([1, 8], [512], [])
    assert out.parent.is_dir()


def test_projections_above_the_small_m_kernels_rows_are_timed_or_said_not_to_apply(bench, monkeypatch):
    """A batch above max_rows (32) kept no projection row at all; there the engine runs cuBLAS, so the cuBLAS rows are
    timed and each Triton row is listed as not applicable, with the reason, in the table and the JSON's entries."""
    import torch

    monkeypatch.setattr(bench, "PROJECTION_SHAPES", {"qkv": (96, 64), "o_proj": (64, 32), "gate_up": (128, 64),
                                                      "down": (64, 64), "lm_head": (160, 64)})  # small: CPU
    timed = []
    monkeypatch.setattr(bench, "per_op_us", lambda fn, copies: (timed.append(fn(0).shape), 2.0)[1])
    rows, skipped = bench.projection_rows([8, 64], 1e12, 1, torch.device("cpu"))
    got = {(r.kernel, r.batch) for r in rows}
    for name in bench.PROJECTION_SHAPES:
        assert {(f"{name} (cuBLAS)", 8), (f"{name} (Triton)", 8), (f"{name} (cuBLAS)", 64)} <= got
        assert (f"{name} (Triton)", 64) not in got
        assert any(s.kernel == f"{name} (Triton)" and s.batch == 64 and "32 rows" in s.why for s in skipped)
    assert len(timed) == len(rows) and (64, 96) in timed  # every row ran its call, at its batch
    # on CPU the fused kernels never apply: said at every batch, not left out
    assert {(s.kernel, s.batch) for s in skipped if "+" in s.kernel} == {
        ("gate_up+silu (Triton)", 8), ("gate_up+silu (Triton)", 64), ("qkv+rope_store (Triton)", 8),
        ("qkv+rope_store (Triton)", 64)}
    text = bench.table(rows, 1e12, skipped)
    assert "| qkv (Triton) | 64 |  |" in text and "not applicable" in text and "| qkv (cuBLAS) | 64 |  |" in text
