"""The engine on one GPU with the built-in model: graph decode, piecewise and chunked prefill, GPU sampling."""

import pytest
import torch
from tpgtest.logprobs import own_logprobs, ranked

from tpgraph import ConfigError, SamplingParams, TPEngine
from tpgraph.graphs.calibration import eager_counts
from tpgraph.graphs.config import GraphConfig
from tpgraph.graphs.dispatcher import Dispatcher, GraphMode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
PROMPTS = ["The quick brown fox", "tpgraph " * 20, "a" * 300, "Hello, world! How are you today, my friend?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def tokens(engine, prompts=PROMPTS, params=GREEDY):
    return [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)]


def make(**kw):
    base = dict(device="cuda", max_num_seqs=8, max_model_len=512, dtype="float32", gpu_memory_utilization=0.3)
    return TPEngine(**{**base, **kw})


PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)


def entries(engine):
    """Each prompt's log-probabilities and top alternatives (a prompt that asks runs in full, cached or not)."""
    k = PROMPT_LOGPROBS.prompt_logprobs
    return [(own_logprobs(o.prompt_logprobs, o.prompt_token_ids), ranked(o.prompt_logprobs, k))
            for o in engine.generate(PROMPTS, PROMPT_LOGPROBS)]


def test_graphs_chunks_and_piecewise_prefill_agree_with_eager():
    """The tokens, and fp32 prompt log-probabilities (1e-4; each prompt token has one), from eager prefill,
    piecewise graphs, and 64-token chunks with the varlen or SDPA path the start-up probe picked."""
    with make(graphs=GraphConfig(decode_mode="none", prefill_mode="none")) as engine:
        eager, eager_entries = tokens(engine), entries(engine)
        assert [len(lps) for lps, _ in eager_entries] == [len(engine.encode(p)) for p in PROMPTS]
    # full decode graphs, piecewise prefill: every prompt padded to its graph, whatever timing would pick
    with make(graphs=GraphConfig(calibrate_prefill=False)) as engine:
        assert engine.runner.modes.decode == "full" and engine.runner.modes.prefill == "piecewise"
        assert tokens(engine) == eager
        assert not engine.runner.prefill_timings
        assert {row[1] for row in engine.runner.stats.frequency_table() if row[0] == "prefill"} == {"piecewise"}
        piecewise_entries = entries(engine)
    with make(max_num_batched_tokens=64) as engine:  # the 300-token prompt runs in chunks
        assert tokens(engine) == eager
        assert any(row[0] == "prefill" for row in engine.runner.stats.frequency_table())
        chunked_entries = entries(engine)
    for got in (piecewise_entries, chunked_entries):
        for (lps, tops), (want, want_tops) in zip(got, eager_entries, strict=True):
            assert lps[0] is None and lps[1:] == pytest.approx(want[1:], abs=1e-4)
            # (the top values, not their ids: two within fp32 noise of each other may trade places)
            assert [v for a in tops for _, v in a] == pytest.approx([v for a in want_tops for _, v in a], abs=1e-4)


def test_decode_batches_past_the_largest_captured_size_run_eagerly_with_the_same_tokens():
    """Capture sizes below max_num_seqs (vLLM takes them): batches 3 and 4 run with no graph, 1 and 2 from theirs."""
    with make(graphs=GraphConfig(decode_mode="none", prefill_mode="none")) as engine:
        eager = tokens(engine)
    with make(compilation_config={"cudagraph_capture_sizes": [1, 2]}) as engine:
        assert engine.runner.modes.decode == "full" and engine.runner.decode_eager_above == 2
        assert tokens(engine) == eager
        decode = {(row[1], row[2]) for row in engine.runner.stats.frequency_table() if row[0] == "decode"}
        assert ("none", 4) in decode and all(mode == "none" for mode, n in decode if n > 2), decode


def test_kv_cache_memory_bytes_sizes_the_gpu_cache_whatever_memory_is_free():
    """vLLM's kv_cache_memory_bytes on a GPU: the cache holds that many bytes' blocks (gpu_memory_utilization aside:
    here far below what 0.9 of the GPU would give) and serves the same tokens; one past the GPU's memory is refused
    naming the flag and the GiB it asked, before anything is served."""
    with make() as engine:
        want, block = tokens(engine), engine.runner.block_bytes
        sized_by_memory = engine.runner.num_kv_blocks
    with make(kv_cache_memory_bytes=300 * block + block // 3, gpu_memory_utilization=0.9) as engine:
        assert engine.runner.num_kv_blocks == 300 < sized_by_memory
        assert sum(t.numel() * t.element_size() for c in engine.runner.kv_caches for t in (c.k, c.v)) == 300 * block
        assert tokens(engine) == want
    total = torch.cuda.get_device_properties(0).total_memory
    # (the runner's refusals name the CLI's flags, as its other KV cache refusals do)
    with pytest.raises(ConfigError, match=r"--kv-cache-memory-bytes \d+ asks for [\d.]+ GiB of KV cache .* more "
                                          r"than the cuda has free: lower --kv-cache-memory-bytes"):
        make(kv_cache_memory_bytes=2 * total)


def test_prefill_timing_at_start_up_decides_which_counts_run_eagerly():
    # (no prefix cache: each run prefills the prompts whole)
    with make(graphs=GraphConfig(prefill_sizes=(16, 64, 256)), enable_prefix_caching=False) as engine:
        runner = engine.runner
        assert [t.size for t in runner.prefill_timings] == [16, 64, 256]
        assert all(0 < t.eager_s < 1 and 0 < t.graph_s < 1 for t in runner.prefill_timings)
        eager = set(eager_counts(runner.prefill_timings))
        assert set(runner.prefill_dispatcher.eager_counts) == eager
        for n in range(1, 257):
            assert (runner.prefill_dispatcher.dispatch(n, 1, False)[0] is GraphMode.NONE) == (n in eager), n
        assert "; timed: " in runner.summary()
        # every count eager, then none: the same tokens
        want = tokens(engine)
        runner.prefill_dispatcher = Dispatcher((), (16, 64, 256), range(1, 257))
        assert tokens(engine) == want
        runner.prefill_dispatcher = Dispatcher((), (16, 64, 256))
        assert tokens(engine) == want


def test_structured_outputs_on_the_gpu_match_and_leave_other_rows_alone():
    """xgrammar's mask on CUDA logits (its kernel), under graphs: constrained samples match and stop, and a free row
    in the same steps keeps the tokens it has alone."""
    pytest.importorskip("xgrammar")
    import json
    import re

    from tpgraph.engine.structured import StructuredOutput

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=30, structured=StructuredOutput.json_schema(schema)),
              SamplingParams(temperature=0.0, max_tokens=30, structured=StructuredOutput("regex", "[0-9]{4}")),
              GREEDY]
    with make() as engine:
        alone = tokens(engine, PROMPTS[2:3])
        out = engine.generate(PROMPTS[:3], params)
    assert isinstance(json.loads(out[0].outputs[0].text)["ok"], bool)
    assert re.fullmatch("[0-9]{4}", out[1].outputs[0].text) and out[1].outputs[0].finish_reason == "stop"
    assert [[c.token_ids for c in out[2].outputs]] == alone


def test_seeded_sampling_repeats_on_the_gpu():
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=3, n=2, max_tokens=16, logprobs=2)
    with make() as engine:
        a, b = tokens(engine, PROMPTS[:2], params), tokens(engine, PROMPTS[:2], params)
        out = engine.generate(PROMPTS[0], params)[0].outputs[0]
    assert a == b and len({tuple(x) for x in a[0]}) == 2
    assert len(out.logprobs) == 16 and all(len(e) in (2, 3) and t in e for e, t in
                                           zip(out.logprobs, out.token_ids, strict=True))
    for entry, t in zip(out.logprobs, out.token_ids, strict=True):  # the own rank counted on the device agrees
        top = sorted((v for i, v in entry.items() if v.rank <= 2), key=lambda v: v.rank)
        assert [v.rank for v in top] == [1, 2] and top[0].logprob >= top[1].logprob
        own = entry[t]
        assert own.rank >= 1 and (own.rank > 2) == (own.logprob < top[1].logprob)


@pytest.mark.parametrize("penalties", [True, False])
def test_overlapped_scheduling_changes_no_tokens_under_graphs(penalties):
    # a penalty row makes every step read the last one first: without it, nearly every step overlaps
    third = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3) if penalties else \
        SamplingParams(temperature=0.0, max_tokens=17, min_tokens=5)
    mixed = [GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=3, n=2, max_tokens=24, logprobs=1), third,
             SamplingParams(temperature=0.0, max_tokens=24, stop=["aaa"])]
    with make(overlap_scheduling=False) as engine:
        want = engine.generate(PROMPTS, mixed)
    with make() as engine:
        assert engine.core.overlap and engine.runner.modes.decode == "full"
        got = engine.generate(PROMPTS, mixed)
        assert not engine.core.has_work and engine.runner.allocator.num_free == engine.runner.allocator.num_blocks

    def summary(outs):
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]

    assert summary(got) == summary(want)
    for g, w in zip(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs, strict=True):
        assert list(g) == list(w) and [v.logprob for v in g.values()] == pytest.approx(
            [v.logprob for v in w.values()], rel=1e-4, abs=1e-4)


def test_the_activation_peak_covers_an_eager_forward_at_the_largest_prefill_graph():
    """A 64-token budget keeps the first prefill size that holds it, 2048: its capture's warm-ups and the start-up
    timing run 2048 tokens eagerly, so the activation peak the KV budget subtracts must cover them (it profiled a
    64-token forward before)."""
    # (warm-ups left on: without one, the KV estimate's first capture, at batch 1, launches Triton variants no eager
    # step ran (m == 1, NEWEST_APART off), and loading a kernel module inside a CUDA graph capture is refused)
    with make(max_num_batched_tokens=64, graphs=GraphConfig(prefill_sizes=(16, 2048))) as engine:
        runner = engine.runner
        assert runner.prefill_dispatcher.piecewise_sizes == (16, 2048)
        with torch.inference_mode():
            lens = runner._null_prefill(2048)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            runner._eager_prefill(2048, lens)
            torch.cuda.synchronize()
            forward = torch.cuda.max_memory_allocated() - base
        print(f"eager 2048-token forward {forward / 2**20:.1f} MiB, activation peak "
              f"{runner.budget.activation_peak / 2**20:.1f} MiB")
        assert runner.budget.activation_peak >= 0.95 * forward, (runner.budget.activation_peak, forward)


def test_the_kv_budget_leaves_room_for_sampling_at_the_largest_batch():
    """The activation peak the KV budget subtracts covers a step that samples at the largest batch with every option
    on, measured here apart from the runner: at a Llama-3 vocabulary (128256) the sampler's [rows, vocab] fp32
    temporaries are far larger than the small model's forward, so a profile without them falls short."""
    from dataclasses import replace

    from tpgraph.comm import TPCommunicator
    from tpgraph.config import BUILTIN_MODEL
    from tpgraph.distributed import destroy_distributed, init_distributed
    from tpgraph.engine.followers import free_tcp_init
    from tpgraph.engine.runner import ModelRunner, RunnerConfig
    from tpgraph.engine.sampler import Sampler, worst_case_rows
    from tpgraph.model.loader import load_model

    state = init_distributed("cuda", 0, 1, free_tcp_init())
    comm = TPCommunicator(state)
    try:
        model = load_model(state, comm, None, "dummy", torch.bfloat16, config=replace(BUILTIN_MODEL, vocab_size=128256))
        runner = ModelRunner(model, RunnerConfig(max_batch=64, max_model_len=512, gpu_memory_utilization=0.3))
        rows, vocab = runner.cfg.max_batch, model.cfg.vocab_size
        logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        # (with the runner's penalty table, which in_use holds already: rows x vocab x 5 bytes)
        assert runner.budget.penalty_table == runner.penalties.nbytes == rows * vocab * 5
        Sampler("cuda", penalties=runner.penalties).sample(logits, worst_case_rows(rows, vocab, runner.max_model_len))
        torch.cuda.synchronize()
        sampling = torch.cuda.max_memory_allocated() - base
        peak = runner.budget.activation_peak
        print(f"rows {rows}, vocab {vocab}: sampling took {sampling / 2**20:.1f} MiB, the budget's activation peak "
              f"{peak / 2**20:.1f} MiB")
        # (5%: the caching allocator's rounding moved one process's figure by 3 MiB of 440; a profile without the
        # sampling step measured 48 MiB against 443)
        assert peak >= 0.95 * sampling, (peak, sampling)
        runner.close()
    finally:
        comm.close()
        destroy_distributed(state)


def test_after_the_warm_up_serving_compiles_no_triton_kernel():
    """What a served burst meets after `warm_up` (new prompt lengths, eager prefill past the largest piecewise graph,
    chunked prompts, every kind of sampled row, alone and mixed, at row counts of each Triton class) compiles nothing:
    a compile there lands in a request's time to first token (session 39: three argmax variants; session 40: the
    rope kernel keyed on the token count)."""
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook")
    kinds = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.8, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.9, top_k=5, min_p=0.1, seed=4, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.6, top_k=40, repetition_penalty=1.2, frequency_penalty=0.3, logprobs=3,
                            max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.8, logit_bias={5: 1.5, 9: -100}, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.0, logit_bias={7: 2.0}, prompt_logprobs=2, max_tokens=3, ignore_eos=True)]
    vocab = 250
    with TPEngine(device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=2048,
                  gpu_memory_utilization=0.3) as engine:
        engine.warm_up()
        compiled: list[str] = []
        # (each compile's whole repr, its arguments' specialization included, kept for the failure message)
        knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(str(kw.get("repr", kw)))
        try:
            for lengths in ((1,), (7, 300), (301, 517, 5), (1000,), (1500, 3, 64, 33, 2), (2000,) + (9,) * 12):
                for i, params in enumerate(kinds):
                    prompts = [[(11 * n + 3 * j + i) % vocab + 3 for j in range(n)] for n in lengths]
                    engine.generate(prompts, params)
                engine.generate(prompts, [kinds[r % len(kinds)] for r in range(len(prompts))])  # mixed rows
        finally:
            knobs.runtime.jit_post_compile_hook = None
    # (the prefill counts start-up timing sent eagerly differ between runs: printed beside a failure's compiles)
    eager = engine.runner.prefill_dispatcher.eager_counts
    assert [c.split("[")[0] for c in compiled] == [], (compiled, f"eager prefill counts: {eager}")
