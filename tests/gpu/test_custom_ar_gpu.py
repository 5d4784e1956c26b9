"""Custom all-reduce on 2 GPUs (the exactness tests on TPGRAPH_GPU_TEST_WORLD_SIZE of them, default 2): exact
equality with NCCL on integer-valued inputs, and timeouts."""

import ast
import os

import pytest
import torch
from tpgtest.markers import needs_gpus
from tpgtest.spawn import run_ranks, run_ranks_in_subprocess
from tpgtest.workers import GRAPH_TEST_BYTES, custom_ar_exactness

# the exactness tests run at this world size (bench/gpu_graph_checks.sh passes its NPROC), at least 2 (a custom
# all-reduce needs two ranks: NPROC=1 on a machine with two GPUs still runs them at 2); the timeout tests at 2
WORLD = max(2, int(os.environ.get("TPGRAPH_GPU_TEST_WORLD_SIZE", "2")))
pytestmark = [pytest.mark.gpu, needs_gpus(WORLD)]


def sizes(dtype):
    """Element counts: 16 bytes, 1040 elements, 4 KB .. 64 MB."""
    item = torch.tensor([], dtype=dtype).element_size()
    byte_sizes = [16, 4 << 10, 8 << 10, 64 << 10, 512 << 10, 2 << 20, 16 << 20, 64 << 20]
    return [b // item for b in byte_sizes] + [1040]


def test_every_algorithm_equals_nccl():
    results = run_ranks(custom_ar_exactness, WORLD, sizes, 3, timeout_s=300)
    for failures, checked in results:
        assert checked == 4 * 3 * len(sizes(torch.float32)) * 3
        assert failures == []


def test_skipped_call_times_out_with_a_named_peer(tmp_path):
    timeout_s = 3.0
    proc = run_ranks_in_subprocess("custom_ar_skipped_call", 2, timeout_s, str(tmp_path))
    out = tmp_path / "outcome0"
    assert out.exists(), proc.stderr[-2000:]
    message, elapsed, next_call = ast.literal_eval(out.read_text())
    assert "timed out on rank 0" in message and "1shot_pull" in message and "rank 1" in message, message
    assert elapsed < timeout_s + 10
    assert "timed out on rank 0" in next_call and "rank 1" in next_call, next_call
    assert "timed out on rank 0" in proc.stderr  # the watchdog logged it as it happened


def test_replay_before_registration_raises(tmp_path):
    proc = run_ranks_in_subprocess("custom_ar_unregistered_replay", 2, str(tmp_path))
    for rank in range(2):
        out = tmp_path / f"outcome{rank}"
        assert out.exists(), proc.stderr[-2000:]
        message, after = ast.literal_eval(out.read_text())
        assert f"rank {rank}: a CUDA graph ran 2shot_pull before its inputs were registered" in message, message
        assert "before its inputs were registered" in after, after


def test_graphs_zero_copy_equal_nccl():
    from tpgtest.workers import custom_ar_graphs

    replays = 100
    results = run_ranks(custom_ar_graphs, WORLD, replays, timeout_s=400)
    for failures, compared, mismatch in results:
        assert compared == 3 * replays * 4 * 4 * (len(GRAPH_TEST_BYTES) + 1)  # dtypes, layers, algorithms, sizes
        assert failures == []
        counts = list(range(1, WORLD + 1))  # rank r captured r + 1 calls
        assert mismatch is not None and f"different numbers of custom all-reduces: {counts}" in mismatch


def test_second_stream_is_refused_not_hung():
    from tpgtest.workers import custom_ar_two_streams

    for busy, refused, x, y in run_ranks(custom_ar_two_streams, 2, timeout_s=120):
        assert busy, "stream a finished before the second call: the test proves nothing"
        assert refused is not None and "two streams at once" in refused
        assert (x, y) == (2.0, 2.0)


def test_bad_arguments_are_refused_with_a_reason():
    from tpgtest.workers import custom_ar_bad_arguments

    for messages, after in run_ranks(custom_ar_bad_arguments, 2, timeout_s=120):
        cpu, strided, int32, overlap = messages
        assert "runs on cuda:" in cpu and "cpu" in cpu
        assert "contiguous" in strided
        assert "bf16/fp16/fp32" in int32
        assert "overlap" in overlap
        assert after == 2.0  # still serving


def test_communicator_routes_through_custom_path():
    from tpgtest.workers import communicator_uses_custom

    for used, ok in run_ranks(communicator_uses_custom, 2, timeout_s=120):
        assert used and all(ok)


def fused_norm_cases(dtype):
    """(rows, hidden): odd row counts, more rows than SMs, 4 KB .. 64 MB messages."""
    item = torch.tensor([], dtype=dtype).element_size()
    h = 4096
    cases = [(1, h), (3, h), (7, h), (64, h), (200, h), (1, 2048 * 2 // item), (5, 256 * 2 // item)]
    cases += [(1, 16384 * 2 // item), (17, 8192 * 2 // item), ((64 << 20) // (16384 * 2), 16384 * 2 // item)]
    return cases


def test_fused_all_reduce_add_rmsnorm_matches_the_unfused_pair():
    from tpgtest.workers import custom_ar_fused_norm

    replays = 3
    for failures, checked, worst in run_ranks(custom_ar_fused_norm, WORLD, fused_norm_cases, replays, timeout_s=400):
        expected = 0
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            item = torch.tensor([], dtype=dtype).element_size()
            cases = fused_norm_cases(dtype)
            expected += len(cases) + replays * sum(1 for r, h in cases if r * h * item <= 1 << 20)
        assert checked == expected
        assert failures == [], failures
        assert worst <= 1e-2


# (rows, hidden, K): decode rows at the Llama-3-8B TP=2 o_proj shape, and an odd row count at a smaller one
GEMV_ALL_REDUCE_CASES = [(1, 4096, 2048), (3, 4096, 2048), (16, 4096, 2048), (5, 1024, 768)]


# TPGRAPH_GEMV_MAX_M=32: 17-32 rows in 32-row tiles (the table's entries from 17 rows), through the same channel slots
GEMV_ALL_REDUCE_WIDE_CASES = [(24, 4096, 2048), (32, 4096, 2048), (32, 4096, 7168)]


@pytest.mark.parametrize("wide", [False, True], ids=["16_rows", "wide"])
def test_the_all_reduce_in_the_projection_epilogue_matches_the_unfused_sequence(monkeypatch, wide):
    from tpgtest.workers import gemv_all_reduce

    cases = GEMV_ALL_REDUCE_WIDE_CASES if wide else GEMV_ALL_REDUCE_CASES
    if wide:
        monkeypatch.setenv("TPGRAPH_GEMV_MAX_M", "32")  # the spawned ranks inherit it
    replays = 3
    for failures, checked, worst in run_ranks(gemv_all_reduce, WORLD, cases, replays, timeout_s=400):
        assert failures == [], failures
        assert checked == len(cases) * (4 + replays)
        assert worst <= 2e-2


def test_a_skipped_epilogue_exchange_times_out_naming_the_peer(tmp_path):
    """Rank 1 skips one projection with the all-reduce in its epilogue: rank 0's kernel traps after the timeout, and
    the error (and the watchdog's log) names rank 0, the epilogue and rank 1, as for the CUDA kernels."""
    timeout_s = 3.0
    proc = run_ranks_in_subprocess("custom_ar_skipped_epilogue", 2, timeout_s, str(tmp_path))
    out = tmp_path / "outcome0"
    assert out.exists(), proc.stderr[-2000:]
    taken, message, elapsed = ast.literal_eval(out.read_text())
    assert taken, "the channel declined a 2 x 4096 bf16 output"
    assert "timed out on rank 0" in message and "epilogue" in message and "rank 1" in message, message
    assert elapsed < timeout_s + 10
    assert "timed out on rank 0" in proc.stderr


def random_normal_sizes(dtype):
    """16 bytes, an odd 1040 elements, 8 KB, 512 KB, 4 MB."""
    item = torch.tensor([], dtype=dtype).element_size()
    return [16 // item, 1040, (8 << 10) // item, (512 << 10) // item, (4 << 20) // item]


def test_random_normal_inputs_give_the_rank_order_fp32_sum_bit_for_bit():
    from tpgtest.workers import ALL_ALGOS, custom_ar_random_normal

    for failures, checked in run_ranks(custom_ar_random_normal, WORLD, random_normal_sizes, timeout_s=400):
        assert checked == len(ALL_ALGOS) * 3 * len(random_normal_sizes(torch.float32)) * 2
        assert failures == []


def test_push_above_its_slot_runs_in_pieces_bit_for_bit():
    from tpgtest.workers import custom_ar_push_pieces

    slot = 64 << 10
    byte_sizes = [slot, slot + 16, 3 * slot + 4096, 1 << 20]
    for failures, checked in run_ranks(custom_ar_push_pieces, WORLD, slot, byte_sizes, timeout_s=300):
        assert checked == 3 * len(byte_sizes) * 2 * 2
        assert failures == []


def test_many_graphs_in_one_pool_replayed_in_random_order_with_eager_calls_between():
    from tpgtest.workers import custom_ar_many_graphs

    for failures, checked in run_ranks(custom_ar_many_graphs, WORLD, 60, timeout_s=300):
        assert checked > 60 and failures == []


def test_pdl_on_and_off_give_the_same_bits():
    from tpgtest.workers import custom_ar_pdl_bits

    for differ, checked in run_ranks(custom_ar_pdl_bits, WORLD, [1040, 4096, 1 << 18, 1 << 21], timeout_s=200):
        assert checked == 3 * 4 and differ == []


def test_an_extra_push_call_on_one_rank(tmp_path):
    """What happens, exactly: rank 0's extra call waits for data rank 1 never sends and times out, naming
    1shot_push and rank 1. Rank 1's next call of the same chunks completes with rank 0's extra data in it (Lamport
    slots carry no call identity: documented in the README), and its call after that times out naming rank 0."""
    timeout_s = 3.0
    proc = run_ranks_in_subprocess("custom_ar_extra_push_call", 2, timeout_s, str(tmp_path), timeout_s=120)
    outcomes = {}
    for rank in range(2):
        out = tmp_path / f"outcome{rank}"
        assert out.exists(), proc.stderr[-2000:]
        outcomes[rank] = ast.literal_eval(out.read_text())
    (kind, message, _), = outcomes[0]
    assert kind == "error" and "1shot_push" in message and "rank 1" in message, outcomes
    first, second = outcomes[1]
    assert first == ("next call returned", [7.0, 7.0]), outcomes  # 5 (rank 0's extra data) + 2, not 1 + 2
    assert second[0] == "error" and "1shot_push" in second[1] and "rank 0" in second[1], outcomes
