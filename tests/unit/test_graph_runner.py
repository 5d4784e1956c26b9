"""The graph runner and the engine's use of it, on CPU: breakable mode keeps the whole capture/replay path (buffers,
padding, dispatcher, address checks, registrations) without capturing, so all of it runs here."""

import contextlib
import re
from types import SimpleNamespace

import pytest
import torch

from tpgraph.comm import TPCommunicator
from tpgraph.comm.registration import CaptureRegistration
from tpgraph.distributed import init_distributed
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.memory import MemoryBudget
from tpgraph.engine.runner import NULL_SLOT, ModelRunner, RunnerConfig
from tpgraph.errors import CaptureError, ConfigError
from tpgraph.graphs.calibration import eager_counts
from tpgraph.graphs.config import GraphConfig
from tpgraph.graphs.dispatcher import Dispatcher
from tpgraph.graphs.runner import GraphRunner, estimate_pool_bytes
from tpgraph.graphs.workspace import Workspaces
from tpgraph.model.loader import load_model

GiB, MiB = 1 << 30, 1 << 20


class FakeComm:
    capture_locked = False

    def __init__(self):
        self.captures, self.released = [], []

    @contextlib.contextmanager
    def capture(self):
        reg = CaptureRegistration(rows=[len(self.captures)])
        self.captures.append(reg)
        yield reg

    def release_capture(self, reg):
        self.released.append(reg)


def test_pool_estimate_from_the_two_largest_captures():
    # the largest sets the working set, the second adds the cost of sharing it, smaller ones fit in the pool
    assert estimate_pool_bytes(100 * MiB, 2 * MiB, (1, 2, 4, 8, 16)) == 102 * MiB
    assert estimate_pool_bytes(100 * MiB, -5, (1, 2)) == 100 * MiB  # a capture that freed memory adds nothing
    assert estimate_pool_bytes(7, 3, (4,)) == 7 and estimate_pool_bytes(7, 3, ()) == 0
    # piecewise graphs keep their attention inputs: each smaller size adds in proportion to its token count
    sizes = (16, 32, 64, 128, 256, 512)
    assert estimate_pool_bytes(300 * MiB, 64 * MiB, sizes, "piecewise") == 300 * MiB + MiB // 4 * (256 + 128 + 64 + 32
                                                                                                   + 16)


def test_kv_budget_arithmetic_and_refusal():
    b = MemoryBudget(total=100 * GiB, utilization=0.9, in_use=20 * GiB, weights=15 * GiB, workspace=448 * MiB,
                     activation_peak=2 * GiB, graph_pool_estimate=1 * GiB, block_bytes=2 * MiB)
    assert b.kv_bytes == int(90 * GiB) - 23 * GiB
    assert b.num_blocks == b.kv_bytes // (2 * MiB)
    without_graphs = MemoryBudget(**{**b.__dict__, "graph_pool_estimate": 0})
    assert without_graphs.num_blocks - b.num_blocks == GiB // (2 * MiB)  # the graph pool comes out of the cache
    assert "graph pool (estimated) 1.00 GiB" in b.describe() and "all-reduce workspace 0.44 GiB" in b.describe()
    with_kernels = MemoryBudget(**{**b.__dict__, "kernel_workspace": 8 * MiB + 256 * 1024, "penalty_table": 5 * MiB})
    assert "kernel workspaces 8.25 MiB" in with_kernels.describe() and with_kernels.num_blocks == b.num_blocks
    assert "penalty table 5.00 MiB" in with_kernels.describe()  # shown; in_use holds it already
    # what in_use holds past the parts named (another process on the GPU, say) was nowhere in the line
    assert "rope tables 0.00 MiB, the rest 4.56 GiB: CUDA context, input buffers, other processes)" in b.describe()
    b.check(10)
    agreed = MemoryBudget(**{**b.__dict__, "agreed_blocks": 100})  # another rank had less room: every rank takes 100
    assert agreed.num_blocks == 100
    # the log line says the cache every rank takes, not this rank's own budget (it said 67.00 GiB = 100 blocks)
    assert agreed.describe().endswith(f"-> KV cache 0.20 GiB = 100 blocks of 2.00 MiB (another rank's budget; this "
                                      f"rank's held {b.num_blocks} blocks, 67.00 GiB)")
    assert b.describe().endswith(f"-> KV cache 67.00 GiB = {b.num_blocks} blocks of 2.00 MiB")
    assert MemoryBudget(**{**b.__dict__, "agreed_blocks": 10**9}).num_blocks == b.num_blocks
    tight = MemoryBudget(**{**b.__dict__, "in_use": 87 * GiB})
    with pytest.raises(ConfigError, match="needs at least 10 for one sequence.*--gpu-memory-utilization, lower "
                                          "--max-model-len"):
        tight.check(10)
    # the model's own max_model_len is capped to the cache, not refused: only a cache without room for one block is
    with pytest.raises(ConfigError, match=r"needs at least 10000 \(the null block and one more\).*lower "
                                          "--max-num-seqs, capture"):
        tight.check(10_000, max_model_len_asked=False)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        MemoryBudget(**{**b.__dict__, "utilization": 1.5})
    # two ranks on one GPU (TPGRAPH_SHARED_GPU): in_use is both ranks'; each takes half of what is left, less its own
    shared = MemoryBudget(**{**b.__dict__, "sharers": 2})
    assert shared.kv_bytes == (int(90 * GiB) - 20 * GiB) // 2 - 3 * GiB and "shared by 2 ranks" in shared.describe()
    assert "shared" not in b.describe()
    with pytest.raises(ConfigError, match="at least one rank"):
        MemoryBudget(**{**b.__dict__, "sharers": 0})


def test_a_kv_budget_too_small_says_how_much_memory_is_missing_and_what_fits():
    """The refusal showed the cache at 0.00 GiB whatever the deficit (weights past the utilization's share left the
    cache gigabytes short), and offered graphs as a remedy where none were captured."""
    over = MemoryBudget(total=80 * GiB, utilization=0.5, in_use=45 * GiB, weights=40 * GiB, workspace=0,
                        activation_peak=2 * GiB, graph_pool_estimate=0, block_bytes=2 * MiB)
    with pytest.raises(ConfigError, match=r"needs at least 100 for one sequence of max_model_len: 0\.20 GiB of KV "
                                          r"cache, 7\.20 GiB more than is left; --gpu-memory-utilization 0\.59 would "
                                          r"hold it .*\. To fit it, raise --gpu-memory-utilization or lower "
                                          r"--max-model-len or --max-num-seqs$"):
        over.check(100)
    # past the whole GPU, raising the utilization is no remedy, and is not offered
    with pytest.raises(ConfigError, match=r"even --gpu-memory-utilization 1\.0 would not hold it .*\. To fit it, "
                                          r"lower --max-model-len or --max-num-seqs$") as refused:
        over.check(20_000)
    assert "raise" not in str(refused.value)
    # this rank has room, another's smaller budget was agreed on
    agreed = MemoryBudget(**{**over.__dict__, "utilization": 0.9, "agreed_blocks": 3})
    with pytest.raises(ConfigError, match="another rank's GPU has room for 3 blocks only"):
        agreed.check(100)


def test_workspaces_never_move_under_a_graph():
    ws = Workspaces()
    ws.reserve("scratch", 100, torch.float32, "cpu")
    view = ws.get("scratch", 50, torch.float32, "cpu")
    assert ws.get("scratch", 100, torch.float32, "cpu").data_ptr() == view.data_ptr()
    with pytest.raises(CaptureError, match="captured graphs already hold its address"):
        ws.get("scratch", 101, torch.float32, "cpu")
    ws.lock()
    with pytest.raises(CaptureError, match="the capture phase is over"):
        ws.reserve("other", 1, torch.float32, "cpu")


def make_graph_runner(comm, check=False):
    return GraphRunner(comm, torch.device("cpu"), check_addresses=check, show_progress=False)


def test_runner_captures_largest_first_releases_on_recapture_and_locks():
    comm, seen = FakeComm(), []
    x = torch.arange(8.0)
    runner = make_graph_runner(comm)
    forward = lambda n, boundary: (seen.append(n), x[:n] * 2)[1]
    first = runner.capture("decode", "breakable", (1, 4, 2), forward, lambda n: {"x": x[:n]}, lambda n: None)
    assert first.sizes == (1, 2, 4) and len(comm.captures) == 1
    assert torch.equal(runner.replay("decode", 2), torch.tensor([0.0, 2.0]))
    runner.capture("decode", "breakable", (1, 2), forward, lambda n: {"x": x[:n]}, lambda n: None)
    assert comm.released == [first.registration]  # re-capture gave the old rows and mappings back first
    runner.close_capture_phase()
    assert comm.capture_locked
    with pytest.raises(CaptureError, match="after the capture phase ended"):
        runner.capture("prefill", "breakable", (1,), forward, lambda n: {}, lambda n: None)
    runner.close()
    assert len(comm.released) == 2 and runner.sets == {}


def test_full_graphs_need_cuda_and_kinds_are_checked():
    runner = make_graph_runner(FakeComm())
    with pytest.raises(CaptureError, match="need a CUDA device"):
        runner.capture("decode", "full", (1,), None, None, None)
    with pytest.raises(CaptureError, match="unknown graph kind"):
        runner.capture("decode", "sideways", (1,), None, None, None)


def test_address_check_catches_a_rebound_input():
    inputs = {"ids": torch.zeros(4)}
    runner = make_graph_runner(FakeComm(), check=True)
    runner.capture("decode", "breakable", (4,), lambda n, b: inputs["ids"][:n], lambda n: {"ids": inputs["ids"]},
                   lambda n: None)
    runner.replay("decode", 4, lambda n: {"ids": inputs["ids"]})
    inputs["ids"] = torch.zeros(4)
    with pytest.raises(CaptureError, match="would read stale inputs.*ids: captured at"):
        runner.replay("decode", 4, lambda n: {"ids": inputs["ids"]})


def test_communicator_refuses_capture_once_locked():
    comm = TPCommunicator(init_distributed("cpu"))
    with comm.capture() as reg:
        assert reg.rows == [] and reg.handles == []
    comm.capture_locked = True
    with pytest.raises(CaptureError, match="after the capture phase"):
        with comm.capture():
            pass


@pytest.fixture(scope="module")
def model():
    state = init_distributed("cpu")
    return load_model(state, TPCommunicator(state))


PROMPTS = [[256, 1, 2, 3], [256, 5], [256, 7, 8, 9, 10, 11]]


def runner_for(model, mode, **graph_kw):
    graphs = GraphConfig(decode_mode=mode, prefill_mode="none", ladder=(1, 2, 4, 8), **graph_kw)
    return ModelRunner(model, RunnerConfig(block_size=4, max_batch=5, max_model_len=64, graphs=graphs))


def test_breakable_decode_equals_eager_with_padding_recorded(model):
    eager = greedy_generate(runner_for(model, "none"), PROMPTS, 6, keep_logits=True)
    runner = runner_for(model, "breakable", check_addresses=True)
    broken = greedy_generate(runner, PROMPTS, 6, keep_logits=True)
    assert broken.tokens == eager.tokens
    for a, b in zip(broken.step_logits, eager.step_logits, strict=True):
        # the padded batch may take another matmul blocking: equal up to fp32 rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert ("decode", "breakable", 3, 4, 5) in runner.stats.frequency_table()  # 3 sequences ran as the 4 bucket
    # the padded row read nothing and wrote to the null block
    assert runner.decode_in.device("seq_lens")[3].item() == 0
    assert runner.decode_in.device("slot_mapping")[3].item() == NULL_SLOT
    assert runner.allocator.num_free == runner.allocator.num_blocks  # every block came back
    runner.close()


def test_decode_batches_past_the_largest_capture_size_run_eagerly(model, caplog):
    """Capture sizes topping out below max_batch were refused; vLLM runs the larger batches eagerly, and so does this
    now, saying so once at start-up: the same tokens, the batches past size 2 dispatched to no graph."""
    eager = greedy_generate(runner_for(model, "none"), PROMPTS, 4, keep_logits=True)
    graphs = GraphConfig(decode_mode="breakable", prefill_mode="none", ladder=(1, 2))
    with caplog.at_level("WARNING", logger="tpgraph.engine.runner"):
        runner = ModelRunner(model, RunnerConfig(block_size=4, max_batch=5, max_model_len=64, graphs=graphs))
    assert runner.decode_eager_above == 2
    assert "decode batches of 3 to 5 sequences run eagerly: the decode capture sizes top out at 2" in caplog.text
    assert "eager above 2" in runner.summary()
    short = greedy_generate(runner, PROMPTS, 4, keep_logits=True)
    assert short.tokens == eager.tokens
    for a, b in zip(short.step_logits, eager.step_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert ("decode", "none", 3, 3, 3) in runner.stats.frequency_table()  # unpadded, no graph
    assert runner.allocator.num_free == runner.allocator.num_blocks
    runner.close()
    covered = ModelRunner(model, RunnerConfig(block_size=4, max_batch=2, max_model_len=64, graphs=graphs))
    assert covered.decode_eager_above is None and "eager above" not in covered.summary()
    covered.close()


def test_cpu_downgrades_are_recorded_in_the_metrics(model):
    runner = runner_for(model, "full")
    assert runner.modes.decode == "none"
    value = runner.stats.registry.get_sample_value(
        "tpgraph_graph_mode_downgrade", {"phase": "decode", "requested": "full", "resolved": "none",
                                         "reason": "CUDA graphs need a CUDA device (device is 'cpu')"})
    assert value == 1.0


def test_prefill_runs_in_forwards_of_at_most_max_num_batched_tokens(model):
    prompts = [[256] + list(range(1, 20)), [256] + list(range(30, 45)), [256] + list(range(50, 70))]
    whole = greedy_generate(runner_for(model, "none"), prompts, 3, keep_logits=True)
    graphs = GraphConfig(decode_mode="none", prefill_mode="none")
    capped = ModelRunner(model, RunnerConfig(block_size=4, max_batch=5, max_model_len=40, max_num_batched_tokens=40,
                                             graphs=graphs))
    split = greedy_generate(capped, prompts, 3, keep_logits=True)
    assert split.tokens == whole.tokens
    assert sum(c for p, _, _, _, c in capped.stats.frequency_table() if p == "prefill") == 2  # 20+16 | 21 tokens
    torch.testing.assert_close(split.step_logits[0], whole.step_logits[0], rtol=1e-5, atol=1e-5)
    # a budget below max_model_len: whole prompts run in chunks and give the same result
    chunked = ModelRunner(model, RunnerConfig(block_size=4, max_batch=5, max_model_len=40, max_num_batched_tokens=8,
                                              graphs=graphs))
    assert greedy_generate(chunked, prompts, 3).tokens == whole.tokens
    assert sum(c for p, _, _, _, c in chunked.stats.frequency_table() if p == "prefill") >= 7  # 56 tokens, 8 a time


def test_max_model_len_defaults_to_the_models_and_must_fit_the_cache(model):
    graphs = GraphConfig(decode_mode="none", prefill_mode="none")
    assert ModelRunner(model, RunnerConfig(max_batch=1, graphs=graphs)).max_model_len == \
        model.cfg.max_position_embeddings
    capped = ModelRunner(model, RunnerConfig(block_size=16, max_batch=1, num_kv_blocks=11, graphs=graphs))
    assert capped.max_model_len == 160  # 10 usable blocks of 16
    with pytest.raises(ConfigError, match="max_model_len 512 needs that many tokens of KV cache, but only 160 fit"):
        ModelRunner(model, RunnerConfig(block_size=16, max_batch=1, max_model_len=512, num_kv_blocks=11,
                                        graphs=graphs))
    # the floor a measured cache (CUDA) is checked against: one sequence only where max_model_len was asked for, the
    # model's own being capped as above (only this rule runs here: the measured path needs CUDA)
    assert capped.min_cache_blocks() == 2
    explicit = ModelRunner(model, RunnerConfig(block_size=16, max_batch=1, max_model_len=100, graphs=graphs))
    assert explicit.min_cache_blocks() == 1 + 7


def test_running_out_of_memory_in_capture_names_the_remedies():
    comm = FakeComm()

    def prepare(n):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(CaptureError, match="capturing the decode graph for 8 tokens.*--enforce-eager"):
        make_graph_runner(comm).capture("decode", "breakable", (8,), None, lambda n: {}, prepare)


@pytest.mark.parametrize("calibrate", [True, False])
def test_prefill_calibration_times_each_size_eagerly_and_from_its_graph(model, monkeypatch, calibrate):
    """The runner's side of calibration.py on the CPU: a stand-in for the prefill graphs (the CPU captures none) sees
    each size replayed with the null prompts' lengths, and the dispatcher then runs the counts that timing picks
    eagerly."""
    runner = runner_for(model, "none", calibrate_prefill=calibrate)
    runner.prefill_dispatcher = Dispatcher((), (8, 16))
    replayed, lens_seen = [], []

    def replay(phase, size, inputs):
        meta = runner._meta_for_prefill(size)
        replayed.append((phase, size, meta.query_lens, meta.context_lens))
        lens_seen.append(meta.query_lens)
        return runner._eager_prefill(size, list(meta.query_lens))

    monkeypatch.setitem(runner.graphs.sets, "prefill", SimpleNamespace(sizes=(8, 16)))
    monkeypatch.setattr(runner.graphs, "replay", replay)
    free = runner.allocator.num_free
    runner._calibrate_prefill()
    if not calibrate:
        assert runner.prefill_timings == [] and replayed == []
        return
    assert [t.size for t in runner.prefill_timings] == [8, 16]
    assert all(t.eager_s > 0 and t.graph_s > 0 for t in runner.prefill_timings)
    assert replayed == [("prefill", 8, (8,), ())] * 4 + [("prefill", 16, (16,), ())] * 4  # a warm-up and three timed
    # each replay's metadata set afresh, as a step's (varlen attention rebuilds its layout only for new tuples)
    assert len({id(t) for t in lens_seen}) == len(lens_seen)
    assert runner.prefill_dispatcher.eager_counts == tuple(n for n in eager_counts(runner.prefill_timings)
                                                           if n <= runner.max_prefill_tokens)
    assert runner.prefill_dispatcher.piecewise_sizes == (8, 16)
    assert runner.allocator.num_free == free  # the null prompts stored nothing
    assert "; timed: " in runner.summary()
    del runner.graphs.sets["prefill"]  # (the stand-in holds nothing to release)
    runner.close()


def test_boundary_scratch_holds_a_decode_batch_past_the_prefill_budget(model):
    """Piecewise decode splits at attention into the one boundary scratch, reserved before any capture. With more
    decode rows (--max-num-seqs) than a prefill forward's tokens (--max-num-batched-tokens), a reserve at the token
    budget was too small: the KV estimate's first capture (the smallest size) hands the scratch out, so the largest
    size's capture could not grow it and start-up failed (the CUDA path; the same workspace calls here)."""
    graphs = GraphConfig(decode_mode="breakable", prefill_mode="none", ladder=(1, 2, 4, 8))
    runner = ModelRunner(model, RunnerConfig(block_size=4, max_batch=5, max_model_len=64, max_num_batched_tokens=4,
                                             graphs=graphs))
    assert runner.seq_rows == 8 and runner.token_rows == 4
    row = runner.model.attention_layers()[0].num_heads * model.cfg.head_dim
    workspaces = runner.graphs.workspaces
    runner.graphs.reopen_capture_phase()
    workspaces.get("piecewise_boundary", row, runner.dtype, runner.device)  # the estimate's first, smallest capture
    workspaces.get("piecewise_boundary", runner.seq_rows * row, runner.dtype, runner.device)  # the largest: fits
    runner.close()


def test_a_decode_batch_past_max_batch_is_refused_in_every_mode(model):
    """The buffers hold the largest bucket's rows (8 for max_batch 5 on the ladder 1, 2, 4, 8): a batch of 6 was
    refused eagerly but ran from the graphs, past the penalty table's max_batch rows."""
    from tpgraph.engine.sequence import Sequence

    for mode in ("none", "breakable"):
        runner = runner_for(model, mode)
        seqs = [Sequence(i, [256, i + 1], 4) for i in range(6)]
        runner.prefill(seqs)
        for seq in seqs:
            seq.output_ids.append(7)
        with pytest.raises(ConfigError, match="a decode batch of 6 exceeds max_batch 5"):
            runner.decode(seqs)
        runner.decode(seqs[:5])
        runner.close()


@pytest.mark.parametrize("name", ["max_model_len", "num_kv_blocks", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -8, True, 2.5])
def test_runner_config_refuses_sizes_that_are_not_positive_integers(name, value):
    """Read through `or` (None: the default), a 0 silently became the default (the KV cache sized from memory
    despite num_kv_blocks=0), and a negative budget refused every prefill later, far from its cause."""
    with pytest.raises(ConfigError, match=f"{name} must be a positive integer or None"):
        RunnerConfig(**{name: value})
    assert getattr(RunnerConfig(**{name: 64}), name) == 64


def test_persistent_buffers_are_laid_out_before_the_kv_cache_is_sized(model, monkeypatch):
    """The KV sizing (CUDA) measures its profile's activation peak from a baseline, then what stays in use: buffers
    first laid out by the profile's own steps were counted in both, taking their bytes twice from the cache."""
    from tpgraph.graphs.buffers import PersistentBuffers

    events = []
    lay_out, size_kv = PersistentBuffers._lay_out, ModelRunner._size_kv_cache
    monkeypatch.setattr(PersistentBuffers, "_lay_out", lambda self, total: (events.append("buffers"),
                                                                            lay_out(self, total))[1])
    monkeypatch.setattr(ModelRunner, "_size_kv_cache", lambda self: (events.append("kv sizing"), size_kv(self))[1])
    runner_for(model, "breakable").close()
    assert events[:3] == ["buffers", "buffers", "kv sizing"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=True), "block_size must be a power of two, got True"),
    (dict(block_size=16.0), "block_size must be a power of two, got 16.0"),
    (dict(block_size=12), "block_size must be a power of two, got 12"),
    (dict(max_batch=True), "max_batch must be a positive integer, got True"),
    (dict(max_batch=2.5), "max_batch must be a positive integer, got 2.5"),
    (dict(max_batch=0), "max_batch must be a positive integer, got 0"),
])
def test_runner_config_refuses_bools_and_floats_as_sizes(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RunnerConfig(**kwargs)


@pytest.mark.parametrize("value", [True, "0.9", 0, 1.5, float("nan")])
def test_runner_and_memory_budget_refuse_gpu_memory_utilization_as_the_engine_does(value):
    """RunnerConfig and MemoryBudget each restated EngineConfig's range check without its type check: True passed as
    1.0 and "0.9" failed with a TypeError; all three now refuse alike, saying the name and the value given."""
    message = re.escape(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}")
    with pytest.raises(ConfigError, match=message):
        RunnerConfig(gpu_memory_utilization=value)
    with pytest.raises(ConfigError, match=message):
        MemoryBudget(total=1 << 30, utilization=value, in_use=0, weights=0, workspace=0, activation_peak=0,
                     graph_pool_estimate=0, block_bytes=1)
