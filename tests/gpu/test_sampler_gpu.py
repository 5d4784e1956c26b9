"""Sampling on CUDA queues its work without waiting for the GPU: the overlapped loop schedules the next step while
the last one's forward and sampling run, and one synchronous copy (a tensor made from a list on the device) would
make the host wait for both."""

import pytest
import torch

from tpgraph.engine.penalties import PenaltyTable
from tpgraph.engine.sampler import Sampler, SampleRow, packed_rows
from tpgraph.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

EVERY_OPTION = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                              frequency_penalty=0.3, presence_penalty=0.2, logprobs=2, seed=4,
                              logit_bias={11: 2.0, 3: -1.0}, allowed_token_ids=tuple(range(0, 32000, 3)))


def test_sampling_every_option_never_waits_for_the_gpu():
    vocab = 32000
    table = PenaltyTable(4, vocab, "cuda")
    sampler = Sampler("cuda", penalties=table)
    rows = [SampleRow(EVERY_OPTION, [1, 2, 3], [], sample_index=i, seq_id=i) for i in range(3)]
    rows.append(SampleRow(SamplingParams(temperature=0.0), [5], [], banned_ids=(7,), seq_id=3))
    logits = torch.randn(4, vocab, device="cuda")
    sampler.sample(logits, rows)  # first use: rows filled from the host, allocator and kernels warm
    torch.cuda.synchronize()
    # the next step on the slots held (its last tokens pending), and a newcomer's slot filled from its ids
    later = [SampleRow(r.params, r.prompt_ids, [-1], r.sample_index, r.banned_ids, r.seq_id) for r in rows]
    newcomer = [*later[1:], SampleRow(EVERY_OPTION, [4, 5, 6], [7, 7, 8], seq_id=10)]
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the sampling
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises, naming itself
    try:
        pending = [sampler.sample_async(logits, later), sampler.sample_async(logits, newcomer)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    still_busy = not torch.cuda.current_stream().query()
    out = [p.result() for p in pending]
    assert still_busy, "sample_async waited for the GPU"
    assert [len(o.token_ids) for o in out] == [4, 4] and table.fills == 4  # held slots took no host ids
    # the penalized rows' ids of three steps, counted on the device, and the newcomer's three output ids
    assert int(table.counts.sum()) == 3 + 3 + 3 + 3


def test_constrained_rows_are_masked_without_waiting_for_the_gpu():
    """A grammar's masks and the rows they are for reach the GPU from pinned memory, queued: from pageable memory
    (xgrammar's own bitmask, a list of rows) each copy waited for the stream's queued work, the step's forward."""
    pytest.importorskip("xgrammar")
    from tpgraph.engine.structured import GrammarCompiler, GrammarState, StructuredOutput
    from tpgraph.tokenizer import builtin_tokenizer

    tokenizer, vocab = builtin_tokenizer(), 258
    grammars = GrammarCompiler(tokenizer, vocab, (257,))
    spec = StructuredOutput("regex", "[a-c]+")

    def rows() -> list[SampleRow]:
        return [SampleRow(SamplingParams(temperature=0.0), [1], [], seq_id=0,
                          grammar=GrammarState(grammars.matcher(spec))),
                SampleRow(SamplingParams(temperature=0.0), [2], [], seq_id=1),
                SampleRow(SamplingParams(temperature=0.8, seed=1), [3], [], seq_id=2,
                          grammar=GrammarState(grammars.matcher(spec)))]

    sampler = Sampler("cuda")
    logits = torch.randn(3, vocab, device="cuda")
    sampler.sample(logits, rows())  # first use: the mask kernel compiled, the allocators warm
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the sampling
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.sample_async(logits, rows())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    still_busy = not torch.cuda.current_stream().query()
    out = pending.result()
    assert still_busy, "the masks' copy waited for the GPU"
    assert tokenizer.decode([out.token_ids[0]]) in "abc" and tokenizer.decode([out.token_ids[2]]) in "abc"


def test_packed_rows_count_ranks_on_the_device_as_on_the_host():
    """Each sampled id's rank (the ids at least as likely, itself among them; vLLM's) and the top k, counted on the
    GPU, as a float64 reference counts them on the CPU: ties included (a row of equal values ranks every id last)."""
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.randn(6, 32003, generator=gen).log_softmax(-1)
    logprobs[5] = -10.0  # every id tied
    ids = torch.tensor([int(logprobs[0].argmax()), 7, 31999, int(logprobs[3].argmin()), 123, 4])
    got = packed_rows(logprobs.cuda(), ids.cuda(), 3).cpu()
    want = [int((row >= row[t]).sum()) for row, t in zip(logprobs.double(), ids.tolist(), strict=True)]
    assert got[:, -1].long().tolist() == want and want[0] == 1 and want[3] == 32003 and want[5] == 32003
    assert got[:, 0].long().tolist() == ids.tolist()
    # the top ids of the untied rows (the tied row's may come in any order on either device)
    assert torch.equal(got[:5, 2:5].long(), logprobs[:5].topk(3, dim=-1).indices)
    assert torch.allclose(got[:, 1], logprobs.gather(1, ids.unsqueeze(1)).double().squeeze(1))


def _kept_probabilities(row: torch.Tensor, temperature: float, top_p: float, min_p: float) -> torch.Tensor:
    """The kept distribution in float64: a token stays when its weight is at least min_p of the largest and the
    weight strictly above it is below p of what min-p keeps (vLLM's order: top-p's smallest set of the largest
    reaching p, ties kept, within min-p's)."""
    w = ((row.double() - row.double().max()) / temperature).exp()
    w = torch.where(w >= min_p, w, 0.0)
    ascending = w.sort().values
    at_or_below = ascending.cumsum(0)[torch.searchsorted(ascending, w, right=True) - 1]
    above = w.sum() - at_or_below
    keep = ((above < top_p * w.sum()) if top_p < 1.0 else torch.ones_like(w, dtype=torch.bool)) & (w >= min_p)
    kept = torch.where(keep, w, 0.0)
    return kept / kept.sum()


def _rank_bins(want: torch.Tensor) -> list[torch.Tensor]:
    """The kept tokens by falling probability: the ten likeliest alone, then the rest in ten runs of ranks (a biased
    later round would shift mass between runs)."""
    order = want.argsort(descending=True)[:int((want > 0).sum())]
    return [order[i:i + 1] for i in range(min(10, order.numel()))] + \
        [run for run in order[10:].tensor_split(10) if run.numel()]


@pytest.mark.parametrize("case", [
    dict(vocab=4, scale=None, temperature=1.0, top_p=0.81, min_p=0.0),
    dict(vocab=128256, scale=3.0, temperature=0.8, top_p=0.9, min_p=0.0),
    dict(vocab=128256, scale=3.0, temperature=1.0, top_p=1.0, min_p=0.02),
    dict(vocab=32003, scale=0.05, temperature=1.0, top_p=0.05, min_p=0.0),  # flat: rejection rounds
    dict(vocab=128256, scale=3.0, temperature=1.0, top_p=0.5, min_p=0.01),  # top-p's share of min-p's survivors
], ids=["probs4", "llama3_p0.9", "llama3_min_p", "flat_p0.05", "llama3_min_p_p0.5"])
def test_the_fused_kernel_draws_the_kept_distribution(case):
    """200000 draws of one row (a stride-0 batch) by kernels/sampling.py: nothing outside the kept set (float64
    reference, fp32 rounding at its edges aside), and the kept tokens' frequencies against their probabilities (the
    ten likeliest, then ten runs of ranks) within 5 standard deviations."""
    from tpgraph.kernels.sampling import sample_rows

    n = 200_000
    g = torch.Generator().manual_seed(7)
    if case["scale"] is None:
        row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    else:
        row = torch.randn(case["vocab"], generator=g) * case["scale"]
    t, p, mp = case["temperature"], case["top_p"], case["min_p"]
    params = torch.tensor([[t, p, mp, float("-inf")]], device="cuda").expand(n, -1).contiguous()
    seeds = torch.randint(0, 1 << 62, (n,), generator=g).cuda()
    ids = sample_rows(row.cuda().expand(n, -1), params, seeds).cpu()
    want = _kept_probabilities(row, t, p, mp)
    near_edge = _kept_probabilities(row, t, min(1.0, p * (1 + 1e-4)), mp * (1 - 1e-4)) > 0
    assert near_edge[ids].all(), "drawn outside the kept set"
    counts = torch.bincount(ids, minlength=row.numel()).double()
    for tokens in _rank_bins(want):
        seen, prob = float(counts[tokens].sum()), float(want[tokens].sum())
        sd = (n * prob * (1 - prob)) ** 0.5
        assert abs(seen - n * prob) <= 5 * sd + 2, (tokens[:3].tolist(), seen, n * prob)


def test_the_sampler_takes_the_fused_kernel_on_cuda(monkeypatch):
    """By default a sampled CUDA row goes through kernels/sampling.py; TPGRAPH_FUSED_SAMPLING=0 keeps the torch
    chain; both leave the logits untouched and keep greedy rows at their argmax."""
    import tpgraph.kernels.sampling as fused

    calls = []
    real = fused.sample_rows
    monkeypatch.setattr(fused, "sample_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    # seeded: the top three of each row differ in bf16 (a tie at the second would let topk and argmax disagree)
    logits = torch.randn(3, 32000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).cuda()
    assert all(logits[i].float().topk(3).values.unique().numel() == 3 for i in range(3))
    before = logits.clone()
    top = logits.float().argmax(-1).tolist()
    penalized = [SampleRow(SamplingParams(temperature=0.0), [1], []), SampleRow(EVERY_OPTION, [1], []),
                 SampleRow(SamplingParams(temperature=0.7, top_p=0.9), [1], [])]
    # no penalty: the bf16 logits read in place, banned ids (min_tokens' EOS) on a copy
    plain = [SampleRow(SamplingParams(temperature=0.0), [1], [], banned_ids=(top[0],)),
             SampleRow(SamplingParams(temperature=0.7, top_k=40, min_p=0.05), [1], [], banned_ids=(top[1],)),
             SampleRow(SamplingParams(temperature=1e-4, top_p=0.9), [1], [])]
    for flag, taken in (("1", 1), ("0", 0)):
        monkeypatch.setenv("TPGRAPH_FUSED_SAMPLING", flag)
        calls.clear()
        out = Sampler("cuda").sample(logits, penalized)
        assert len(calls) == taken and out.token_ids[0] == top[0]
        out = Sampler("cuda").sample(logits, plain)
        assert len(calls) == 2 * taken and out.token_ids[0] == int(logits[0].float().topk(2).indices[1])
        # (at temperature 1e-4 the largest, or one tied with it in bf16)
        assert out.token_ids[1] != top[1] and logits[2, out.token_ids[2]] == logits[2].max()
        assert torch.equal(logits, before)


def test_logit_bias_forces_and_bans_on_the_fused_draw_and_greedy_rows():
    """bf16 logits on CUDA (the fused draw, which reads the fp32 copy a bias makes): bias 100 all but forces a token
    on sampled and greedy rows, and -100 keeps the largest logit from ever being drawn."""
    logits = torch.randn(64, 32000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    top = logits.float().argmax(-1).tolist()
    forced = [SampleRow(SamplingParams(temperature=t, top_p=0.95, logit_bias={123: 100.0}), [1], []) for t in (0, 1)]
    banned = [SampleRow(SamplingParams(temperature=0.05, logit_bias={top[i]: -100.0}), [1], []) for i in range(2, 64)]
    out = Sampler("cuda").sample(logits, forced + banned)
    assert out.token_ids[:2] == [123, 123]
    assert all(t != top[i] for i, t in enumerate(out.token_ids) if i >= 2)


def test_the_fused_penalties_equal_the_torch_ops():
    """kernels/penalties.py against the torch ops on a Llama-3 row width: the same slots filled from the same ids,
    then a step's rows (a slot twice, one not first) penalized alike and its ids counted alike."""
    vocab = 128256
    g = torch.Generator().manual_seed(11)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
              SamplingParams(repetition_penalty=0.9, frequency_penalty=-0.3),
              SamplingParams(presence_penalty=1.5)]
    rows = [SampleRow(p, torch.randint(vocab, (50,), generator=g).tolist(),
                      torch.randint(vocab, (300,), generator=g).tolist(), seq_id=i) for i, p in enumerate(params)]
    tables = [PenaltyTable(4, vocab, "cuda", fused=f) for f in (False, True)]
    slot_ids = [torch.tensor(t.slots_for(rows), device="cuda") for t in tables]
    assert torch.equal(tables[0].counts, tables[1].counts) and torch.equal(tables[0].in_prompt, tables[1].in_prompt)
    x = torch.randn(4, vocab, generator=g).cuda() * 4
    order = [2, 0, 1, 0]
    got = [t.apply(x, s[order], [params[i] for i in order]) for t, s in zip(tables, slot_ids, strict=True)]
    torch.testing.assert_close(got[1], got[0], rtol=1e-6, atol=1e-6)
    ids = torch.randint(vocab, (4,), generator=g).cuda()
    for t, s in zip(tables, slot_ids, strict=True):
        t.count(s[order], ids)
    assert torch.equal(tables[0].counts, tables[1].counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_top_k_kernel_finds_topks_kth_value(dtype):
    """kernels/top_k.py's floors against torch.topk's k-th values on Llama-3 rows: 64 random rows, k from 1 to the
    vocabulary (k of 5000 and more: a bound of -inf, and a select over the whole row), a row of ties at the k-th
    value, a row clipped to a few values, one with a chunk of masked (-inf) ids; then other rows, right too, and the
    shared counters left at zero."""
    from tpgraph.kernels._counters import MAX_COUNTERS, split_counters
    from tpgraph.kernels.top_k import top_k_floors

    vocab, batch = 128256, 64
    g = torch.Generator().manual_seed(5)
    for call in range(2):
        x = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)
        x[1, 1000:3000] = 21.5  # (the 11th largest: above every random value)
        x[1, :10] = 40.0
        x[2] = x[2].clamp(-1, 1).round()
        x[8, 4096:8192] = float("-inf")
        ks = torch.randint(1, 257, (batch,), generator=g)
        ks[:4] = torch.tensor([50, 11, 70000, vocab])
        ks[4:8] = torch.tensor([1, vocab - 1, 0, 5000])
        x, kf = x.cuda(), ks.float().cuda()
        want = torch.stack([x[i].float().topk(int(k)).values[-1] if k > 0 else
                            torch.tensor(float("-inf"), device="cuda") for i, k in enumerate(ks.tolist())])
        got = top_k_floors(x, kf, torch.empty(batch, device="cuda"))
        assert torch.equal(got, want), call
        assert float(got[1]) == 21.5 and float(got[2]) == 0.0
        assert not split_counters(x.device, MAX_COUNTERS).any()


def test_the_sampler_draws_alike_with_the_top_k_kernel_or_torch_topk(monkeypatch):
    """Same sampler seed, same tokens: the floor from kernels/top_k.py or from torch.topk (TPGRAPH_FUSED_TOP_K=0), for
    bf16 logits read in place and fp32 ones after penalties; a batch with a k past MAX_K takes torch.topk either way."""
    import tpgraph.kernels.top_k as fused_top_k

    calls = []
    real = fused_top_k.top_k_floors
    monkeypatch.setattr(fused_top_k, "top_k_floors", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(16, 128256, generator=g) * 3).to(torch.bfloat16).cuda()
    mixes = [SamplingParams(temperature=0.8, top_k=50), SamplingParams(temperature=1.0, top_k=256),
             SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01), SamplingParams(temperature=0.0)]
    plain = [SampleRow(mixes[i % 4], [1], []) for i in range(16)]
    penalized = [SampleRow(SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.2), [1, 2], [3])] + plain[1:]
    past_max = plain[:-1] + [SampleRow(SamplingParams(temperature=1.0, top_k=fused_top_k.MAX_K + 1), [1], [])]
    for rows, kernel_calls in ((plain, 1), (penalized, 1), (past_max, 0)):
        drawn = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("TPGRAPH_FUSED_TOP_K", flag)
            calls.clear()
            drawn[flag] = Sampler("cuda", seed=2).sample(logits, rows).token_ids
            assert len(calls) == (kernel_calls if flag == "1" else 0)
        assert drawn["1"] == drawn["0"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_allowed_and_banned_ids_hold_on_the_fused_draw_and_greedy_rows(dtype):
    """allowed_token_ids and bans (bad words, min_tokens) on CUDA logits as the model gives them: sampled rows
    (the fused draw) and greedy rows take allowed ids alone, never a banned one; the caller's logits stay as they
    were."""
    vocab = 128256
    logits = torch.randn(64, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
    before = logits.clone()
    allowed = tuple(range(1000, 1064))
    rows = [SampleRow(SamplingParams(temperature=t, top_p=0.95, allowed_token_ids=allowed), [1], [])
            for t in (0.0, 1.0) for _ in range(16)]
    top = logits.float().argmax(-1).tolist()
    # (row 32 + i bans its own likeliest id: greedy rows, then near-greedy sampled ones)
    rows += [SampleRow(SamplingParams(temperature=0.0 if i < 16 else 0.05), [1], [], banned_ids=(top[32 + i],))
             for i in range(32)]
    sampler = Sampler("cuda", seed=1)
    for _ in range(3):
        ids = sampler.sample(logits, rows).token_ids
        assert all(1000 <= i < 1064 for i in ids[:32])
        assert all(i != top[32 + k] for k, i in enumerate(ids[32:]))
    best = logits[:16, 1000:1064].float().argmax(-1) + 1000
    assert ids[:16] == best.tolist()
    assert torch.equal(logits, before)
