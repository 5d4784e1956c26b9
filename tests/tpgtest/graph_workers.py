"""Rank functions for the CUDA-graph decode GPU tests (importable by spawned processes)."""

from __future__ import annotations

from pathlib import Path

import torch

from tpgraph.comm import TPCommunicator
from tpgraph.distributed import destroy_distributed, init_distributed
from tpgraph.engine.argmax import row_argmax
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.engine.sequence import Sequence
from tpgraph.errors import CaptureError
from tpgraph.graphs.config import GraphConfig
from tpgraph.model.loader import load_model

WELL_CONDITIONED = dict(  # Llama-3 layout (GQA, head_dim 128), 4 layers, small vocab
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=1024, rope_theta=500000.0),
)


def make_well_conditioned_checkpoint(path: Path, seed: int = 0, embed_std: float = 4.0) -> Path:
    """Large embeddings that dominate the residual stream and an untied head whose rows are a permutation of them:
    each step's top logit stands far above bf16 rounding, so greedy tokens are a fair test (as bench/hf_parity.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(initializer_range=0.02, dtype="bfloat16", **WELL_CONDITIONED))
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, embed_std)
        model.lm_head.weight.copy_(emb[torch.randperm(emb.shape[0])] / embed_std * 0.02)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def prompts_for(batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (batch,), generator=g).tolist()
    return [torch.randint(1, 32000, (n,), generator=g).tolist() for n in lens]


def greedy_collect(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Greedy decode for exactly `steps` tokens (no EOS); every step's logits kept on the GPU (fp32)."""
    seqs = [Sequence(i, list(p), steps) for i, p in enumerate(prompts)]
    logits = runner.prefill(seqs)
    kept = []
    try:
        for step in range(steps):
            kept.append(logits.float().clone())
            for seq, tok in zip(seqs, logits.argmax(-1).tolist(), strict=True):
                seq.output_ids.append(tok)
            if step + 1 < steps:
                logits = runner.decode(seqs)
                if runner.greedy_in_step:  # the ids the step made itself (at TP > 1 from the ranks' shard maxima)
                    made = runner.sampled_rows(len(seqs))
                    assert torch.equal(made, row_argmax(logits)), f"step {step}: {made.tolist()}"
    finally:
        for seq in seqs:
            runner.free(seq)
    return [s.output_ids for s in seqs], torch.stack(kept)


def graph_modes_match_eager(rank, world_size, init, ckpt, batch_sizes, steps):
    """Eager (none) is the reference; full, piecewise and breakable must give its greedy tokens, logits within 1e-2."""
    state = init_distributed("cuda", rank, world_size, init)
    try:
        model = load_model(state, TPCommunicator(state), ckpt, dtype=torch.bfloat16)
        max_len = 40 + steps + 16
        blocks = max(batch_sizes) * -(-max_len // 16) + 8
        ref: dict[int, tuple] = {}
        report = []
        for mode in ("none", "full", "piecewise", "breakable"):
            # (no prefill calibration: its timings may send a prefill count eagerly, and this checks each mode's path)
            graphs = GraphConfig(decode_mode=mode, ladder="sglang", enforce_eager=mode == "none",
                                 calibrate_prefill=False)
            runner = ModelRunner(model, RunnerConfig(max_batch=max(batch_sizes), max_model_len=max_len,
                                                     num_kv_blocks=blocks, graphs=graphs))
            for bs in batch_sizes:
                tokens, logits = greedy_collect(runner, prompts_for(bs, bs), steps)
                if mode == "none":
                    ref[bs] = (tokens, logits)
                    continue
                ref_tokens, ref_logits = ref[bs]
                rel = ((logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)).max().item()
                first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), None)
                report.append((mode, bs, tokens == ref_tokens, rel, first))
            modes_seen = sorted({m for _, m, *_ in runner.stats.frequency_table()})
            report.append((mode, "modes", modes_seen))
            runner.close()
            torch.cuda.empty_cache()
        return report
    finally:
        destroy_distributed(state)


def graph_guards(rank, world_size, init, ckpt):
    """A rebound input is caught by the address check; capture after the capture phase raises."""
    state = init_distributed("cuda", rank, world_size, init)
    try:
        comm = TPCommunicator(state)
        model = load_model(state, comm, ckpt, dtype=torch.bfloat16)
        graphs = GraphConfig(decode_mode="full", ladder=(1, 2, 4, 8), check_addresses=True)
        runner = ModelRunner(model, RunnerConfig(max_batch=8, max_model_len=128, num_kv_blocks=80, graphs=graphs))
        out = {}
        seqs = [Sequence(i, [5 + i, 6, 7], 4) for i in range(3)]
        runner.prefill(seqs)
        for seq in seqs:
            seq.output_ids.append(11)
        out["first_decode_ok"] = runner.decode(seqs).shape == (3, 32000)
        for seq in seqs:
            seq.output_ids.append(12)
        torch.cuda.set_sync_debug_mode("error")  # any host synchronization inside the step raises
        try:
            runner.decode(seqs)
            out["step_syncs"] = None
        except RuntimeError as exc:
            out["step_syncs"] = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        buf = runner.decode_in._buffers["input_ids"]
        buf.device = torch.zeros_like(buf.device)  # deliberately rebound: the captured graph still reads the old one
        try:
            runner.decode(seqs)
            out["rebound"] = "no error"
        except CaptureError as exc:
            out["rebound"] = str(exc)
        for what, attempt in (("graphs", lambda: runner.graphs.capture("decode", "full", (1,), None, None, None)),
                              ("comm", lambda: comm.capture().__enter__())):
            try:
                attempt()
                out[what] = "no error"
            except CaptureError as exc:
                out[what] = str(exc)
        runner.close()  # graphs holding NCCL work must go before the process group does
        return out
    finally:
        destroy_distributed(state)


def graph_memory(rank, world_size, init, ckpt, cycles):
    """Memory honesty and lifecycle:
    - the pool estimate against the pool really taken, and the KV budget with graphs against without;
    - `cycles` x (capture 8 zero-copy 1shot_pull calls on fresh 1 MB buffers, replay, drop, release, empty_cache):
      open IPC mappings, pointer-table rows and free device memory must end where they started;
    - the engine's own re-capture, 10 times, likewise."""
    from tpgraph._ext import load_ext
    from tpgraph.comm.thresholds import Algo

    state = init_distributed("cuda", rank, world_size, init)
    ext = load_ext()
    try:
        comm = TPCommunicator(state)
        model = load_model(state, comm, ckpt, dtype=torch.bfloat16)
        out = {}
        for mode in ("full", "none"):
            graphs = GraphConfig(decode_mode=mode, ladder="vllm", enforce_eager=mode == "none")
            runner = ModelRunner(model, RunnerConfig(max_batch=256, max_model_len=1024, gpu_memory_utilization=0.5,
                                                     graphs=graphs))
            b = runner.budget
            per_size = runner.graphs.sets["decode"].capture_bytes if "decode" in runner.graphs.sets else {}
            out[mode] = {"estimate": b.graph_pool_estimate, "actual": runner.capture_bytes, "blocks": b.num_blocks,
                         "per_size": dict(sorted(per_size.items(), reverse=True)), "trial": runner.trial_capture_bytes,
                         "block_bytes": b.block_bytes, "in_use": b.in_use, "activation": b.activation_peak,
                         "kv_bytes": b.kv_bytes, "describe": b.describe()}
            runner.close()
            del runner
            torch.cuda.empty_cache()

        ar = comm.custom
        torch.cuda.synchronize()
        side = torch.cuda.Stream()

        def one_cycle(i):
            xs = [torch.full((1 << 19,), float(rank + 1 + k), dtype=torch.bfloat16, device="cuda") for k in range(8)]
            side.wait_stream(torch.cuda.current_stream())
            with ar.capture() as registration:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(side):
                    graph.capture_begin()
                    ys = [ar.all_reduce(x, Algo.PULL_1SHOT) for x in xs]
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            graph.replay()
            ok = all(torch.all(y == float(3 + 2 * k)).item() for k, y in enumerate(ys))
            del graph, ys, xs
            ar.release_registration(registration)
            torch.distributed.barrier(group=state.cpu_group)  # the peer closed its mappings of our buffers too
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return ok

        def sample() -> tuple[int, int, int]:
            # every rank settled before any reads the device's free memory, and none moves on until all have read
            # it: ranks that share a GPU (TPGRAPH_SHARED_GPU) read each other's memory in it
            torch.distributed.barrier(group=state.cpu_group)
            taken = (ext.ipc_open_count(), ar.rows_in_use, torch.cuda.mem_get_info()[0])
            torch.distributed.barrier(group=state.cpu_group)
            return taken

        samples, ok = [], True
        for i in range(cycles):
            ok &= one_cycle(i)
            if i in (4, cycles - 1):
                samples.append(sample())
        out["raw"] = {"ok": ok, "samples": samples}

        graphs = GraphConfig(decode_mode="full", ladder=(1, 2, 4, 8))
        runner = ModelRunner(model, RunnerConfig(max_batch=8, max_model_len=128, num_kv_blocks=80, graphs=graphs))
        samples = []
        for i in range(10):
            runner.capture_all()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if i in (1, 9):
                samples.append(sample())
        out["engine"] = samples
        runner.close()
        return out
    finally:
        destroy_distributed(state)
