"""Functions run on every rank by tests in this folder (importable by spawned processes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tpgraph.comm import TPCommunicator
from tpgraph.distributed import destroy_distributed, gather_objects, init_distributed, run_on_all_ranks
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.graphs.config import GraphConfig
from tpgraph.model.loader import load_model


def greedy_with_logits(rank, world_size, init, model_dir, prompts, steps, block_size, use_triton,
                       decode_mode="none"):
    state = init_distributed("cpu", rank, world_size, init)
    try:
        comm = TPCommunicator(state)
        model = load_model(state, comm, model_dir, dtype=torch.float32)
        graphs = GraphConfig(decode_mode=decode_mode, prefill_mode="none", ladder=(1, 2, 4, 8))
        runner = ModelRunner(model, RunnerConfig(block_size=block_size, max_batch=len(prompts), max_model_len=128,
                                                 use_triton=use_triton, graphs=graphs))
        result = greedy_generate(runner, prompts, steps, keep_logits=True)
        free_after = runner.allocator.num_free == runner.allocator.num_blocks
        runner.close()
        return {"tokens": result.tokens, "logits": torch.stack(result.step_logits), "blocks_returned": free_after,
                "steps": runner.stats.frequency_table(), "kv_blocks": runner.num_kv_blocks}
    finally:
        destroy_distributed(state)


def load_expecting_error(rank, world_size, init, model_dir):
    """Load a bad checkpoint; return the error each rank raised (type name and message)."""
    state = init_distributed("cpu", rank, world_size, init)
    try:
        load_model(state, TPCommunicator(state), model_dir, dtype=torch.float32)
    except Exception as exc:  # the test inspects it
        return type(exc).__name__, str(exc)
    finally:
        destroy_distributed(state)
    return None


def fail_on_one_rank(rank, world_size, init, failing_rank):
    """Only failing_rank raises; every rank must get an error, then a collective must still work."""
    state = init_distributed("cpu", rank, world_size, init)
    try:
        def work():
            if rank == failing_rank:
                raise ValueError(f"disk on rank {rank} is on fire")
            return rank

        try:
            run_on_all_ranks(state, work, "test work")
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
        else:
            error = None
        x = torch.ones(1)
        TPCommunicator(state).all_reduce(x)  # nobody is stuck: the group still works
        return error, float(x)
    finally:
        destroy_distributed(state)


def collectives(rank, world_size, init):
    state = init_distributed("cpu", rank, world_size, init)
    try:
        comm = TPCommunicator(state)
        x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
        summed = comm.all_reduce(x.clone())
        gathered = comm.all_gather(torch.full((2, 1), float(rank)), dim=-1)
        # rows of a wider persistent buffer (as the logits are gathered), and along the first dim
        buffer = torch.full((4, 2 * world_size + 1), -1.0)
        mine = torch.tensor([[rank, 10 + rank], [20 + rank, 30 + rank]], dtype=torch.float32)
        comm.all_gather(mine, dim=-1, out=buffer[:2, :-1])  # (not contiguous: a copy goes through a buffer)
        stacked = comm.all_gather(mine, dim=0)
        return summed, gathered, buffer, stacked
    finally:
        destroy_distributed(state)


def ipc_roundtrip(rank, world_size, init):
    """Each rank maps its neighbour's buffer through CUDA IPC and copies it out."""
    from tpgraph._ext import load_ext

    state = init_distributed("cuda", rank, world_size, init)
    ext = load_ext()
    try:
        pad = torch.zeros(1000 + 24 * rank, dtype=torch.int32, device=state.device)  # mine sits past the base
        mine = torch.arange(4096, dtype=torch.int32, device=state.device) + 1000 * rank
        torch.cuda.synchronize()
        base, size = ext.allocation_range(mine.data_ptr())
        assert base < mine.data_ptr() < base + size, "expected a sub-allocation (offset > 0)"
        del pad
        exported = gather_objects(state, (ext.ipc_get_handle(mine.data_ptr()), mine.data_ptr() - base))
        peer = (rank + 1) % world_size
        handle, offset = exported[peer]
        handles = {peer: handle}
        ptr = ext.ipc_open_handle(handle) + offset
        assert ext.ipc_open_handle(handle) + offset == ptr  # cached: one mapping
        assert ext.ipc_open_count() == 1
        got = torch.empty_like(mine)
        stream = torch.cuda.current_stream().cuda_stream
        ext.memcpy_async(got.data_ptr(), ptr, got.numel() * 4, stream)
        ext.stream_synchronize(stream)
        ok = torch.equal(got.cpu(), torch.arange(4096, dtype=torch.int32) + 1000 * peer)
        ext.ipc_close_handle(handles[peer])
        ext.ipc_close_handle(handles[peer])
        dist.barrier(group=state.cpu_group)
        return ok, ext.ipc_open_count()
    finally:
        destroy_distributed(state)


def roomy_config():
    """A workspace with room for every algorithm up to 64 MB (forced algorithms, whatever the table says)."""
    from tpgraph.comm.custom_ar import CustomAllReduceConfig

    return CustomAllReduceConfig(push_slot_bytes=64 << 20, staging_bytes=64 << 20)


def forced_pull_config(**kw):
    """The default workspace, plus staging for a forced eager pull of a few KB: the product sizes staging from its
    table's pull bands, and the SM90 ws=2 rows have none, so the default would refuse it."""
    from tpgraph.comm.custom_ar import CustomAllReduceConfig

    return CustomAllReduceConfig(staging_bytes=1 << 20, **kw)


@contextlib.contextmanager
def custom_ar_on_rank(rank, world_size, init, cfg=None) -> Iterator[tuple]:
    """(state, CustomAllReduce) on this rank's GPU, closed and torn down on the way out."""
    from tpgraph.comm.custom_ar import CustomAllReduce

    state = init_distributed("cuda", rank, world_size, init)
    try:
        ar = CustomAllReduce(state, cfg)
        try:
            yield state, ar
        finally:
            ar.close()
    finally:
        destroy_distributed(state)


def custom_ar_exactness(rank, world_size, init, sizes, iters):
    """Every algorithm forced, every dtype: integer-valued inputs must give NCCL's result exactly. Iterations
    alternate the table's grid, 3 blocks and one block per SM, so calls with different grids follow each other."""
    from tpgraph.comm.thresholds import Algo

    with custom_ar_on_rank(rank, world_size, init, roomy_config()) as (state, ar):
        grids = (None, 3, ar.num_sms)
        failures, checked = [], 0
        for algo in (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT, Algo.MULTICAST_2SHOT):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):  # dtypes interleave on one workspace
                for numel in sizes(dtype):
                    for it in range(iters):
                        g = torch.Generator(device="cuda").manual_seed(1000 * rank + 7 * it + numel)
                        x = torch.randint(-8, 8, (numel,), device="cuda", generator=g).to(dtype)
                        x[::97] = -0.0  # real negative zeros must survive the push sentinel
                        ref = x.clone()
                        dist.all_reduce(ref, group=state.tp_group)
                        ar.all_reduce(x, algo, blocks=grids[it % len(grids)])
                        checked += 1
                        if not torch.equal(x, ref):
                            bad = (x != ref).nonzero()[:3].flatten().tolist()
                            failures.append((algo.value, str(dtype), numel, it, bad))
        torch.cuda.synchronize()
        return failures, checked


def custom_ar_skipped_call(rank, world_size, init, timeout_s, out_dir):
    """Rank 1 skips an all-reduce; rank 0's kernel must time out and name rank 1."""
    import os
    import time

    from tpgraph.comm.custom_ar import CustomAllReduce
    from tpgraph.comm.thresholds import Algo
    from tpgraph.errors import CommError

    state = init_distributed("cuda", rank, world_size, init)
    ar = CustomAllReduce(state, forced_pull_config(timeout_s=timeout_s))
    x = torch.ones(4096, device="cuda")
    ar.all_reduce(x, Algo.PULL_1SHOT)
    torch.cuda.synchronize()
    start = time.monotonic()
    if rank == 0:
        ar.all_reduce(x, Algo.PULL_1SHOT)
        try:
            torch.cuda.synchronize()
            outcome = ("no error", None)
        except RuntimeError as exc:
            err = ar.timeout_error()
            outcome = (str(err) if err else f"untranslated: {exc}", time.monotonic() - start)
            try:  # the dead context refuses further calls with the same message
                ar.all_reduce(x, Algo.PULL_1SHOT)
                outcome += ("next call accepted",)
            except CommError as again:
                outcome += (str(again),)
            ar._watchdog.join(timeout=2.0)  # it polls every 0.2 s; let it log before the hard exit
    else:
        outcome = ("skipped", 0.0)
    from pathlib import Path

    Path(out_dir, f"outcome{rank}").write_text(repr(outcome))
    os._exit(0)  # the trapped context cannot be torn down cleanly


def custom_ar_skipped_epilogue(rank, world_size, init, timeout_s, out_dir):
    """Rank 1 skips a projection whose epilogue all-reduces (kernels/lamport.py); rank 0's must time out, and the
    custom all-reduce's record (written by the Triton kernel before its trap) name the epilogue and rank 1."""
    import os
    import time
    from pathlib import Path

    from tpgraph.comm.custom_ar import CustomAllReduce
    from tpgraph.kernels.gemv import linear_all_reduce_norm

    state = init_distributed("cuda", rank, world_size, init)
    ar = CustomAllReduce(state, forced_pull_config(timeout_s=timeout_s))
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(2, 2048, device="cuda", generator=g).bfloat16()
    w = (0.05 * torch.randn(4096, 2048, device="cuda", generator=g)).bfloat16()
    residual, nw = torch.zeros(2, 4096, device="cuda").bfloat16(), torch.ones(4096, device="cuda").bfloat16()
    call = lambda: linear_all_reduce_norm(x, w, ar.channel, residual, nw, 1e-5)  # noqa: E731
    taken = call() is not None  # one exchange both ranks make
    torch.cuda.synchronize()
    start = time.monotonic()
    if rank == 0:
        call()
        try:
            torch.cuda.synchronize()
            outcome = (taken, "no error", None)
        except RuntimeError as exc:
            err = ar.timeout_error()
            outcome = (taken, str(err) if err else f"untranslated: {exc}", time.monotonic() - start)
            ar._watchdog.join(timeout=2.0)  # it polls every 0.2 s; let it log before the hard exit
    else:
        outcome = (taken, "skipped", 0.0)
    Path(out_dir, f"outcome{rank}").write_text(repr(outcome))
    os._exit(0)  # the trapped context cannot be torn down cleanly


def custom_ar_unregistered_replay(rank, world_size, init, out_dir):
    """A graph replayed before capture() registered its rows: the kernel must refuse it, and the error say why."""
    import os
    from pathlib import Path

    from tpgraph.comm.custom_ar import CustomAllReduce
    from tpgraph.comm.thresholds import Algo
    from tpgraph.errors import CommError

    state = init_distributed("cuda", rank, world_size, init)
    ar = CustomAllReduce(state, forced_pull_config())
    x = torch.ones(4096, device="cuda")
    ar.all_reduce(x, Algo.PULL_2SHOT)  # warm-up (eager)
    torch.cuda.synchronize()
    outcome = ("no error",)
    with ar.capture():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ar.all_reduce(x, Algo.PULL_2SHOT)
        graph.replay()  # rows still empty: registration happens when the context exits
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            err = ar.timeout_error()
            try:
                ar.all_reduce(x, Algo.PULL_2SHOT)
                after = "next call accepted"
            except CommError as exc:
                after = str(exc)
            outcome = (str(err) if err else "untranslated", after)
        Path(out_dir, f"outcome{rank}").write_text(repr(outcome))
        os._exit(0)  # the trapped context cannot be torn down cleanly


GRAPH_TEST_BYTES = (16, 4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20)


def custom_ar_graphs(rank, world_size, init, replays):
    """4 layers x (push, 1shot_pull, 2shot_pull) x sizes, each followed by an in-place NCCL all-reduce of the
    same tensor, captured once and replayed with fresh inputs written in place; compared with eager NCCL."""
    from tpgraph.comm.thresholds import Algo
    from tpgraph.errors import CommError

    with custom_ar_on_rank(rank, world_size, init, roomy_config()) as (state, ar):
        algos = (Algo.PUSH_1SHOT, Algo.PULL_1SHOT, Algo.PULL_2SHOT, Algo.MULTICAST_2SHOT)  # multicast: emulated
        failures, compared = [], 0
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            item = torch.tensor([], dtype=dtype).element_size()
            numels = [n // item for n in GRAPH_TEST_BYTES] + [1040]
            inputs = [[torch.zeros(n, dtype=dtype, device="cuda") for n in numels for _ in algos] for _ in range(4)]

            def body(inputs=inputs):
                outs = []
                for layer in inputs:
                    for j, x in enumerate(layer):
                        y = ar.all_reduce(x.clone(), algos[j % len(algos)])
                        dist.all_reduce(y, group=state.tp_group)  # in-place NCCL on the custom result
                        outs.append(y)
                return outs

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with ar.capture():
                with torch.cuda.stream(side):
                    body()  # warm-up inside the context: eager path, really communicates
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = body()
            for it in range(replays):
                g = torch.Generator(device="cuda").manual_seed(rank * 100003 + it)
                for layer in inputs:
                    for x in layer:
                        x.copy_(torch.randint(0, 8, x.shape, device="cuda", generator=g).to(dtype))
                graph.replay()
                refs = []
                for layer in inputs:
                    for x in layer:
                        r = x.clone()
                        dist.all_reduce(r, group=state.tp_group)
                        dist.all_reduce(r, group=state.tp_group)
                        refs.append(r)
                for k, (o, r) in enumerate(zip(outs, refs, strict=True)):
                    compared += 1
                    if not torch.equal(o, r):
                        failures.append((str(dtype), it, k, algos[k % len(algos)].value))
            del graph
        # ranks that capture different numbers of custom all-reduces are told so, on every rank
        x = torch.ones(1024, device="cuda")
        mismatch = None
        try:
            with ar.capture():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(1 + rank):
                        ar.all_reduce(x, Algo.PULL_2SHOT)
        except CommError as exc:
            mismatch = str(exc)
        torch.cuda.synchronize()
        return failures[:10], compared, mismatch


def custom_ar_two_streams(rank, world_size, init):
    """A call from a second stream while the first stream's call may still run is refused, not hung."""
    from tpgraph.comm.thresholds import Algo
    from tpgraph.errors import CommError

    with custom_ar_on_rank(rank, world_size, init, forced_pull_config(timeout_s=20)) as (state, ar):
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        x, y = torch.ones(4096, device="cuda"), torch.ones(4096, device="cuda")
        with torch.cuda.stream(a):  # first launch loads the kernel module (lazy loading may synchronize)
            ar.all_reduce(torch.ones(4096, device="cuda"), Algo.PULL_1SHOT)
        torch.cuda.synchronize()
        with torch.cuda.stream(a):
            torch.cuda._sleep(2_000_000_000)  # keep stream a busy for about a second
            ar.all_reduce(x, Algo.PULL_1SHOT)
        refused = None
        busy = not a.query()  # the premise: stream a is still sleeping
        with torch.cuda.stream(b):
            try:
                ar.all_reduce(y, Algo.PULL_1SHOT)
            except CommError as exc:
                refused = str(exc)
        torch.cuda.synchronize()
        b.wait_stream(a)  # ordered use of another stream is fine
        with torch.cuda.stream(b):
            ar.all_reduce(y, Algo.PULL_1SHOT)
        torch.cuda.synchronize()
        return busy, refused, float(x[0]), float(y[0])


def custom_ar_bad_arguments(rank, world_size, init):
    """Mistakes a caller can make are refused with a reason, and the communicator keeps working afterwards."""
    from tpgraph.comm.thresholds import Algo
    from tpgraph.errors import CommError

    with custom_ar_on_rank(rank, world_size, init, None) as (state, ar):
        messages = []

        def refused(fn, errors=(CommError,)):
            try:
                fn()
                messages.append("accepted")
            except errors as exc:
                messages.append(str(exc))

        refused(lambda: ar.all_reduce(torch.ones(64)))  # a CPU tensor
        refused(lambda: ar.all_reduce(torch.ones(64, device="cuda")[::2], Algo.PUSH_1SHOT))  # strided
        refused(lambda: ar.all_reduce(torch.ones(64, dtype=torch.int32, device="cuda"), Algo.PUSH_1SHOT))
        buf = torch.ones(1024, device="cuda")  # input and output overlapping by 16 bytes, through the extension
        refused(lambda: ar.ext.ar_all_reduce(ar.ctx, 1, 0, buf.data_ptr() + 16, buf.data_ptr(), 4000, 1,
                                             torch.cuda.current_stream().cuda_stream, ar.timeout_ns, -1),
                errors=(RuntimeError, ValueError))
        y = torch.ones(4096, device="cuda")
        ar.all_reduce(y)
        return messages, float(y[0])


def communicator_uses_custom(rank, world_size, init):
    """TPCommunicator picks the custom path on GPUs (the model calls it unchanged) and matches NCCL."""
    from tpgraph.comm import TPCommunicator

    state = init_distributed("cuda", rank, world_size, init)
    comm = TPCommunicator(state)
    try:
        out = []
        for n in (8, 1040, 4096, 1 << 20, 40 << 20):  # the last is above the workspace: NCCL
            x = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
            out.append(bool(torch.all(comm.all_reduce(x) == sum(range(1, world_size + 1)))))
        return comm.custom is not None, out
    finally:
        comm.close()
        destroy_distributed(state)


def engine_generate(rank, world_size, init, prompts, params, engine_kw):
    """TPEngine on every rank (SPMD), the same prompts everywhere; returns each rank's completions. `params`: one
    generate call's SamplingParams, or a list of calls' (their completions one after another)."""
    from tpgraph import TPEngine

    calls = params if params and isinstance(params[0], list) else [params]
    with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init), device="cpu", **engine_kw) as engine:
        out = [o for call in calls for o in engine.generate(prompts, call)]
        blocks_back = engine.runner.allocator.num_free == engine.runner.allocator.num_blocks
        in_step = engine.runner.greedy_in_step
        hits = engine.core.scheduler.prefix_hit_tokens
        preemptions = engine.core.scheduler.num_preemptions
    return {"completions": [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in out],
            "blocks_back": blocks_back, "greedy_in_step": in_step, "prefix_hits": hits, "preemptions": preemptions,
            "prompt_logprobs": [o.prompt_logprobs for o in out]}


def engine_beam_search(rank, world_size, init, prompts, fields, engine_kw):
    """TPEngine on every rank (SPMD), beam_search with the same prompts and BeamSearchParams(**fields) everywhere;
    returns each rank's sequences (tokens, cum_logprob, finish_reason, text) and whether every block came back."""
    from tpgraph import BeamSearchParams, TPEngine

    with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init), device="cpu", **engine_kw) as engine:
        out = engine.beam_search(prompts, BeamSearchParams(**fields))
        blocks_back = engine.runner.allocator.num_free == engine.runner.allocator.num_blocks
    return {"sequences": [[(s.tokens, s.cum_logprob, s.finish_reason, s.text) for s in o.sequences] for o in out],
            "blocks_back": blocks_back}


def engine_beam_search_per_rank(rank, world_size, init, prompts, fields_by_rank, engine_kw):
    """TPEngine on every rank (SPMD), each rank calling beam_search with its own BeamSearchParams fields; returns each
    rank's error (or None), then the best sequence's tokens of a second, matching call."""
    from tpgraph import BeamSearchParams, TPEngine
    from tpgraph.errors import RequestError

    with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init), device="cpu", **engine_kw) as engine:
        try:
            engine.beam_search(prompts, BeamSearchParams(**fields_by_rank[rank]))
            error = None
        except RequestError as exc:
            error = str(exc)
        after = engine.beam_search(prompts, BeamSearchParams(**fields_by_rank[0]))[0].sequences[0].tokens
    return error, after


def engine_generate_per_rank(rank, world_size, init, prompts_by_rank, engine_kw):
    """TPEngine on every rank (SPMD), each rank calling generate with its own prompts; returns each rank's error (or
    None), then whether a second, matching call still runs."""
    from tpgraph import SamplingParams, TPEngine
    from tpgraph.errors import RequestError

    params = SamplingParams(temperature=0.0, max_tokens=4)
    with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init), device="cpu", **engine_kw) as engine:
        try:
            engine.generate(prompts_by_rank[rank], params)
            error = None
        except RequestError as exc:
            error = str(exc)
        after = engine.generate(prompts_by_rank[0], params)[0].outputs[0].token_ids
    return error, after


def custom_setup_failing_on(rank, world_size, init, failing_rank):
    """_try_custom_allreduce on a CUDA-shaped state over gloo, whose CustomAllReduce fails with a CUDA error on
    `failing_rank` alone; returns (whether this rank got one, its reason)."""
    import dataclasses

    import torch

    import tpgraph._ext
    from tpgraph.comm import communicator, custom_ar, thresholds
    from tpgraph.distributed import destroy_distributed, init_distributed

    state = init_distributed("cpu", rank, world_size, init)

    class Fake:
        def __init__(self, state, config):
            if state.rank == failing_rank:
                raise RuntimeError("CUDA error cudaErrorPeerAccessUnsupported in `cudaIpcOpenMemHandle`")

        def close(self):
            pass

    tpgraph._ext.extension_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    thresholds.load_table_for = lambda capability: None
    custom_ar.CustomAllReduce = Fake
    try:
        ar, reason = communicator._try_custom_allreduce(dataclasses.replace(state, device=torch.device("cuda", 0)))
    finally:
        destroy_distributed(state)
    return ar is not None, reason


def custom_setup_raising_on(rank, world_size, init, failing_rank, error):
    """_try_custom_allreduce on a CUDA-shaped state over gloo, whose CustomAllReduce raises `error` on `failing_rank`
    alone; returns ("fell back", whether this rank got one, its reason, the warnings the communicator logged) or
    ("raised", the exception's type name, its message)."""
    import dataclasses
    import logging

    import torch

    import tpgraph._ext
    from tpgraph.comm import communicator, custom_ar, thresholds

    state = init_distributed("cpu", rank, world_size, init)

    class Fake:
        def __init__(self, state, config):
            if state.rank == failing_rank:
                raise error

        def close(self):
            pass

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    kept = Kept()
    logging.getLogger(communicator.__name__).addHandler(kept)
    tpgraph._ext.extension_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    thresholds.load_table_for = lambda capability: None
    custom_ar.CustomAllReduce = Fake
    try:
        try:
            ar, reason = communicator._try_custom_allreduce(dataclasses.replace(state, device=torch.device("cuda", 0)))
        except Exception as exc:  # the test inspects it
            return "raised", type(exc).__name__, str(exc)
        return "fell back", ar is not None, reason, kept.messages
    finally:
        destroy_distributed(state)


def custom_setup_failing_to_map_on(rank, world_size, init, failing_rank):
    """custom_setup_with_a_fake_extension whose ipc_open_handle (cudaIpcOpenMemHandle) fails on `failing_rank` alone,
    after the ranks exchanged their workspace handles; returns (whether this rank got one, its reason)."""
    error = RuntimeError("CUDA error cudaErrorPeerAccessUnsupported in `cudaIpcOpenMemHandle`")
    outcome = custom_setup_with_a_fake_extension(rank, world_size, init, failing_rank, "ipc_open_handle", error)
    assert outcome[0] == "fell back", outcome
    return outcome[1:]


def custom_setup_with_a_fake_extension(rank, world_size, init, failing_rank, failing_call, error, env=None):
    """The real CustomAllReduce set-up through _try_custom_allreduce on a CUDA-shaped state over gloo, with a fake
    extension whose `failing_call` raises `error` on `failing_rank` alone (and `env` set there alone); returns
    ("fell back", whether this rank got one, its reason) or ("raised", the exception's type name, its message)."""
    import dataclasses
    import os
    from types import SimpleNamespace

    import torch

    import tpgraph._ext
    from tpgraph.comm import communicator, custom_ar

    state = init_distributed("cpu", rank, world_size, init)

    class Ext:
        def device_properties(self, index):
            return SimpleNamespace(sm_count=132, major=9, minor=0)

        def ipc_get_handle(self, base):
            return f"handle-{rank}".encode()

        def ipc_open_handle(self, handle):
            return 0x7F00_0000_0000

        def __getattr__(self, name):  # (the rest: creating, filling, closing, destroying)
            return lambda *args: 1

        def __getattribute__(self, name):
            if rank == failing_rank and name == failing_call:
                def fail(*args):
                    raise error
                return fail
            return object.__getattribute__(self, name)

    def p2p_check(self, peers):  # its two exchanges (every write done; the writes lost: none), without CUDA's part
        custom_ar.gather_objects(self.state, None)
        custom_ar.gather_objects(self.state, [])

    tpgraph._ext.extension_available = lambda: True
    custom_ar.load_ext = Ext
    custom_ar.CustomAllReduce._check_p2p_writes = p2p_check
    custom_ar.CustomAllReduce._watch_timeouts = lambda self: None
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.synchronize = lambda device=None: None
    for var in ("NCCL_P2P_DISABLE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        os.environ.pop(var, None)
    if rank == failing_rank:
        os.environ.update(env or {})
    config = custom_ar.CustomAllReduceConfig(channel_slot_elems=0)
    try:
        try:
            ar, reason = communicator._try_custom_allreduce(
                dataclasses.replace(state, device=torch.device("cuda", 0)), config)
        except Exception as exc:  # the test inspects it
            return "raised", type(exc).__name__, str(exc)
        if ar is not None:
            ar.close()
        return "fell back", ar is not None, reason
    finally:
        destroy_distributed(state)


def fail_detokenizers(max_tokens: int) -> None:
    """In this process only (a failure of this rank alone), a request asking for `max_tokens` tokens cannot have its
    detokenizer built."""
    from tpgraph.engine import core as core_module

    real = core_module.Detokenizer

    def detokenizer(tokenizer, prompt_ids, params, *rest):
        if params.max_tokens == max_tokens:
            raise TypeError("rank 0 alone cannot build this detokenizer")
        return real(tokenizer, prompt_ids, params, *rest)

    core_module.Detokenizer = detokenizer


def service_with_rank0_failure(rank, world_size, init, failure, prompts, engine_kw, wait_s):
    """The server's loop on every rank (rank 0 drives an EngineService in its thread, the others follow it), with a
    failure injected in rank 0 alone: "detokenizer" (the request with max_tokens=7 cannot be prepared), "sink" (its
    front end's sink raises on its first token) or "on_step" (the step hook raises once). Rank 0 sends that request
    ("bad") and a good one ("good", prompts[0]) in one message, then each prompt ("after-i"); all greedy. Returns,
    on rank 0, each request's [(token id, finish reason)] and, on every rank, the requests still held."""
    import os
    import sys
    import threading

    from tpgraph import SamplingParams, TPEngine
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService

    with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init), device="cpu", **engine_kw) as engine:
        if rank != 0:
            EngineService(engine.core, ControlPlane(engine.state)).run_worker()
            return {"requests": list(engine.core.requests), "has_work": engine.core.has_work}
        if failure == "detokenizer":  # (module state of this process: rank 0's alone)
            fail_detokenizers(max_tokens=7)
        hook_calls = []

        def on_step(updates, step_s):
            hook_calls.append(step_s)
            if failure == "on_step" and len(hook_calls) == 1:
                raise RuntimeError("rank 0's step hook failed")

        service = EngineService(engine.core, ControlPlane(engine.state), heartbeat_s=0.05, on_step=on_step)
        got, done = {}, {}

        def submit(request_id, prompt, params):
            got[request_id], done[request_id] = [], threading.Event()

            def sink(update):
                if failure == "sink" and request_id == "bad" and update.token_id is not None:
                    raise RuntimeError("rank 0's front end failed")
                got[request_id].append((update.token_id, update.finish_reason))
                if update.finish_reason is not None:
                    done[request_id].set()

            service.enqueue(request_id, engine.encode(prompt), params, sink)

        def wait(request_ids):
            if not all(done[r].wait(wait_s) for r in request_ids):  # a desynced loop hangs: say so, end at once
                print(f"rank 0: {request_ids} not finished within {wait_s} s", file=sys.stderr, flush=True)
                os._exit(3)

        submit("bad", prompts[0], SamplingParams(temperature=0.0, max_tokens=7))
        submit("good", prompts[0], SamplingParams(temperature=0.0, max_tokens=8))
        service.start()  # (both in its first message)
        wait(["good"] if failure == "sink" else ["bad", "good"])
        for i, prompt in enumerate(prompts):
            submit(f"after-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8))
        wait([f"after-{i}" for i in range(len(prompts))])
        told = service.shutdown()
        return {"updates": got, "told": told, "error": repr(service.error), "requests": list(engine.core.requests),
                "has_work": engine.core.has_work}


def custom_ar_fused_norm(rank, world_size, init, cases, replays):
    """1shot_push + residual add + RMSNorm against 1shot_push then the add+RMSNorm kernel, on random-normal inputs:
    the new residual bit-equal, the normed output within bf16 rounding, both equal across ranks; eager, then the
    same calls captured in a graph and replayed on new inputs. A plain push of another size runs between fused calls
    (they share the push slots and phases) and must still equal NCCL."""
    from tpgraph.comm.thresholds import Algo
    from tpgraph.kernels.norm import add_rms_norm

    eps = 1e-5
    with custom_ar_on_rank(rank, world_size, init, roomy_config()) as (state, ar):
        failures, checked, worst = [], 0, 0.0

        def inputs(dtype, rows, hidden, seed):
            own = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
            common = torch.Generator(device="cuda").manual_seed(seed)
            x = torch.randn(rows, hidden, device="cuda", generator=own).to(dtype)
            residual = (4 * torch.randn(rows, hidden, device="cuda", generator=common)).to(dtype)
            weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=common)).to(dtype)
            return x, residual, weight

        def compare(tag, out, res, x, residual, weight):
            nonlocal checked, worst
            s = ar.all_reduce(x.clone(), Algo.PUSH_1SHOT)
            ref_out, ref_res = add_rms_norm(s, residual, weight, eps)
            rel = ((out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()).item()
            worst = max(worst, rel)
            both = torch.cat([out.flatten(), res.flatten()])
            peers = [torch.empty_like(both) for _ in range(world_size)]
            dist.all_gather(peers, both, group=state.tp_group)
            same_everywhere = all(torch.equal(p, peers[0]) for p in peers)
            ints = torch.randint(-8, 8, (1024 + 4 * out.shape[0],), device="cuda").float()  # another size
            ref_ints = ints.clone()
            dist.all_reduce(ref_ints, group=state.tp_group)
            plain_ok = torch.equal(ar.all_reduce(ints, Algo.PUSH_1SHOT), ref_ints)
            checked += 1
            if not (torch.equal(res, ref_res) and rel <= 1e-2 and same_everywhere and plain_ok):
                failures.append((tag, torch.equal(res, ref_res), rel, same_everywhere, plain_ok))

        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for rows, hidden in cases(dtype):
                tag = (str(dtype), rows, hidden)
                x, residual, weight = inputs(dtype, rows, hidden, rows + hidden)
                out, res = ar.all_reduce_add_rmsnorm(x, residual, weight, eps)
                compare(("eager", *tag), out, res, x, residual, weight)
                if rows * hidden * x.element_size() > 1 << 20:
                    continue  # graphs for the decode sizes; the large ones ran eagerly above
                static = [t.clone() for t in (x, residual, weight)]
                graph = torch.cuda.CUDAGraph()
                with ar.capture():
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                        g_out, g_res = ar.all_reduce_add_rmsnorm(*static, eps)
                    torch.cuda.current_stream().wait_stream(stream)
                for it in range(replays):
                    fresh = inputs(dtype, rows, hidden, 7919 * (it + 1) + rows)
                    for dst, src in zip(static, fresh, strict=True):
                        dst.copy_(src)
                    graph.replay()
                    compare(("graph", it, *tag), g_out, g_res, *fresh)
                del graph
        torch.cuda.synchronize()
        return failures, checked, worst


ALL_ALGOS = ("1shot_push", "1shot_pull", "2shot_pull", "2shot_multicast")  # multicast: its unicast emulation


def rank_order_sum(state, x):
    """The sum every rank must produce: every rank's x, added in fp32 in rank order, rounded once."""
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    dist.all_gather(parts, x, group=state.tp_group)
    acc = parts[0].float()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(x.dtype)


def same_on_every_rank(state, x) -> bool:
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    dist.all_gather(parts, x, group=state.tp_group)
    return all(torch.equal(p, parts[0]) for p in parts)


def capture_all_reduce(ar, static, algo, pool=None):
    """One forced all-reduce of `static` captured in a graph (inside ar.capture()); returns (graph, output,
    registration)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with ar.capture() as registration:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=pool, stream=stream):
            out = ar.all_reduce(static, algo)
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out, registration


def all_reduce_once(ar, x, algo, in_graph):
    """x's forced all-reduce into a new tensor (x untouched): eager, or captured in a graph (inside ar.capture()),
    replayed once and dropped, its registration given back."""
    if not in_graph:
        return ar.all_reduce(x.clone(), algo)
    static = torch.zeros_like(x)
    graph, out, registration = capture_all_reduce(ar, static, algo)
    static.copy_(x)
    graph.replay()
    result = out.clone()
    del graph, out
    torch.cuda.synchronize()
    ar.release_registration(registration)
    return result


def custom_ar_random_normal(rank, world_size, init, sizes):
    """Random-normal inputs, where summation order shows: every algorithm, dtype and size, eager and in a graph,
    must give the fp32 sum in rank order bit for bit, and the same bits on every rank."""
    from tpgraph.comm.thresholds import Algo

    with custom_ar_on_rank(rank, world_size, init, roomy_config()) as (state, ar):
        failures, checked = [], 0
        for name in ALL_ALGOS:
            algo = Algo(name)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for numel in sizes(dtype):
                    for in_graph in (False, True):
                        g = torch.Generator(device="cuda").manual_seed(7919 * rank + numel + 13 * in_graph)
                        x = torch.randn(numel, device="cuda", generator=g).to(dtype)
                        ref = rank_order_sum(state, x)
                        result = all_reduce_once(ar, x, algo, in_graph)
                        checked += 1
                        if not (torch.equal(result, ref) and same_on_every_rank(state, result)):
                            failures.append((name, str(dtype), numel, in_graph,
                                             int((result != ref).sum().item())))
        return failures, checked


def custom_ar_push_pieces(rank, world_size, init, slot_bytes, byte_sizes):
    """1shot_push above its slot runs in slot-sized pieces: with a small slot, every size (one piece, a piece and 16
    bytes, several and a part) and dtype, eager and in a graph, interleaved with one-piece calls, must give the fp32
    rank-order sum bit for bit on random-normal inputs, the same bits on every rank, and NCCL's result on
    integer-valued ones."""
    from tpgraph.comm.custom_ar import CustomAllReduceConfig
    from tpgraph.comm.thresholds import Algo

    cfg = CustomAllReduceConfig(push_slot_bytes=slot_bytes)
    with custom_ar_on_rank(rank, world_size, init, cfg) as (state, ar):
        assert ar.push_slot_bytes == slot_bytes
        failures, checked = [], 0
        small = torch.ones(1024, device="cuda")
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            item = torch.tensor([], dtype=dtype).element_size()
            for nbytes in byte_sizes:
                numel = nbytes // item
                g = torch.Generator(device="cuda").manual_seed(7919 * rank + numel)
                x = torch.randn(numel, device="cuda", generator=g).to(dtype)
                ints = torch.randint(-8, 8, (numel,), device="cuda", generator=g).to(dtype)
                ref, int_ref = rank_order_sum(state, x), ints.clone()
                dist.all_reduce(int_ref, group=state.tp_group)
                for in_graph in (False, True):
                    for value, want in ((x, ref), (ints, int_ref)):
                        result = all_reduce_once(ar, value, Algo.PUSH_1SHOT, in_graph)
                        small.fill_(1.0)
                        ar.all_reduce(small, Algo.PUSH_1SHOT)  # a one-piece call between: phases stay in step
                        checked += 1
                        if not (torch.equal(result, want) and same_on_every_rank(state, result)):
                            failures.append((str(dtype), nbytes, in_graph, int((result != want).sum().item())))
                        if not torch.all(small == world_size):
                            failures.append(("one-piece call between", str(dtype), nbytes, in_graph))
        torch.cuda.synchronize()
        return failures, checked


def custom_ar_many_graphs(rank, world_size, init, replays):
    """Graphs of different algorithms and sizes alive together in one pool, replayed in a seeded random order (the
    same on every rank) with eager calls of other sizes in between: every result is the rank-order sum."""
    import random

    from tpgraph.comm.thresholds import Algo

    specs = [(Algo.PUSH_1SHOT, 4096, torch.bfloat16), (Algo.PULL_1SHOT, 262144, torch.bfloat16),
             (Algo.PULL_2SHOT, 1 << 20, torch.float16), (Algo.PUSH_1SHOT, 16384, torch.float32),
             (Algo.PULL_1SHOT, 2048, torch.float32), (Algo.PULL_2SHOT, 4096, torch.bfloat16)]
    with custom_ar_on_rank(rank, world_size, init, roomy_config()) as (state, ar):
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for algo, numel, dtype in specs:
            static = torch.zeros(numel, dtype=dtype, device="cuda")
            graph, out, _ = capture_all_reduce(ar, static, algo, pool)
            graphs.append((graph, static, out))
        order = random.Random(1234)
        failures, checked = [], 0
        for i in range(replays):
            k = order.randrange(len(graphs))
            graph, static, out = graphs[k]
            g = torch.Generator(device="cuda").manual_seed(100003 * rank + i)
            fresh = torch.randn(static.numel(), device="cuda", generator=g).to(static.dtype)
            static.copy_(fresh)
            graph.replay()
            checked += 1
            if not torch.equal(out, rank_order_sum(state, fresh)):
                failures.append(("graph", i, k))
            if order.random() < 0.5:  # an eager call of another algorithm and size in between
                algo = Algo(order.choice(ALL_ALGOS[:3]))
                y = torch.randn(order.choice((1024, 8192, 65536)), device="cuda", generator=g).to(torch.bfloat16)
                checked += 1
                if not torch.equal(ar.all_reduce(y.clone(), algo), rank_order_sum(state, y)):
                    failures.append(("eager", i, algo.value))
        torch.cuda.synchronize()
        del graphs
        return failures, checked


def custom_ar_pdl_bits(rank, world_size, init, sizes):
    """The same calls with programmatic dependent launch on and off give the same bits."""
    from dataclasses import replace

    from tpgraph.comm.custom_ar import CustomAllReduce
    from tpgraph.comm.thresholds import Algo

    state = init_distributed("cuda", rank, world_size, init)
    try:
        on = CustomAllReduce(state, replace(roomy_config(), pdl=True))
        off = CustomAllReduce(state, replace(roomy_config(), pdl=False))
        differ, checked = [], 0
        for name in ALL_ALGOS[:3]:
            for numel in sizes:
                g = torch.Generator(device="cuda").manual_seed(31 * rank + numel)
                x = torch.randn(numel, device="cuda", generator=g).to(torch.bfloat16)
                a, b = on.all_reduce(x.clone(), Algo(name)), off.all_reduce(x.clone(), Algo(name))
                checked += 1
                if not torch.equal(a, b):
                    differ.append((name, numel))
        torch.cuda.synchronize()
        on.close()
        off.close()
        return differ, checked
    finally:
        destroy_distributed(state)


def custom_ar_extra_push_call(rank, world_size, init, timeout_s, out_dir):
    """Rank 0 issues one extra 1shot_push call of another size. What each rank sees is written to out_dir."""
    import os
    import time
    from pathlib import Path

    from tpgraph.comm.custom_ar import CustomAllReduce, CustomAllReduceConfig
    from tpgraph.comm.thresholds import Algo
    from tpgraph.errors import CommError

    state = init_distributed("cuda", rank, world_size, init)
    ar = CustomAllReduce(state, CustomAllReduceConfig(timeout_s=timeout_s))
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")  # 8 KB
    ar.all_reduce(x, Algo.PUSH_1SHOT)
    torch.cuda.synchronize()
    gather_objects(state, None)
    events = []
    start = time.monotonic()
    try:
        if rank == 0:
            extra = torch.full((32768,), 5.0, dtype=torch.bfloat16, device="cuda")  # 64 KB, a call rank 1 never makes
            ar.all_reduce(extra, Algo.PUSH_1SHOT)
        y = torch.full((4096,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        out = ar.all_reduce(y, Algo.PUSH_1SHOT)
        torch.cuda.synchronize()
        events.append(("next call returned", out[:2].float().tolist()))
        z = ar.all_reduce(torch.ones(4096, dtype=torch.bfloat16, device="cuda"), Algo.PUSH_1SHOT)
        torch.cuda.synchronize()
        events.append(("call after returned", z[:2].float().tolist()))
    except (RuntimeError, CommError) as exc:
        err = ar.timeout_error()
        events.append(("error", str(err) if err else f"untranslated: {exc}", round(time.monotonic() - start, 1)))
        ar._watchdog.join(timeout=2.0)
    Path(out_dir, f"outcome{rank}").write_text(repr(events))
    os._exit(0)  # a trapped context cannot be torn down cleanly


def gemv_all_reduce(rank, world_size, init, cases, replays):
    """The all-reduce fused into a row-parallel projection's epilogue (kernels/lamport.py) on real GPUs, against the
    unfused sequence: this rank's partial sums (the same kernel and tiles), the rank-order sum, the add + RMSNorm
    kernel. The new residual and the materialized norm bit-equal and equal on every rank; gate_up on the staged input
    within bf16 rounding of gate_up on the normalised one. Eager calls one after another (the phases go round), then
    the same calls captured in one graph and replayed on new inputs."""
    from tpgraph.kernels.gemv import config_for, gate_up_silu, linear_all_reduce_norm, linear_small_m
    from tpgraph.kernels.norm import add_rms_norm

    eps = 1e-5
    with custom_ar_on_rank(rank, world_size, init) as (state, ar):
        failures, checked, worst = [], 0, 0.0

        def inputs(dtype, rows, hidden, k, seed):
            own = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
            common = torch.Generator(device="cuda").manual_seed(seed)
            x = torch.randn(rows, k, device="cuda", generator=own).to(dtype)
            w = (0.05 * torch.randn(hidden, k, device="cuda", generator=own)).to(dtype)
            residual = (4 * torch.randn(rows, hidden, device="cuda", generator=common)).to(dtype)
            nw = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=common)).to(dtype)
            wg = (0.02 * torch.randn(256, hidden, device="cuda", generator=own)).to(dtype)
            return x, w, residual, nw, wg

        def compare(tag, reduced, x, w, residual, nw, wg):
            nonlocal checked, worst
            # the fused projection's tiles (a table's "epilogue" entry where it has one), so the partials match
            tiles = config_for(x, w.shape[0], x.shape[1], x.shape[0], epilogue=True)
            s = rank_order_sum(state, linear_small_m(x, w, config=tiles))
            normed, new_res = add_rms_norm(s, residual, nw, eps)
            ref = gate_up_silu(normed, wg)
            got = gate_up_silu(reduced, wg)
            rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            worst = max(worst, rel)
            checked += 1
            ok = (torch.equal(reduced.residual_out, new_res) and torch.equal(reduced.materialize(), normed)
                  and same_on_every_rank(state, reduced.residual_out) and rel <= 2e-2)
            if not ok:
                failures.append((tag, torch.equal(reduced.residual_out, new_res), rel))

        dtype = torch.bfloat16
        for rows, hidden, k in cases:
            tag = (str(dtype), rows, hidden, k)
            declined = False
            for it in range(4):  # more calls than phases
                args = inputs(dtype, rows, hidden, k, 31 * it + rows)
                x, w, residual, nw, wg = args
                reduced = linear_all_reduce_norm(x, w, ar.channel, residual, nw, eps)
                if reduced is None:  # (every rank declines alike: same shapes)
                    failures.append((*tag, "declined"))
                    declined = True
                    break
                compare(("eager", it, *tag), reduced, *args)
            if not declined:
                static = [t.clone() for t in inputs(dtype, rows, hidden, k, rows)]
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                    g_reduced = linear_all_reduce_norm(*static[:2], ar.channel, *static[2:4], eps)
                torch.cuda.current_stream().wait_stream(stream)
                for it in range(replays):
                    fresh = inputs(dtype, rows, hidden, k, 7919 * (it + 1) + rows)
                    for dst, src in zip(static, fresh, strict=True):
                        dst.copy_(src)
                    graph.replay()
                    compare(("graph", it, *tag), g_reduced, *fresh)
                del graph
        torch.cuda.synchronize()
        return failures, checked, worst


def service_precompile(rank, world_size, init, prompt, params, engine_kw, wait_s):
    """The server's path for a structured request at TP=world_size: rank 0's reader compiles the grammar ahead
    (EngineService.precompile, which tells the other ranks to compile it too), then queues the request. Every rank
    records the threads its grammars were compiled on. Returns rank 0's text and every rank's compile threads."""
    import threading

    from tpgraph import TPEngine
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService

    with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init), device="cpu", **engine_kw) as engine:
        threads = []
        real = engine.core.grammars._compile

        def compile_(compiler, spec):
            threads.append(threading.current_thread().name)
            return real(compiler, spec)

        engine.core.grammars._compile = compile_
        if rank != 0:
            EngineService(engine.core, ControlPlane(engine.state)).run_worker()
            return {"threads": threads}
        service = EngineService(engine.core, ControlPlane(engine.state), heartbeat_s=0.05)
        service.start()
        text, done = [], threading.Event()

        def sink(update):
            text.append(update.text)
            if update.finish_reason is not None:
                done.set()

        service.precompile(params)  # (the reader thread's call: here the test's own thread)
        service.enqueue("r", engine.encode(prompt), params, sink)
        finished = done.wait(wait_s)
        service.shutdown()
        return {"threads": threads, "text": "".join(text), "finished": finished}


def engine_start_failing_on(rank, world_size, init, failing_rank, how, init_method=None):
    """TPEngine(tp_size=world_size) on every rank over gloo, `failing_rank` alone failing at its start: before it joins
    the process group ("config": a max_model_len past the model's; "device": a CUDA device asked for where none is).
    `init_method`: instead of the file rendezvous run_ranks gives. Returns (the error's type name, its message, the
    seconds this rank took to raise it), or None where the engine started."""
    import time

    from tpgraph import TPEngine

    kw = dict(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=32, block_size=4)
    if rank == failing_rank:
        kw.update({"config": {"max_model_len": 10**7}, "device": {"device": "cuda"}}[how])
    start = time.monotonic()
    try:
        with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init_method or init), **kw):
            return None
    except Exception as exc:  # the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start


def process_groups_in_a_kept_store(rank, world_size, init, port, rounds):
    """`rounds` process groups one after another, each joined through env:// in a store that outlives them (hosted by
    the test at `port`, as torchrun's agent hosts one for its workers), each checked with a gather; returns the rounds
    that gathered every rank."""
    import os

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "RANK": str(rank), "WORLD_SIZE": str(world_size)})
    whole = 0
    for _ in range(rounds):
        state = init_distributed("cpu")
        try:
            whole += gather_objects(state, rank) == list(range(world_size))
        finally:
            destroy_distributed(state)
    return whole


def engine_failing_after_joining_on(rank, world_size, init, failing_rank):
    """TPEngine(tp_size=world_size) on every rank over gloo, `failing_rank` alone failing once the process group has
    formed (sizing its KV cache, while the others wait for it in a collective). Returns (the error's type name, its
    message, the seconds this rank took to raise it), or None where the engine started."""
    import time

    from tpgraph import TPEngine
    from tpgraph.engine import runner
    from tpgraph.errors import ConfigError

    if rank == failing_rank:
        def refuse(self):
            raise ConfigError(f"rank {rank}'s KV cache cannot be sized")
        runner.ModelRunner._size_kv_cache = refuse
    start = time.monotonic()
    try:
        with TPEngine(tp_size=world_size, dist_init=(rank, world_size, init), device="cpu", max_num_seqs=4,
                      max_model_len=64, num_kv_blocks=32, block_size=4):
            return None
    except Exception as exc:  # the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start


def engine_start_failing_with_a_slow_store_on(rank, world_size, init, failing_rank, how, init_method, slow_rank):
    """engine_start_failing_on, `slow_rank`'s deletions of keys in the rendezvous's store taking 0.2 s each (a loaded
    host, a slow link)."""
    import time

    if rank == slow_rank:
        rendezvous = dist.rendezvous

        class SlowDeletes:
            def __init__(self, store):
                self._store = store

            def __getattr__(self, name):
                return getattr(self._store, name)

            def delete_key(self, key):
                time.sleep(0.2)
                return self._store.delete_key(key)

        def slow_rendezvous(*args, **kwargs):
            for store, r, w in rendezvous(*args, **kwargs):
                yield SlowDeletes(store), r, w

        dist.rendezvous = slow_rendezvous
    return engine_start_failing_on(rank, world_size, init, failing_rank, how, init_method)


def a_failed_start_retried_in_a_kept_store(rank, world_size, init, port, failing_rank, wait_s):
    """Two starts at most on every rank, joined through env:// in a store that outlives them (hosted by the test at
    `port`, as torchrun's agent hosts one): `failing_rank`'s first fails (a device nobody has) and it starts again at
    once; the others come `wait_s` later, and start again where theirs failed. Returns each start's outcome: its
    error's type name and message, or the ranks a gather over its process group collected."""
    import os
    import time

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "RANK": str(rank), "WORLD_SIZE": str(world_size)})
    if rank != failing_rank:
        time.sleep(wait_s)
    outcomes = []
    for device in ("tpu", "cpu") if rank == failing_rank else ("cpu", "cpu"):
        try:
            state = init_distributed(device, timeout_s=10.0)  # (short: a start that hangs fails the test soon)
        except Exception as exc:  # the test inspects it
            outcomes.append((type(exc).__name__, str(exc)))
            continue
        try:
            outcomes.append(gather_objects(state, rank))
        finally:
            destroy_distributed(state)
        break
    return outcomes
