"""Varlen FlashAttention prefill on the GPU: the probe accepts it for the model shapes we serve, it agrees with the
per-sequence SDPA loop within bf16/fp16 rounding (cached prefixes, GQA, padding), and the engine runs it."""

import pytest
import torch
from tpgtest.prefill_cases import prefill_case

from tpgraph import SamplingParams, TPEngine
from tpgraph.model import varlen_prefill as vp
from tpgraph.model.attention import sdpa_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")
CUDA = torch.device("cuda")
ENGINE = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=1024, gpu_memory_utilization=0.3)


@pytest.mark.parametrize("heads, dim", [((32, 8), 128), ((16, 4), 128), ((8, 8), 64), ((9, 3), 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_probe_accepts_served_shapes(heads, dim, dtype):
    assert vp.probe(sdpa_prefill, CUDA, dtype, *heads, dim) is None


@pytest.mark.parametrize("lens, contexts, padded", [
    ((300, 77, 1), (0, 512, 40), 13),
    ((1024,), (0,), 0),
    ((64, 64, 64, 64), (0, 16, 0, 1000), 0),
    ((5, 250), (2049, 3), 7),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_prefill_matches_sdpa(lens, contexts, padded, dtype):
    q, k, v, cache, meta = prefill_case(lens, contexts, heads=(32, 8), dim=128, padded=padded, device="cuda",
                                        dtype=dtype, block=16)
    want = sdpa_prefill(q, k, v, cache, meta, 128 ** -0.5).float()
    got = vp.varlen_prefill(q, k, v, cache, meta, 128 ** -0.5).float()
    err = (got - want).abs().max().item()
    assert err <= 1e-2 * want.abs().max().item(), err
    assert not got[sum(lens):].any()


def test_the_engine_runs_varlen_prefill_and_chunking_keeps_its_tokens():
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The quick brown fox", "tpgraph " * 60, "Hello, world! How are you today, my friend?"]
    with TPEngine(**ENGINE) as engine:
        assert engine.runner.prefill_attention == "varlen FlashAttention"
        whole = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    with TPEngine(**ENGINE, max_num_batched_tokens=64) as engine:  # the long prompt continues cached prefixes
        chunked = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert all(len(t) == 12 for t in whole)
    assert chunked == whole


def test_prefix_caching_keeps_tokens_on_the_gpu():
    """Prompts after one long system prompt: the second round reads it from the cache (varlen over gathered keys)
    and must give the tokens that computing everything gives."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    system = "You are a helpful assistant who answers in one short sentence. " * 6
    prompts = [system + tail for tail in ("What is 2 + 2?", "Name a colour.", "tpgraph " * 9)]
    with TPEngine(**ENGINE, enable_prefix_caching=False) as engine:
        plain = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    with TPEngine(**ENGINE) as engine:
        assert engine.runner.prefill_attention == "varlen FlashAttention"
        first = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        hits = engine.core.scheduler.prefix_hit_tokens
        again = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        assert engine.core.scheduler.prefix_hit_tokens - hits >= 3 * len(system) // 2  # a byte-level tokenizer
    assert first == plain and again == plain
