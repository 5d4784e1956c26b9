"""The sampling chain: masks, the draw, seeds, penalties and log-probabilities, against plain references."""

import math
from collections import Counter

import pytest
import torch

from tpgraph.engine.sampler import Sampler, SampleRow, row_cumsum, row_seed, top_k_mask, top_p_keep
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.errors import RequestError

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def rows(n, **kw):
    return [SampleRow(SamplingParams(**kw), [1, 2], []) for _ in range(n)]


def drawn(params_kw, n=4000, seed=0):
    out = Sampler("cpu", seed).sample(LOGITS.expand(n, -1).clone(), rows(n, **params_kw))
    return Counter(out.token_ids)


def test_greedy_is_argmax_and_banned_ids_are_skipped():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler("cpu").sample(logits, rows(5, temperature=0.0))
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs is None
    top = logits.argmax(-1).tolist()
    banned = [SampleRow(SamplingParams(temperature=0.0), [1], [], banned_ids=(t,)) for t in top]
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    before = logits.clone()
    assert Sampler("cpu").sample(logits, banned).token_ids == second
    assert torch.equal(logits, before)  # the caller's logits are untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_plain_greedy_rows_take_the_argmax_of_the_logits_as_given(dtype):
    """A batch of greedy rows without penalties, banned ids or logprobs skips the fp32 copy: the ids are still those of
    the fp32 logits (an exact cast for 16- and 32-bit floats), on a view with a padded row stride as the runner's
    decode logits are, with NaN, ties and a row of -inf only; the logits are left as they were."""
    g = torch.Generator().manual_seed(1)
    buf = torch.randn(8, 70, generator=g).to(dtype)
    logits = buf[:6, :64]  # rows 70 apart
    logits[1, [3, 40]] = 9.0  # a tie: the first
    logits[2, 17] = float("nan")
    logits[3] = float("-inf")
    before = buf.clone()
    out = Sampler("cpu").sample(logits, rows(6, temperature=0.0))
    assert out.token_ids == logits.float().argmax(-1).tolist() and out.token_ids[1:4] == [3, 17, 0]
    assert torch.equal(buf.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.0, logprobs=2), dict(temperature=0.7)],
                         ids=["plain_greedy", "greedy_logprobs", "sampled"])
def test_ids_out_receives_the_ids_the_host_reads(kw):
    """sample_async's ids_out (the runner's sampled_ids rows, which the next decode step reads): the step's ids land
    there, whichever path made them, PendingSample.ids is that tensor, and the rows past it are untouched."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    kept = torch.full((6,), -1, dtype=torch.int64)
    pending = Sampler("cpu", seed=2).sample_async(logits, rows(3, **kw), ids_out=kept[:3])
    out = pending.result()
    assert pending.ids.data_ptr() == kept.data_ptr() and kept[:3].tolist() == out.token_ids
    assert kept[3:].tolist() == [-1, -1, -1]
    assert out.token_ids == Sampler("cpu", seed=2).sample(logits, rows(3, **kw)).token_ids


def test_the_draw_follows_the_distribution():
    counts = drawn({})
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03, (token, counts)


def test_top_k_top_p_min_p_keep_the_right_tokens():
    assert set(drawn({"top_k": 1})) == {0}
    assert set(drawn({"top_k": 2})) == {0, 1}
    assert set(drawn({"top_p": 0.7})) == {0, 1}
    assert set(drawn({"top_p": 0.8})) == {0, 1}  # 0.5 + 0.3 reach 0.8: token 2 is not needed
    assert set(drawn({"top_p": 0.81})) == {0, 1, 2}
    assert set(drawn({"min_p": 0.2})) == {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert set(drawn({"min_p": 0.7})) == {0}
    # min-p first, then top-p of what it kept (vLLM's order): 0.8 of its 0.95 is past 0.84 (of all, 0.8 is not)
    assert set(drawn({"min_p": 0.2, "top_p": 0.84})) == {0, 1}
    assert set(drawn({"temperature": 1e-4})) == {0}


def test_a_temperature_below_vllms_floor_samples_at_the_floor():
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 (its _MAX_TEMP: smaller ones make inf or NaN
    in the scaled logits) before it reads temperature < 1e-5 as greedy: such a temperature samples, at 0.01, and only
    0 is greedy. Logits 0.01 apart then draw the second e^-1 / (1 + e^-1) of the time (27%), where at 1e-3 it was
    never drawn (e^-10)."""
    for t in (1e-40, 1e-6, 1e-3, 0.0099):
        p = SamplingParams(temperature=t)
        assert p.temperature == 0.01 and not p.greedy, t
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.02).temperature == 0.02
    p = SamplingParams()
    p.temperature = 1e-3  # (set later, as vLLM's scripts do: read as when made)
    assert p.temperature == 0.01
    logits = torch.tensor([0.0, -0.01]).expand(4000, -1).clone()
    share = Sampler("cpu").sample(logits, rows(4000, temperature=1e-3)).token_ids.count(1) / 4000
    assert abs(share - 1 / (1 + math.e)) < 0.03, share


def test_masks_per_row():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    masked = top_k_mask(x, [2, 0])
    assert torch.isinf(masked[0, 2:]).all() and not torch.isinf(masked[0, :2]).any()
    assert not torch.isinf(masked[1]).any()  # k 0: off
    kept = top_p_keep(PROBS.expand(2, -1).clone() * torch.tensor([[1.0], [3.0]]), [0.6, 1.0]) > 0  # any scale
    assert kept.tolist() == [[True, True, False, False], [True] * 4]


def test_top_p_keeps_the_smallest_prefix_reaching_p_in_exact_arithmetic():
    """Against float64 sums over each sorted row: the kept prefix is exact except where the mass reaches p within
    fp32's rounding of a softmax and a 3000-term sum (3e-5); ties at the last kept value stay."""
    g = torch.Generator().manual_seed(1)
    for width in (1, 5, 1023, 1024, 1025, 2049, 3000):
        x = torch.rand(3, width, generator=g)
        running = row_cumsum(x)
        torch.testing.assert_close(running, x.cumsum(-1), rtol=1e-5, atol=1e-4)
        assert (running[:, 1:] >= running[:, :-1]).all()  # never a step back, at chunk edges too
    ps = [0.1, 0.5, 0.9, 0.999]
    for _ in range(50):
        x = torch.randn(4, 3000, generator=g) * 3
        kept = (top_p_keep((x - x.amax(-1, keepdim=True)).exp(), ps) > 0).sum(-1).tolist()
        mass = torch.softmax(x.double().sort(dim=-1, descending=True).values, dim=-1).cumsum(-1)
        want = [int((mass[i] < p).sum()) + 1 for i, p in enumerate(ps)]
        near = [abs(float(mass[i, k - 1]) - p) < 3e-5 for i, (k, p) in enumerate(zip(want, ps, strict=True))]
        assert all(k == w or n for k, w, n in zip(kept, want, near, strict=True)), (kept, want)
    tail = torch.cat([torch.ones(1), torch.full((2047,), 3e-8)]).expand(2, -1).clone()
    kept = top_p_keep(tail, [1.0, 0.5])  # a row with p = 1 beside one without keeps every token
    assert torch.equal(kept[0], tail[0]) and int((kept[1] > 0).sum()) == 1
    tied = torch.tensor([[4.0, 2.0, 2.0, 1.0]])  # 0.6 of 9 needs the 4 and one 2: both 2s stay
    assert (top_p_keep(tied, [0.6]) > 0).tolist() == [[True, True, True, False]]
    assert (top_p_keep(tied, [0.4]) > 0).tolist() == [[True, False, False, False]]


def test_seeded_rows_do_not_depend_on_the_batch_or_the_shared_generator():
    seeded = SampleRow(SamplingParams(seed=7), [1], [3, 4])
    alone = Sampler("cpu", seed=0).sample(LOGITS.expand(1, -1).clone(), [seeded]).token_ids
    logits = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    logits[2] = LOGITS
    batch = [SampleRow(SamplingParams(), [1], []), SampleRow(SamplingParams(seed=3), [1], [])]
    batch += [seeded, SampleRow(SamplingParams(temperature=0.0), [1], [])]
    in_batch = Sampler("cpu", seed=99).sample(logits, batch).token_ids
    assert in_batch[2] == alone[0]
    # a seeded request's tokens repeat exactly; another seed or another position draws differently
    draws = [Sampler("cpu", seed=s).sample(LOGITS.expand(64, -1).clone(),
                                           [SampleRow(SamplingParams(seed=5), [1], [0] * i) for i in range(64)])
             for s in (0, 1)]
    assert draws[0].token_ids == draws[1].token_ids
    assert len(set(draws[0].token_ids)) > 1
    assert row_seed(5, 0, 1) != row_seed(5, 1, 1) != row_seed(5, 1, 2)
    assert row_seed(5, 1, 1) == row_seed(6, 0, 1)  # (sample i of seed s draws as sample 0 of s + i, as vLLM's)


def test_two_ranks_with_one_engine_seed_agree():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(2))
    batch = rows(16, temperature=0.8, top_p=0.9)
    a, b = Sampler("cpu", seed=123), Sampler("cpu", seed=123)
    for _ in range(3):
        assert a.sample(logits, batch).token_ids == b.sample(logits, batch).token_ids


def test_penalties_change_a_greedy_choice():
    x = torch.tensor([[0.0, 2.0, 1.9]])
    row = SampleRow(SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], [1])
    assert Sampler("cpu").sample(x, [row]).token_ids == [2]


def test_logprobs_are_the_models_log_softmax():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, generator=g)
    batch = [SampleRow(SamplingParams(temperature=0.0, logprobs=3), [1], []),
             SampleRow(SamplingParams(temperature=0.7, logprobs=0, seed=1), [1], []),
             SampleRow(SamplingParams(temperature=0.0), [1], [])]
    out = Sampler("cpu").sample(x, batch)
    ref = torch.log_softmax(x, dim=-1)
    for i, tok in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], ref[i, tok].item(), rel_tol=1e-6, abs_tol=1e-6)
    top = ref.topk(3, dim=-1)
    assert out.top_ids[0] == top.indices[0].tolist()
    assert out.top_logprobs[0] == pytest.approx(top.values[0].tolist(), abs=1e-6)
    assert out.token_ids[0] == out.top_ids[0][0]  # greedy picks the top one
    # each token's rank (vLLM's: the ids at least as likely, itself among them), from the logprobs before sampling
    assert out.ranks == [int((ref[i] >= ref[i, t]).sum()) for i, t in enumerate(out.token_ids)] and out.ranks[0] == 1


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "temperature must be in"),
    ("temperature", float("nan"), "temperature must be a finite number"),
    ("temperature", 2.5, r"temperature must be in \[0.0, 2.0\], got 2.5"),  # (vLLM's range, OpenAI's)
    ("top_p", 0.0, r"top_p must be in \(0.0"),
    ("top_p", 1.5, "top_p must be in"),
    ("top_k", -2, "top_k must be >= 0"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("min_p", 1.1, "min_p must be in"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in"),
    ("frequency_penalty", 3.0, "frequency_penalty must be in"),
    ("presence_penalty", -2.5, "presence_penalty must be in"),
    ("max_tokens", -1, "max_tokens must be >= 1"),
    ("max_tokens", 0, "max_tokens must be >= 1"),
    ("n", 0, r"n must be between 1 and 16384, got 0$"),
    ("logprobs", 21, "logprobs must be between 0 and 20"),
    ("seed", "x", "seed must be an integer"),
    ("stop", ("",), "stop must hold non-empty strings"),
    ("stop", tuple(f"s{i}" for i in range(101)), "stop holds 101 strings; at most 100"),
    ("stop_token_ids", (-1,), "stop_token_ids entry must be >= 0"),
    # (the bound named: 16 is the default max_tokens, which a request setting min_tokens alone never wrote)
    ("min_tokens", 20, r"min_tokens must be at most max_tokens \(16\), got 20"),
    ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
])
def test_bad_sampling_params_name_the_field(field, value, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**{field: value})


def test_greedy_takes_one_sample_as_vllms():
    """vLLM's SamplingParams refuses n > 1 at temperature 0 (greedy: every sample would be the same); a temperature in
    (0, 0.01), raised to 0.01, samples and may ask for more."""
    for temperature in (0, 0.0):
        with pytest.raises(RequestError, match=r"n must be 1 when sampling greedily \(temperature 0\), got n=3"):
            SamplingParams(n=3, temperature=temperature)
    assert SamplingParams(n=1, temperature=0).greedy and SamplingParams(n=3, temperature=1e-6).n == 3


def test_sampling_params_normalise():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=[5])
    assert p.stop == ("###",) and p.top_k == 0 and p.stop_token_ids == (5,)
    assert SamplingParams(temperature=0).greedy and SamplingParams(presence_penalty=0.1).has_penalties


def test_numpy_numbers_are_the_numbers_they_are():
    """A seed or a limit drawn with numpy (rng.integers gives np.int64) was refused as "must be an integer, got
    np.int64(7)", which it is; vLLM's SamplingParams takes them. Kept as Python's int and float, so the params read
    (and repr, the SPMD check's digest) as if given so."""
    np = pytest.importorskip("numpy")
    p = SamplingParams(n=np.int32(2), seed=np.int64(7), max_tokens=np.int64(8), min_tokens=np.int16(1),
                       top_k=np.int64(5), temperature=np.float32(0.5), top_p=np.float64(0.9), logprobs=np.int8(2),
                       stop_token_ids=[np.int64(3)], allowed_token_ids=[np.int64(4)],
                       logit_bias={np.int64(6): np.float32(2)}, truncate_prompt_tokens=np.int64(10))
    plain = SamplingParams(n=2, seed=7, max_tokens=8, min_tokens=1, top_k=5, temperature=0.5, top_p=0.9, logprobs=2,
                           stop_token_ids=[3], allowed_token_ids=[4], logit_bias={6: 2.0}, truncate_prompt_tokens=10)
    assert p == plain and repr(p) == repr(plain)
    assert type(p.seed) is int and type(p.temperature) is float and type(p.stop_token_ids[0]) is int
    with pytest.raises(RequestError, match="max_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=np.int64(0))  # (checked as the int it is)
    assert SamplingParams(truncate_prompt_tokens=np.int64(-1)).truncate_prompt_tokens == -1  # (vLLM's "to fit")
    # numpy's booleans too (a flag taken from an array of settings), read as Python's; other truthy values refused
    flags = SamplingParams(ignore_eos=np.True_, detokenize=np.bool_(True), skip_special_tokens=np.False_)
    assert (flags.ignore_eos, flags.detokenize, flags.skip_special_tokens) == (True, True, False)
    assert type(flags.ignore_eos) is bool and repr(flags) == repr(SamplingParams(ignore_eos=True,
                                                                                 skip_special_tokens=False))
    with pytest.raises(RequestError, match=r"ignore_eos must be true or false, got np.int64\(1\)"):
        SamplingParams(ignore_eos=np.int64(1))


def test_none_is_vllms_default_for_the_list_fields():
    """vLLM's SamplingParams defaults stop, stop_token_ids, logit_bias and bad_words to None; passing None (as code
    written for vLLM does) was refused as not a list."""
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None, bad_words=None)
    assert p.stop == p.stop_token_ids == p.logit_bias == p.bad_words == ()


def test_repeated_stop_token_ids_and_bad_words_are_kept_once_as_vllms():
    """vLLM's SamplingParams keeps each stop_token_ids entry and bad word once (dict.fromkeys). Repeats were kept: a
    request listing one stop id 200,000 times had every step look its tokens up in all of them (and, below
    min_tokens, build a set of them), and 101 copies of one bad word were refused as more than 100 words."""
    p = SamplingParams(stop_token_ids=[7] * 200_000 + [3, 7], bad_words=["x"] * 150 + ["y", "x"])
    assert p.stop_token_ids == (7, 3) and p.bad_words == ("x", "y")


def test_an_ids_out_that_does_not_fit_is_refused():
    logits = torch.randn(3, 50)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="ids_out must be"):
            Sampler("cpu").sample_async(logits, rows(3, temperature=0.7), ids_out=bad)


def test_the_memory_profiles_sampling_rows_take_every_stage(monkeypatch):
    """worst_case_rows: what the runner samples while it measures its activation peak for the KV budget. Every stage
    that makes [rows, vocab] temporaries must run for them (penalties, top-k, top-p, min-p, a banned id, the most
    log-probabilities), or the budget would leave no room for a batch that asks for them."""
    import tpgraph.engine.sampler as sampler_module
    from tpgraph.engine.penalties import FILL_TOKENS, PenaltyTable
    from tpgraph.engine.sampler import worst_case_rows
    from tpgraph.engine.sampling_params import MAX_LOGPROBS

    ran = []

    def recorded(fn):
        def wrapper(*args, **kwargs):
            ran.append(fn.__name__)
            return fn(*args, **kwargs)
        return wrapper

    for name in ("penalize", "top_k_mask", "top_p_keep"):
        monkeypatch.setattr(sampler_module, name, recorded(getattr(sampler_module, name)))
    rows = worst_case_rows(3, 100, 300)
    assert len(rows) == 3 and all(r.banned_ids and r.params.min_p > 0 and not r.params.greedy for r in rows)
    # each history as long as a sequence may be, and together within one upload to the penalty table
    assert all(len(r.prompt_ids) + len(r.output_ids) == 300 for r in rows)
    long = worst_case_rows(64, 100, 1 << 20)
    assert FILL_TOKENS - 64 <= sum(len(r.prompt_ids) + len(r.output_ids) for r in long) <= FILL_TOKENS
    assert all(0 <= t < 100 for r in rows for t in (*r.prompt_ids, *r.output_ids))
    assert worst_case_rows(1, 7, 16)[0].params.logprobs == 7  # no more alternatives than the vocabulary has
    table = PenaltyTable(3, 100, "cpu")
    out = Sampler("cpu", penalties=table).sample(torch.randn(3, 100, generator=torch.Generator().manual_seed(0)), rows)
    assert ran == ["penalize", "top_k_mask", "top_p_keep"] and table.fills == 3
    assert len(out.token_ids) == 3 and all(len(t) == MAX_LOGPROBS for t in out.top_ids)
    assert not set(out.token_ids) & set(rows[0].banned_ids)


def test_a_nan_logit_is_never_drawn_and_leaves_the_rest_of_the_distribution():
    """As the fused draw (kernels/sampling.py's edge rows) and top_k_floor read it: a NaN logit is out, and the row
    draws from its other logits. The torch chain's weights were all NaN with one (its maximum is NaN), so every draw
    of such a row took id 0, whatever the row held; top-k, top-p and min-p alike."""
    x = torch.cat([torch.tensor([float("nan")]), LOGITS]).expand(2000, -1).clone()  # the NaN at id 0
    for kw in ({}, {"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.05}):
        counts = Counter(Sampler("cpu", 3).sample(x, rows(2000, **kw)).token_ids)
        assert 0 not in counts and set(counts) >= {1, 2}, (kw, counts)
    counts = Counter(Sampler("cpu", 3).sample(x, rows(2000)).token_ids)
    for token, p in enumerate(PROBS.tolist(), start=1):
        assert abs(counts[token] / 2000 - p) < 0.04, counts


def test_any_finite_repetition_penalty_above_zero_is_taken_as_vllms():
    """vLLM's _verify_args asks only that repetition_penalty be finite and above 0; one above 100 was refused here."""
    assert SamplingParams(repetition_penalty=150.0).repetition_penalty == 150.0
    assert SamplingParams(repetition_penalty=10 ** 6).has_penalties
    for bad in (float("inf"), float("nan")):
        with pytest.raises(RequestError, match="repetition_penalty must be a finite number"):
            SamplingParams(repetition_penalty=bad)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_log_probabilities_than_the_vocabulary_holds_are_refused_naming_the_field(field):
    """A model of 12 tokens asked for 15 alternatives a token: the step's top-k over the vocabulary raised 'selected
    index k out of range' and failed every request of the batch; the request is refused before it runs."""
    from tpgraph.engine.limits import RequestLimits

    limits = RequestLimits(vocab_size=12, max_model_len=64, cache_tokens=1000)
    limits.check([1, 2], SamplingParams(**{field: 12}))  # (all of it is taken)
    with pytest.raises(RequestError, match=rf"{field} .*15 log-probabilities.*vocabulary of 12 tokens"):
        limits.check([1, 2], SamplingParams(**{field: 15}))


def test_an_unsigned_64_bit_seed_is_taken_as_vllms_generator_takes_it():
    """vLLM seeds a request's torch.Generator with its seed, which takes any 64-bit value, unsigned too (a script's
    random.getrandbits(64)); 2 ** 63 and above were refused here. Such a seed draws as any other: the same tokens each
    time, whatever else is in the batch."""
    seed = 2 ** 64 - 5
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=seed)
    row = SampleRow(params, [1], [])
    alone = [Sampler("cpu", seed=s).sample(logits[:1], [row]).token_ids[0] for s in range(2)]
    beside = Sampler("cpu", seed=9).sample(logits[[1, 2, 3, 0]], [*rows(3, temperature=1.0), row]).token_ids[3]
    assert alone == [beside] * 2
    with pytest.raises(RequestError, match="seed must be between"):
        SamplingParams(seed=2 ** 64)


def processed_distribution(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
                           ) -> torch.Tensor:
    """The plain reference of what a row draws from, in float64: bias, repetition (prompt and output tokens), frequency
    and presence (output tokens), temperature, min-p of the largest, top-k, then top-p over what those kept (vLLM's
    order)."""
    x = logits.double().clone()
    for t, b in params.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= params.frequency_penalty * count + params.presence_penalty
    p = torch.softmax(x / params.temperature, dim=-1)
    order = p.argsort(descending=True)
    if params.min_p:
        p = p * (p >= params.min_p * p.max())
        p = p / p.sum()
    if params.top_k:
        p = p * (p >= p[order[params.top_k - 1]])
        p = p / p.sum()
    if params.top_p < 1.0:
        kept = int((p[order].cumsum(0) < params.top_p).sum()) + 1
        p = p * (p >= p[order[kept - 1]])
    return p / p.sum()


def test_a_mixed_batchs_draws_follow_each_rows_processed_distribution():
    """Rows of different parameters in one batch (penalized or not, seeded or not) each draw from their own processed
    distribution: a chi-square of 8000 draws of each kind against the reference, nothing drawn outside its support."""
    logits = torch.randn(8, generator=torch.Generator().manual_seed(4)) * 2
    prompt, output = [1, 2, 3], [3, 4, 4]
    kinds = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
             SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.3, seed=3),
             SamplingParams(logit_bias={0: 2.0, 5: -1.0}, top_p=0.9, repetition_penalty=0.8),
             SamplingParams(temperature=0.9, min_p=0.09, top_p=0.85, seed=8)]  # (min-p first: one token)
    n = 8000
    # (the seeded rows as samples 0 to n - 1 of their request: each draws from its own seed's numbers)
    batch = [SampleRow(p, prompt, output, sample_index=i) for i in range(n) for p in kinds]
    ids = torch.tensor(Sampler("cpu", 5).sample(logits.expand(len(batch), -1).clone(), batch).token_ids)
    for k, params in enumerate(kinds):
        seen = torch.bincount(ids[k::len(kinds)], minlength=8).double()
        expected = processed_distribution(logits, params, prompt, output) * n
        assert seen[expected == 0].sum() == 0, (params, seen, expected)
        chi2 = float(((seen - expected) ** 2 / expected)[expected > 0].sum())
        assert chi2 < 30, (params, chi2, seen, expected)  # (7 degrees of freedom at most: 30 is p < 1e-4)
