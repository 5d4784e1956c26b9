"""bench/bench_decode.py's pure parts: kernel categories and the profile table."""

import pytest
from tpgtest.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def bench():
    return load_bench_module("bench_decode")


@pytest.mark.parametrize("name,category", [
    ("void tpgraph::push_1shot_kernel<__nv_bfloat16, 2>(ArParams, uint4 const*, uint4*, unsigned long)", "collective"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "gemm"),
    ("_decode_split_kernel", "attention"),
    ("_decode_combine_kernel", "attention"),
    ("_add_rms_norm_kernel", "norm"),
    ("_rope_store_kernel", "rope+kv"),
    ("_qkv_rope_kernel", "gemm"),  # the qkv projection with rope and the cache writes in its epilogue
    ("_silu_and_mul_kernel", "other"),
    ("_gemv_kernel", "gemm"),
    ("_split_sum_kernel", "gemm"),  # split-K's reduce belongs to its projection
])
def test_kernel_categories(bench, name, category):
    assert bench.kernel_category(name) == category


def test_profile_table_compares_with_the_floor(bench):
    prof = {"kernels": 3, "kernel_us": 3600.0, "span_us": 4000.0, "gaps_us": 400.0, "allreduce": "custom", "batch": 1,
            "floor_ms": 1.8, "by_category": {"gemm": {"count": 2, "us": 2700.0, "added_us": 3000.0},
                                             "norm": {"count": 1, "us": 900.0, "added_us": 1000.0}},
            "one_layer": [{"name": "void tpgraph::(anonymous namespace)::push_kernel<__nv_bfloat16, 2>(Args)",
                           "added_us": 4.25}, {"name": "_gemv_kernel", "added_us": 10.0}]}
    table = bench.profile_table(prof)
    assert "3 kernels, 3.600 ms kernel time (2.00x the 1.80 ms floor), 0.400 ms of gaps" in table
    lines = table.splitlines()
    assert lines[2].split() == ["gemm", "2", "2.700", "75.0%", "3.000"] and lines[3].split()[0] == "norm"
    assert lines[-1].endswith("push_kernel 4.2, _gemv_kernel 10.0")


def test_time_added_splits_the_span_by_kernel_end(bench):
    assert bench.time_added([]) == []
    # b is resident early (PDL) and ends 1 after a: charged 1, not its 9 of residency; c ends 3 after b, with a gap
    added = bench.time_added([("b", 1.0, 10.0), ("a", 0.0, 9.0), ("c", 11.0, 13.0)])
    assert added == [("a", 9.0), ("b", 1.0), ("c", 3.0)]
    assert sum(us for _, us in added) == 13.0  # the span
    assert bench.time_added([("a", 0.0, 9.0), ("b", 2.0, 5.0)]) == [("b", 5.0), ("a", 4.0)]  # a kernel inside another


def test_busy_time_is_the_union_of_the_kernels_intervals(bench):
    assert bench.covered_us([]) == 0.0
    assert bench.covered_us([(0.0, 2.0), (5.0, 6.0)]) == 3.0  # disjoint: the sum
    assert bench.covered_us([(0.0, 4.0), (1.0, 2.0), (3.0, 6.0)]) == 6.0  # nested and overlapping: counted once
    assert bench.covered_us([(3.0, 6.0), (0.0, 4.0)]) == 6.0  # any order


def test_profile_table_says_when_kernels_overlapped(bench):
    prof = {"kernels": 2, "kernel_us": 5000.0, "busy_us": 3000.0, "span_us": 3500.0, "gaps_us": 500.0,
            "overlap_us": 2000.0, "allreduce": "custom+gemv+pdl", "batch": 1, "floor_ms": 1.8,
            "by_category": {"gemm": {"count": 2, "us": 5000.0}}}
    table = bench.profile_table(prof)
    assert "kernels overlapped for 2.000 ms" in table and "busy 3.000 ms" in table


def test_allreduce_entries_and_the_unfused_twins(bench):
    from argparse import Namespace

    assert bench.variant("custom") == (True, True, False)
    assert bench.variant("custom+unfused+gemv") == (True, False, True)
    assert bench.variant("nccl+gemv") == (False, True, True)
    with pytest.raises(SystemExit, match="custom or nccl"):
        bench.variant("vllm")
    with pytest.raises(SystemExit, match="custom or nccl"):
        bench.variant("custom+fast")
    args = Namespace(allreduce="custom,custom+gemv,nccl", unfused=True)
    assert bench.entries(args) == ["custom", "custom+unfused", "custom+gemv", "custom+gemv+unfused", "nccl"]
    # the all-reduce in the projection's epilogue is a fused path: its twin runs it as a kernel of its own
    args = Namespace(allreduce="custom+gemv+push+late+overlap,custom+gemv+push", unfused=True)
    assert bench.entries(args) == ["custom+gemv+push+late+overlap", "custom+gemv+nopush+overlap+unfused",
                                   "custom+gemv+push", "custom+gemv+nopush+unfused"]
    assert all(bench.variant(n) == (True, False, True) for n in bench.entries(args)[1::2])
    assert bench.unfused_twins(args)["custom+gemv+push"] == "custom+gemv+nopush+unfused"
    assert bench.unfused_twins(Namespace(allreduce="custom+gemv+push", unfused=False)) == {}
    # the plain chain and its +push form share one twin, timed once
    args = Namespace(allreduce="custom+gemv+nopush+overlap,custom+gemv+push+overlap", unfused=True)
    assert bench.entries(args) == ["custom+gemv+nopush+overlap", "custom+gemv+nopush+overlap+unfused",
                                   "custom+gemv+push+overlap"]


def test_launch_modifiers_set_the_environment_only_for_their_entry(bench, monkeypatch):
    import os

    assert bench.variant("custom+gemv+pdl+lr") == (True, True, True)
    monkeypatch.delenv("TPGRAPH_TRITON_PDL", raising=False)
    monkeypatch.setenv("TPGRAPH_LAST_SPLIT_REDUCES", "0")
    with bench.entry_env("custom+gemv+pdl"):
        assert os.environ["TPGRAPH_TRITON_PDL"] == "1" and os.environ["TPGRAPH_LAST_SPLIT_REDUCES"] == "0"
    assert "TPGRAPH_TRITON_PDL" not in os.environ  # put back: unset again
    with bench.entry_env("custom+lr"):
        assert os.environ["TPGRAPH_LAST_SPLIT_REDUCES"] == "1" and "TPGRAPH_TRITON_PDL" not in os.environ
    assert os.environ["TPGRAPH_LAST_SPLIT_REDUCES"] == "0"
    assert bench.variant("custom+gemv+pf16") == (True, True, True)
    with bench.entry_env("custom+gemv+pf16"):
        assert os.environ["TPGRAPH_PDL_PREFETCH_MB"] == "16" and "TPGRAPH_TRITON_PDL" not in os.environ
    with pytest.raises(SystemExit):
        bench.variant("custom+pfx")
    with bench.entry_env("custom+gemv+push+late"):
        assert os.environ["TPGRAPH_GEMV_ALLREDUCE"] == "1" and os.environ["TPGRAPH_GEMV_AR_LATE_TRIGGER"] == "1"
    with pytest.raises(SystemExit, match="needs \\+push"):
        bench.variant("custom+gemv+late")
    with bench.entry_env("custom+gemv+nopdl+nolr"):
        assert os.environ["TPGRAPH_TRITON_PDL"] == "0" and os.environ["TPGRAPH_LAST_SPLIT_REDUCES"] == "0"
    assert "TPGRAPH_TRITON_PDL" not in os.environ
    with pytest.raises(RuntimeError), bench.entry_env("nccl+pdl"):
        raise RuntimeError("a failing step")
    assert "TPGRAPH_TRITON_PDL" not in os.environ  # restored on the way out of an error too
    from argparse import Namespace

    args = Namespace(allreduce="custom+gemv+pdl", unfused=True)
    assert bench.entries(args) == ["custom+gemv+pdl", "custom+gemv+pdl+unfused"]


def test_decode_steps_times_each_step_after_the_warm_up(bench):
    class FakeRunner:
        calls = 0

        def decode_greedy(self, seqs):
            import torch

            FakeRunner.calls += 1
            return torch.zeros(len(seqs), dtype=torch.int64)

    seqs = [type("S", (), {"output_ids": []})() for _ in range(2)]
    wall, host = bench.decode_steps(FakeRunner(), seqs, 4, warmup=2)
    assert len(wall) == len(host) == 4 and FakeRunner.calls == 6
    assert all(w >= h >= 0 for w, h in zip(wall, host, strict=True))
    assert [len(s.output_ids) for s in seqs] == [6, 6]


def test_overlapped_steps_decode_the_same_tokens_as_plain_steps(bench):
    from tpgraph.comm import TPCommunicator
    from tpgraph.distributed import init_distributed
    from tpgraph.engine.runner import ModelRunner, RunnerConfig
    from tpgraph.engine.sequence import Sequence
    from tpgraph.model.loader import load_model

    assert bench.overlapped("custom+gemv+overlap") and not bench.overlapped("custom+gemv")
    assert bench.variant("custom+gemv+overlap") == (True, True, True)
    state = init_distributed("cpu")
    runner = ModelRunner(load_model(state, TPCommunicator(state)), RunnerConfig(block_size=4, max_batch=4,
                                                                                max_model_len=64))
    decoded = []
    for loop in (bench.decode_steps, bench.decode_steps_overlapped):
        seqs = [Sequence(i, [3 + i, 40, 41 + 2 * i], 64) for i in range(3)]
        runner.prefill(seqs)
        for seq in seqs:
            seq.output_ids.append(97)
        wall, host = loop(runner, seqs, 5, warmup=2)
        assert len(wall) == len(host) == 5 and all(w > 0 for w in wall)
        assert all(seq.num_pending == 0 and len(seq.output_ids) == 8 for seq in seqs)
        decoded.append([seq.output_ids for seq in seqs])
        for seq in seqs:
            runner.free(seq)
    assert decoded[0] == decoded[1]


def test_batches_are_positive_whole_numbers(bench):
    assert bench.parse_batches("1,8,32") == [1, 8, 32]
    for bad in ("1,x", "0,8", "", "1,,8"):
        with pytest.raises(SystemExit, match="batches"):
            bench.parse_batches(bad)


def test_the_long_context_shapes_differ_only_in_positions(bench):
    """llama31-* runs --context 32768 (max_model_len past Llama-3's 8192 positions) with the same weights."""
    from dataclasses import replace

    for short, long in (("llama3-8b", "llama31-8b"), ("llama3-8b-half", "llama31-8b-half")):
        assert bench.SHAPES[long].max_position_embeddings == 131072
        assert replace(bench.SHAPES[long], max_position_embeddings=8192) == bench.SHAPES[short]


def test_projections_are_told_apart_by_their_place_in_the_step(bench):
    layer = [("_qkv_rope_kernel", 9.0), ("_decode_split_kernel", 7.0), ("_gemv_kernel", 4.0),
             ("_gemv_kernel", 40.0), ("_silu_and_mul_kernel", 1.0), ("_gemv_kernel", 22.0), ("_rms_norm_kernel", 2.0)]
    second = [(n, us + 1.0) for n, us in layer]
    third = [(n, us + 3.0) for n, us in layer]
    added = layer + second + third + [("_gemv_kernel", 170.0), ("_argmax_kernel", 4.0)]
    got = bench.projections_added(added, layers=3)
    assert got == {"qkv": 10.0, "o_proj": 5.0, "gate_up": 41.0, "down": 23.0, "lm_head": 170.0}  # medians
    assert bench.projections_added(added, layers=2) is None  # another count: not guessed
    split_k = added[:3] + [("_split_sum_kernel", 1.0)] + added[3:]
    assert bench.projections_added(split_k, layers=3) is None


@pytest.mark.parametrize(("argv", "reason"), [
    (["--modes", "full,fast"], "--modes: 'fast' not among"),
    (["--profile", "--profile-batches", "1,0"], "batches must be >= 1"),
    (["--allreduce", "custom,vllm"], "custom or nccl"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--context", "-5"], "--context must be at least 1"),
    (["--block-size", "24"], "--block-size must be a power of two"),
    (["--block-size", "0"], "--block-size must be a power of two"),
    (["--max-model-len", "-1"], "--max-model-len must be 0"),
    (["--context", "8192"], "llama31-* shapes"),  # 8192 + the steps: past Llama-3-8B's positions
    (["--interleave"], "--interleave times full graphs only"),
    (["--out", "decode.png"], "would overwrite it"),
])
def test_bad_arguments_are_refused_before_any_gpu_work(bench, argv, reason, capsys, tmp_path, monkeypatch):
    """Each of these used to surface after the HBM copy and at least one model and timed entry (a mode, the profile's
    batches, a length past the shape's positions), or as a bare traceback (a zero block size), with no JSON written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code not in (0, None) and reason in capsys.readouterr().err + str(e.value.code)


def test_good_arguments_create_the_output_folder(bench, tmp_path):
    out = tmp_path / "new" / "folder" / "decode.json"
    args = bench.parse_args(["--out", str(out), "--shape", "llama31-8b", "--context", "32768", "--profile",
                             "--modes", "full,none"])
    assert args.out == out and out.parent.is_dir()
    assert bench.timed_len(args) == 32768 + 2 * (50 + 8)
    args = bench.parse_args(["--out", str(out), "--interleave", "--modes", "full", "--steps", "25"])
    assert bench.timed_len(args) == 512 + 3 * 10 + 3 + 16  # rounds of 10 steps, whole


def test_a_ladders_cache_holds_a_whole_sequence_of_the_timed_length(bench):
    """The ladder comparison's runners: at a long context their max_batch + 16 blocks held fewer tokens than one
    timed sequence, and the runner refused its max_model_len after every entry had been timed."""
    from tpgraph.comm import TPCommunicator
    from tpgraph.distributed import init_distributed
    from tpgraph.model.loader import load_model

    model = load_model(state := init_distributed("cpu"), TPCommunicator(state))
    runner = bench.ladder_runner(model, "sglang", 8, 4000)  # 4000 tokens: 250 blocks, far past 8 + 16
    assert runner.max_model_len == 4000 and runner.allocator.num_blocks * 16 >= 4000
    runner.close()
    runner = bench.ladder_runner(model, "vllm", 64, 100)  # a short context: a block a sequence, as before
    assert runner.cfg.num_kv_blocks == 64 + 16
    runner.close()
