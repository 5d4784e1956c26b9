"""Checkpoints with biased projections (Qwen2's q, k and v; a Llama's attention_bias and mlp_bias), and Qwen3's (its
q and k heads normed), on the GPU, against
transformers on the same weights: full decode graphs, where the fused qkv + rope kernel adds q, k and v's biases and
the fused kernels without a bias (gate_up + SiLU·mul, the projection with the residual add in its epilogue) give way
to the projection and a bias add."""

import pytest
import torch
from tpgtest.hf_fixtures import PROMPTS, hf_greedy_reference, make_checkpoint

from tpgraph import SamplingParams, TPEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
STEPS = 16


@pytest.mark.parametrize("case", ["llama_biases_kv1", "qwen2_tied_gqa", "qwen3_kv2_headdim"])
def test_a_biased_checkpoint_decodes_under_graphs_as_transformers_does(tmp_path, case):
    path = make_checkpoint(case, tmp_path / "c")
    hf_tokens, hf_logits = hf_greedy_reference(path, PROMPTS, STEPS)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    with TPEngine(path, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128,
                  gpu_memory_utilization=0.2) as engine:
        assert engine.runner.modes.decode == "full"
        outs = engine.generate(PROMPTS, params)
    for out, want, logits in zip(outs, hf_tokens, hf_logits, strict=True):
        got = list(out.outputs[0].token_ids)
        assert got == want
        # each chosen token's log-probability, against transformers' at that position
        hf_lp = logits.log_softmax(-1)
        for step, (token, entry) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
            assert entry[token].logprob == pytest.approx(hf_lp[step, token].item(), abs=2e-3)
