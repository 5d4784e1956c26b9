"""logit_bias (OpenAI's field): checked in SamplingParams, the request limits and the protocol, added to the logits
before penalties on every sampling path (greedy, the torch chain, the fused draw under TRITON_INTERPRET=1), and left
out of the reported log-probabilities."""

import math
import os
from collections import Counter

import pytest
import torch

from tpgraph.engine.limits import RequestLimits
from tpgraph.engine.sampler import Sampler, SampleRow, plain_greedy
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.errors import RequestError

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def row(**kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), [1, 2], [])


def test_a_mapping_or_pairs_become_pairs_in_id_order():
    assert SamplingParams(logit_bias={9: -1, 2: 0.5}).logit_bias == ((2, 0.5), (9, -1.0))
    assert SamplingParams(logit_bias=[[3, 100], (1, -100)]).logit_bias == ((1, -100.0), (3, 100.0))
    assert SamplingParams().logit_bias == () == SamplingParams(logit_bias={}).logit_bias == SamplingParams(
        logit_bias={4: 0.0, 5: -0.0}).logit_bias
    mapped, paired = SamplingParams(logit_bias={1: 2.0}), SamplingParams(logit_bias=[(1, 2)])
    assert mapped == paired and repr(mapped) == repr(paired)  # (the params are unhashable, as vLLM's)


@pytest.mark.parametrize(("bias", "needle"), [
    ({1: 100.5}, r"logit_bias\[1\] must be in \[-100.0, 100.0\]"),
    ({1: float("nan")}, "must be a finite number"),
    ({1: True}, "must be a finite number"),
    ({-1: 1.0}, "logit_bias token id must be >= 0"),
    ({True: 1.0}, "logit_bias token id must be an integer"),
    ({"7": 1.0}, "logit_bias token id must be an integer"),
    ([(1, 1.0), (1, 2.0)], "names token 1 twice"),
    ([(1, 2, 3)], "must map token ids to values"),
    ("7", "must be a mapping of token ids to values"),
    ({5: 10 ** 400}, r"logit_bias\[5\] must be in"),  # (math.isfinite overflowed on it: a 500 at the server)
    ({i: 1.0 for i in range(301)}, "logit_bias has 301 entries; at most 300 are allowed"),
])
def test_bad_bias_is_refused_with_the_reason(bias, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(logit_bias=bias)


def test_ids_past_the_vocabulary_are_refused_before_the_engine_takes_the_request():
    limits = RequestLimits(vocab_size=100, max_model_len=64, cache_tokens=1000)
    limits.check([1, 2], SamplingParams(logit_bias={99: 1.0}))
    with pytest.raises(RequestError, match=r"below the vocabulary size 100, got \[100, 500\]"):
        limits.check([1, 2], SamplingParams(logit_bias={5: 1.0, 100: 1.0, 500: -1.0}))


def test_greedy_rows_take_the_argmax_of_the_biased_logits_and_the_callers_logits_are_untouched():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    top = logits.argmax(-1).tolist()
    rows = [row(temperature=0.0, logit_bias={top[0]: -100.0}),  # banned in effect: the runner-up
            row(temperature=0.0, logit_bias={7: 100.0}),  # all but forced
            row(temperature=0.0),  # unbiased, in the same batch
            row(temperature=0.0, logit_bias={top[3]: -0.0})]
    assert not plain_greedy(rows[:2]) and plain_greedy(rows[2:])
    out = Sampler("cpu").sample(logits, rows)
    assert out.token_ids == [logits[0].topk(2).indices[1].item(), 7, top[2], top[3]]
    assert torch.equal(logits, before)


def test_bias_comes_before_the_repetition_penalty_as_in_vllm():
    """Token 0 (in the prompt) at 4.0 with repetition 2, against token 1's 0.5. Bias -2: (4 - 2) / 2 = 1 beats 0.5,
    where the other order, 4 / 2 - 2 = 0, would not. Bias -3.5: (4 - 3.5) / 2 = 0.25 loses, where no penalty at all
    would tie at 0.5 (the first wins a tie)."""
    logits = torch.tensor([[4.0, 0.5, -3.0]])

    def chosen(bias: float) -> int:
        params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: bias})
        return Sampler("cpu").sample(logits, [SampleRow(params, [0], [])]).token_ids[0]

    assert (chosen(-2.0), chosen(-3.5)) == (0, 1)


def test_log_probabilities_are_the_models_own_not_the_biased_ones():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(3))
    out = Sampler("cpu").sample(logits, [row(temperature=0.0, logprobs=2, logit_bias={5: 100.0})])
    raw = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [5] and out.logprobs[0] == pytest.approx(raw[5].item(), abs=1e-6)
    assert out.top_ids[0] == raw.topk(2).indices.tolist()


@pytest.mark.parametrize("fused", [False, True], ids=["torch_chain", "fused_draw"])
def test_a_sampled_row_draws_from_the_biased_distribution(fused):
    """p ∝ exp((logit + bias) / T): at T = 0.5, bias ln 9 on token 3 and -100 on token 0 (never drawn) give token 3
    0.05² · 81 of 0.3150 (a bias added after the temperature would give it 0.05² · 9 of 0.135: a sixth, not two
    thirds). Beside them, seeded unbiased rows draw what they draw alone. The fused draw runs kernels/sampling.py
    (under TRITON_INTERPRET=1 on CPU; it reads the fp32 logits a bias makes)."""
    if fused:
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU-tensor kernel tests need TRITON_INTERPRET=1")
        pytest.importorskip("triton")
    n = 300 if fused else 4000  # (the interpreter runs a program in about 20 ms)
    logits = PROBS.log().to(torch.bfloat16 if fused else torch.float32).expand(n, -1).clone()
    biased = [row(temperature=0.5, logit_bias={3: math.log(9.0), 0: -100.0}) for _ in range(n - 10)]
    seeded = [row(temperature=1.0, seed=seed) for seed in range(10)]
    out = Sampler("cpu", seed=0, fused=fused).sample(logits, [*biased, *seeded])
    alone = Sampler("cpu", seed=0, fused=fused).sample(logits[:10], seeded)
    assert out.token_ids[-10:] == alone.token_ids and len(set(alone.token_ids)) > 1
    counts = Counter(out.token_ids[:-10])
    assert counts[0] == 0
    weights = {1: 0.3 ** 2, 2: 0.15 ** 2, 3: 0.05 ** 2 * 81}
    for token, w in weights.items():
        p = w / sum(weights.values())
        sd = math.sqrt(p * (1 - p) / (n - 10))
        assert abs(counts[token] / (n - 10) - p) < 5 * sd, (token, counts)


def test_a_requests_bias_is_uploaded_once_not_every_step(monkeypatch):
    """A request's logit_bias (up to 300 entries) is uploaded to the device at its first step and kept: later steps
    upload a row index and a count per biased row. Every entry was listed and uploaded again each step, host work
    that outgrew the step itself at a few dozen such rows (6.6 ms a step for 64 rows of 300 entries, on CPU)."""
    import tpgraph.engine.sampler as sampler_module

    uploaded = []
    for name, parts in (("to_device", False), ("to_device_parts", True)):
        real = getattr(sampler_module, name)
        monkeypatch.setattr(sampler_module, name, lambda values, *a, real=real, parts=parts:
                            uploaded.append(sum(map(len, values)) if parts else len(values)) or real(values, *a))
    rows = [row(temperature=0.0, logit_bias={(7 * i + 3 * j) % 50: 1.0 + j for j in range(40)}) for i in range(4)]
    rows.append(row(temperature=0.0))  # (unbiased, in the same batch)
    sampler = Sampler("cpu")
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    first = sampler.sample(logits, rows)
    assert sum(uploaded) >= 4 * 40 * 2
    uploaded.clear()
    again = sampler.sample(logits, rows)
    assert sum(uploaded) <= 2 * 4  # (each biased row's index and count)
    assert again.token_ids == first.token_ids
    biased = logits.clone()
    for i, r in enumerate(rows):
        for t, b in r.params.logit_bias:
            biased[i, t] += b
    assert again.token_ids == biased.argmax(-1).tolist()
