"""kernels/sampling.py under TRITON_INTERPRET=1: the draw's distribution, its kept sets against the torch chain's
top_p_keep and min-p, the rejection rounds, seeds, edge rows and refusals. (The interpreter runs a program in about
20 ms, so the counts here are small; tests/gpu/test_sampler_gpu.py draws hundreds of thousands on a GPU.)"""

import math
import os
from collections import Counter

import pytest
import torch

from tpgraph.engine.sampler import Sampler, SampleRow, top_p_keep
from tpgraph.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

import tpgraph.kernels.sampling as sampling  # noqa: E402
from tpgraph.kernels.sampling import sample_rows  # noqa: E402

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def draw(x: torch.Tensor, temperature=1.0, top_p=1.0, min_p=0.0, seed0=0) -> list[int]:
    """One draw per row of x, row i seeded with seed0 + i."""
    n = x.shape[0]
    seeds = torch.arange(seed0, seed0 + n, dtype=torch.int64) * 0x9E3779B9
    return sample_rows(x, per_row(n, temperature, top_p, min_p), seeds).tolist()


def per_row(n: int, temperature: float, top_p: float, min_p: float, floor: float = float("-inf")) -> torch.Tensor:
    return torch.tensor([[temperature, top_p, min_p, floor]]).expand(n, -1).contiguous()


def kept_set(row: torch.Tensor, temperature: float, top_p: float, min_p: float) -> tuple[set[int], set[int]]:
    """(the tokens the torch chain keeps, those within fp32 rounding of top-p's edge): min-p of the row's weights,
    then top_p_keep of what it kept (vLLM's order)."""
    w = ((row / temperature) - (row / temperature).max()).exp().unsqueeze(0)
    w = w.masked_fill(w < min_p, 0.0)
    kept = top_p_keep(w, [top_p])[0]
    mass = w[0].double() / w[0].double().sum()
    order = mass.argsort(descending=True)
    above = torch.zeros_like(mass)
    above[order] = mass[order].cumsum(0) - mass[order]  # the share strictly above each token (ties aside)
    edge = ((above - top_p).abs() < 1e-4).nonzero().flatten().tolist()
    return set((kept > 0).nonzero().flatten().tolist()), set(edge)


@pytest.mark.parametrize("kw, kept", [({}, [0, 1, 2, 3]), ({"top_p": 0.81}, [0, 1, 2]), ({"min_p": 0.2}, [0, 1, 2]),
                                      ({"top_p": 0.8}, [0, 1]), ({"top_p": 0.84, "min_p": 0.2}, [0, 1])],
                         ids=["plain", "p0.81", "min_p0.2", "p0.8", "min_p_then_p"])
def test_the_draw_follows_the_kept_distribution(kw, kept):
    """400 draws from [0.5, 0.3, 0.15, 0.05]: each kept token's frequency within 0.08 of its share of the kept set
    (4 standard deviations), and nothing else drawn. min_p_then_p: min-p keeps [0.5, 0.3, 0.15] (0.95), of which
    0.5 + 0.3 is 0.842, past top_p 0.84, so token 2 goes too, as in vLLM's order (of the whole row, 0.8 < 0.84 would
    keep it)."""
    counts = Counter(draw(PROBS.log().expand(400, -1), **kw))
    assert set(counts) == set(kept), counts
    total = float(PROBS[kept].sum())
    for t in kept:
        assert abs(counts[t] / 400 - float(PROBS[t]) / total) < 0.08, counts


@pytest.mark.parametrize("case", [
    dict(scale=3.0, temperature=1.0, top_p=0.9, min_p=0.0),
    dict(scale=3.0, temperature=0.5, top_p=0.5, min_p=0.0),
    dict(scale=3.0, temperature=1.3, top_p=1.0, min_p=0.05),
    dict(scale=0.05, temperature=1.0, top_p=0.05, min_p=0.0),  # flat: a race lands in the set 1 time in 20
    dict(scale=0.3, temperature=1.0, top_p=0.7, min_p=0.9),  # min-p rejects most races over the whole row
], ids=["p0.9", "p0.5_t0.5", "min_p", "flat_p0.05", "flat_min_p"])
def test_every_draw_is_in_the_torch_chains_kept_set(case):
    """Rows of 3000 logits (two blocks, one partial) drawn 24 times each: every token is in top_p_keep's and min-p's
    set (or within fp32 rounding of its edge). The flat rows need rejection rounds: a draw from the whole row would
    fall outside the set 19 times in 20."""
    row = torch.randn(3000, generator=torch.Generator().manual_seed(3)) * case["scale"]
    kept, edge = kept_set(row, case["temperature"], case["top_p"], case["min_p"])
    ids = draw(row.expand(24, -1), case["temperature"], case["top_p"], case["min_p"])
    assert set(ids) <= kept | edge, sorted(set(ids) - kept)
    assert len(set(ids)) > 1 or len(kept) == 1


def test_chunks_draw_in_proportion_to_their_weight(monkeypatch):
    """Chunks of 16 (monkeypatched), a row of 64 with one token of 0.3 in the first chunk, ten of 0.05 in the second
    and one of 0.2 in the last, the third all -inf: each chunk draws within itself from its weights and the race
    between chunks picks one by its total, so over 300 draws each chunk's share, and each token's, is within 4
    standard deviations of its probability, and the second chunk's ten tokens come evenly (a race by the chunks'
    maxima alone would give the second chunk 9%, not half; an inverse off by one entry would draw -inf's)."""
    monkeypatch.setattr(sampling, "CHUNK", 16)
    probs = {3: 0.3, **{t: 0.05 for t in range(16, 26)}, 60: 0.2}
    row = torch.full((64,), float("-inf"))
    row[list(probs)] = torch.tensor(list(probs.values())).log() + 7.0
    ids = draw(row.expand(300, -1), temperature=1.0)
    assert set(ids) <= set(probs), sorted(set(ids) - set(probs))
    counts = Counter(ids)
    shares = [(p, counts[t]) for t, p in probs.items()] + [(0.5, sum(counts[t] for t in range(16, 26)))]
    for p, seen in shares:
        assert abs(seen / 300 - p) <= 4 * (p * (1 - p) / 300) ** 0.5, (p, seen, counts)
    # and within the second chunk, evenly: chi-square over its ten tokens (9 degrees of freedom; 33.7 is p = 1e-4),
    # which a pick skewed within the chunk (its uniform reused from the race) fails
    inside = [counts[t] for t in range(16, 26)]
    expected = sum(inside) / 10
    assert sum((c - expected) ** 2 / expected for c in inside) < 33.7, inside


@triton.jit
def _rounds_probe(x_ptr, seed_ptr, ids_ptr, above_ptr, V, counter_base, m, low, a, b, BLOCK: tl.constexpr):
    """One row's draw by the further rounds' one-program race (sampling._race_row) per seed, and the whole-row
    weights above a and b (sampling._weight_above_row)."""
    i = tl.program_id(0)
    j = sampling._race_row(x_ptr, V, float("-inf"), tl.load(seed_ptr + i), counter_base, 1.0, m, low, 0.0, BLOCK)
    tl.store(ids_ptr + i, j)
    above_a, above_b = sampling._weight_above_row(x_ptr, V, float("-inf"), m, 1.0, a, b, BLOCK)
    tl.store(above_ptr, above_a)
    tl.store(above_ptr + 1, above_b)


def test_the_further_rounds_race_draws_in_proportion_to_the_weights_above_low():
    """The one-program race of rounds 3 and on, over a row of 32 in blocks of 16: above `low` it keeps tokens 3 and 9
    (weights 4:1, one block) and 20 and 30 (1:1, the other block; the blocks' totals 5:2). Over 600 seeds each
    token's frequency is within 4 standard deviations of its probability (a pick that ignored the weights within a
    block would give 3 and 9 the same; a race by anything but the blocks' totals, other shares). The whole-row sums
    of the weights strictly above a logit (token 9's, tied with 20's and 30's) and above a level equal torch's."""
    x = torch.full((32,), -3.0)
    x[[3, 9, 20, 30]] = torch.tensor([4.0, 1.0, 1.0, 1.0]).log()
    probs = {3: 4 / 7, 9: 1 / 7, 20: 1 / 7, 30: 1 / 7}
    seeds = torch.arange(600, dtype=torch.int64) * 0x9E3779B9
    ids = torch.empty(600, dtype=torch.int32)
    above = torch.empty(2)
    _rounds_probe[(600,)](x, seeds, ids, above, 32, 3 * sampling.ROUND_COUNTERS, float(x.max()), -1.0, float(x[9]),
                         -3.5, BLOCK=16)
    counts = Counter(ids.tolist())
    assert set(counts) == set(probs), counts
    for t, p in probs.items():
        assert abs(counts[t] / 600 - p) <= 4 * (p * (1 - p) / 600) ** 0.5, (t, counts)
    w = (x - x.max()).exp()
    assert torch.allclose(above, torch.stack([w[x > x[9]].sum(), w.sum()]), rtol=1e-6)  # (strictly above: not 9's ties)


def test_the_second_race_moves_its_chunks_keys_to_the_rows_maximum(monkeypatch):
    """Chunks of 16 (monkeypatched), rows of 32 at min-p 0.3: it keeps A (the maximum, weight 1) in the first chunk
    and C and D (0.41 each) in the second, beside 29 tokens of weight 0.14 that hold two thirds of the row, so the
    first race is rejected about 2 times in 3 and the second race (over what min-p keeps, never rejected) draws most
    rows. The second chunk's share is 0.45 of min-p's set; a second race that left each chunk's key relative to its
    own maximum would give it 0.67 (2 / 3), and about 0.6 overall: over 450 draws, 6.4 standard deviations away."""
    monkeypatch.setattr(sampling, "CHUNK", 16)
    row = torch.full((32,), -2.0)
    row[[4, 20, 27]] = torch.tensor([0.0, -0.9, -0.9])
    ids = draw(row.expand(450, -1), min_p=0.3)
    assert set(ids) == {4, 20, 27}, sorted(set(ids))
    share = 2 * math.exp(-0.9) / (1.0 + 2 * math.exp(-0.9))
    seen = sum(i != 4 for i in ids) / 450
    assert abs(seen - share) <= 4 * (share * (1 - share) / 450) ** 0.5, (seen, share)


@triton.jit
def _pick_probe(w_ptr, u, out_ptr, N: tl.constexpr):
    pick, total = sampling._pick(tl.load(w_ptr + tl.arange(0, N)), u, N)
    tl.store(out_ptr, pick.to(tl.float32))
    tl.store(out_ptr + 1, total)


@triton.jit
def _first_past_probe(running_ptr, w_ptr, target, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr, sampling._first_past(tl.load(running_ptr + offs), tl.load(w_ptr + offs), target, N))


def test_a_target_that_rounds_up_to_the_total_picks_the_last_weighed_entry():
    """Where u times the total rounds back to the total (here a total of two of the smallest fp32 denormals, and u =
    1 - 2^-24, the largest uniform), no running sum passes it: the pick is the last entry with weight (3), never a
    weight-0 one. u = 0.2 picks the first."""
    tiny = 2.0 ** -149
    w = torch.tensor([0.0, tiny, 0.0, tiny] + [0.0] * 12)
    out = torch.empty(2)
    _pick_probe[(1,)](w, 1.0 - 2.0 ** -24, out, N=16)
    assert out.tolist() == [3.0, 2 * tiny]
    _pick_probe[(1,)](w, 0.2, out, N=16)
    assert out.tolist() == [1.0, 2 * tiny]


def test_a_running_sum_that_steps_up_on_a_zero_never_picks_it():
    """A GPU scan may add a lane's carry so that the running sum steps up an ulp on a weight-0 entry (the interpreter's
    in-order cumsum never does, so the running sums are given here): the entry past the target that has no weight
    is passed over, for the next weighed one, or where none follows the last weighed one."""
    ulp = 2.0 ** -23
    w = torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0, 0.0] + [0.0] * 10)
    running = torch.tensor([0.0, 1.0, 1.0 + ulp, 1.0 + ulp, 3.0 + ulp] + [3.0 + 2 * ulp] * 11)
    out = torch.empty(1, dtype=torch.int32)
    _first_past_probe[(1,)](running, w, 1.0, out, N=16)
    assert out.item() == 4  # (not 2, whose sum stepped up on a zero)
    _first_past_probe[(1,)](running, w, 3.0 + ulp, out, N=16)
    assert out.item() == 4  # (not 5, the step after the last weight: the fallback)


def test_chunks_race_on_one_scale():
    """Each chunk keys its race relative to its own maximum; the last program moves them to the row's: a token 5
    above everything else, alone in the second chunk, wins about 99% of draws, not half."""
    x = torch.full((40, 4096), -50.0)
    x[:, 0] = 0.0
    x[:, 3000] = 5.0
    assert draw(x).count(3000) >= 34


def test_the_top_k_floor_keeps_ties_at_the_kth_value():
    """k = 3 over [5, 4, 3, 3, 3, 0, ...]: the floor is 3 and the three 3s stay (top_k_mask keeps ties), so a hot
    temperature draws them."""
    x = torch.zeros(60, 300)
    x[:, :5] = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0])
    ids = sample_rows(x, per_row(60, 100.0, 1.0, 0.0, floor=3.0), torch.arange(60) * 7).tolist()
    assert set(ids) <= {0, 1, 2, 3, 4} and {3, 4} & set(ids)


def test_a_long_row_in_bf16():
    """A Llama-3 row (128256 entries, 63 blocks) in bf16, as the decode logits come."""
    row = (torch.randn(128256, generator=torch.Generator().manual_seed(4)) * 4).to(torch.bfloat16)
    kept, edge = kept_set(row.float(), 0.8, 0.9, 0.0)
    ids = draw(row.expand(3, -1), temperature=0.8, top_p=0.9)
    assert set(ids) <= kept | edge and len(kept) < 128256


def test_seeds_fix_the_draw_and_rows_are_independent():
    x = (torch.randn(8, 500, generator=torch.Generator().manual_seed(5)) * 2).contiguous()
    once = draw(x, top_p=0.9, seed0=11)
    assert draw(x, top_p=0.9, seed0=11) == once  # the same seeds draw the same tokens
    assert draw(x[3:5], top_p=0.9, seed0=14) == once[3:5]  # a row's token does not depend on the rest
    assert draw(x, top_p=0.9, seed0=12) != once
    # a row of 20 (one chunk of 32) padded with -inf to two chunks of 2048: its chunk keeps its index, so its random
    # numbers, and the chunk of -inf never wins
    short = x[:, :20].contiguous()
    padded = torch.nn.functional.pad(short, (0, 3000), value=float("-inf"))
    assert draw(short, seed0=1) == draw(padded, seed0=1)
    assert draw(short, top_p=0.3, seed0=1) == draw(padded, top_p=0.3, seed0=1)  # the later rounds' numbers too
    # negative logits tied at the top in two chunks, at the smallest temperature: the chunks' keys meet relative to
    # the largest finite chunk maximum (not to 0, where a chunk of -inf follows), so they keep their precision and
    # the padding changes no draw
    low = torch.randn(16, 3000, generator=torch.Generator().manual_seed(15)) - 10000.0
    low[:, [3, 2500]] = low.max() + 1.0
    want = draw(low, temperature=1e-5, seed0=2)
    assert draw(torch.nn.functional.pad(low, (0, 3000), value=float("-inf")), temperature=1e-5, seed0=2) == want
    assert set(want) == {3, 2500}


def test_batches_past_the_counters_go_in_several_launches(monkeypatch):
    """A launch takes at most ROWS_PER_LAUNCH rows (one arrival counter each; 65536): more go in slices, each row's
    draw as it would be alone."""
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(8)) * 2).contiguous()
    whole = draw(x, top_p=0.8, seed0=3)
    monkeypatch.setattr(sampling, "ROWS_PER_LAUNCH", 3)
    assert draw(x, top_p=0.8, seed0=3) == whole


def test_rows_past_the_last_round_take_their_largest_logit(monkeypatch):
    """MAX_ROUNDS bounds the rounds (each bisects, so it is never reached in practice): a row still rejected then
    takes its first largest logit, which is always kept. With the bound at 2, flat rows whose two races land outside
    top-p's few tokens end there; the others still draw inside the set."""
    row = torch.randn(600, generator=torch.Generator().manual_seed(12)) * 0.05
    kept, edge = kept_set(row, 1.0, 0.05, 0.0)
    monkeypatch.setattr(sampling, "MAX_ROUNDS", 2)
    ids = draw(row.expand(16, -1), top_p=0.05)
    assert set(ids) <= kept | edge and int(row.argmax()) in ids


def test_a_race_alone_where_nothing_truncates():
    """truncated=False (no row with top-p or min-p: the sampler knows) skips the checks and draws what the four
    launches draw."""
    x = (torch.randn(6, 700, generator=torch.Generator().manual_seed(13)) * 2).contiguous()
    params, seeds = per_row(6, 0.8, 1.0, 0.0), torch.arange(6) * 31
    assert sample_rows(x, params, seeds, truncated=False).tolist() == sample_rows(x, params, seeds).tolist()


def test_edge_rows():
    x = torch.full((5, 300), float("-inf"))
    x[0, 17] = 1.0  # one finite logit: always it
    x[2, 5] = float("nan")
    x[2, 40] = 0.0  # NaN never drawn
    x[3, [8, 9]] = 2.0  # min-p 1: only the largest (either of a tie)
    x[4] = torch.linspace(0, 1, 300)
    params = torch.tensor([[1.0, 0.9, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1e-5, 1.0, 0.0]])
    params = torch.cat([params, torch.full((5, 1), float("-inf"))], dim=1)
    ids = sample_rows(x, params, torch.arange(5)).tolist()
    assert ids[0] == 17 and ids[1] == 0 and ids[2] == 40 and ids[3] in (8, 9) and ids[4] == 299
    # +inf: the first one, as the torch chain's argmax of NaN weights gives; a p that rounds to 0 in fp32 keeps the
    # largest and its ties
    x2 = torch.full((2, 3000), -1.0)
    x2[0, [2500, 2900]] = float("inf")
    x2[1, [40, 2999]] = 2.0
    ids = sample_rows(x2, torch.tensor([[1.0, 0.9, 0.0, float("-inf")], [1.0, 1e-46, 0.0, float("-inf")]]),
                      torch.tensor([1, 2])).tolist()
    assert ids[0] == 2500 and ids[1] in (40, 2999)
    ties = {sample_rows(x2[1:], per_row(1, 1.0, 1e-46, 0.0), torch.tensor([s])).item() for s in range(12)}
    assert ties == {40, 2999}
    # temperature 0: left to the caller's argmax (whatever `out` held)
    out = torch.full((1,), -7, dtype=torch.int64)
    sample_rows(x[:1], per_row(1, 0.0, 1.0, 0.0), torch.zeros(1, dtype=torch.int64), out=out)
    assert out.tolist() == [-7]


def test_mistakes_are_refused():
    x = torch.randn(2, 10)
    good = (per_row(2, 1.0, 1.0, 0.0), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous last dim"):
        sample_rows(x.t().contiguous().t(), *good)
    with pytest.raises(ValueError, match="params must be"):
        sample_rows(x, per_row(3, 1.0, 1.0, 0.0), good[1])
    with pytest.raises(ValueError, match="seeds must be"):
        sample_rows(x, good[0], torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        sample_rows(x, *good, out=torch.zeros(3, dtype=torch.int64))


def test_views_off_a_16_byte_boundary_are_taken():
    """Parameters and seeds that start off a 16-byte boundary (views into one upload, as uploads.to_device_parts
    makes) and a strided `out`: the kernel gets aligned copies (one compiled variant), and the ids land in `out`."""
    x = (torch.randn(3, 100, generator=torch.Generator().manual_seed(9)) * 2).contiguous()
    params, seeds = per_row(3, 1.0, 0.9, 0.0), torch.tensor([5, 6, 7])
    want = sample_rows(x, params, seeds).tolist()
    shifted = torch.cat([torch.zeros(1), params.flatten()])[1:].view(3, 4)
    shifted_seeds = torch.cat([torch.zeros(1, dtype=torch.int64), seeds])[1:]
    assert shifted.data_ptr() % 16 and shifted_seeds.data_ptr() % 16
    out = torch.full((6,), -1, dtype=torch.int64)
    sample_rows(x, shifted, shifted_seeds, out=out[::2])
    assert out[::2].tolist() == want and out[1::2].tolist() == [-1] * 3


def test_16_bit_logits_without_penalties_are_read_in_place_and_left_untouched():
    """No penalized row: the kernel reads the caller's bf16 logits themselves; banned ids (min_tokens' EOS) and top-k
    work on copies, and a seeded row draws as it would alone."""
    logits = (torch.randn(4, 500, generator=torch.Generator().manual_seed(14)) * 3).to(torch.bfloat16)
    before = logits.clone()
    top = logits.float().argmax(-1).tolist()
    rows = [SampleRow(SamplingParams(temperature=1e-4), [1], [], banned_ids=(top[0],)),
            SampleRow(SamplingParams(temperature=0.8, top_p=0.9, seed=3), [1], [4]),
            SampleRow(SamplingParams(temperature=0.0), [1], [], banned_ids=(top[2],)),
            SampleRow(SamplingParams(temperature=2.0, top_k=2, logprobs=1), [1], [])]
    out = Sampler("cpu", fused=True).sample(logits, rows)
    assert torch.equal(logits, before)
    assert out.token_ids[0] == int(logits[0].float().topk(2).indices[1])
    assert out.token_ids[2] == int(logits[2].float().topk(2).indices[1])
    assert out.token_ids[3] in logits[3].float().topk(2).indices.tolist()
    assert Sampler("cpu", seed=5, fused=True).sample(logits[1:2], rows[1:2]).token_ids == out.token_ids[1:2]


def test_the_sampler_takes_the_kernel_for_sampled_rows():
    """Sampler(fused=True): greedy rows keep the argmax, banned ids and top-k hold, a seeded row's token does not
    depend on the batch, 16-bit logits are read as they are and left untouched."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(5, 700, generator=g) * 3).to(torch.bfloat16)
    before = logits.clone()
    top = logits.float().argmax(-1).tolist()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    rows = [SampleRow(SamplingParams(temperature=0.0), [1], []),
            SampleRow(SamplingParams(temperature=2.0, top_k=3), [1], []),
            SampleRow(seeded, [1], [2, 3]),
            SampleRow(SamplingParams(temperature=1e-4), [1], [], banned_ids=(top[3],)),
            SampleRow(SamplingParams(temperature=1.0, repetition_penalty=1.5, logprobs=1), [1], [])]
    out = Sampler("cpu", fused=True).sample(logits, rows)
    assert torch.equal(logits, before)
    assert out.token_ids[0] == top[0]
    assert out.token_ids[1] in logits[1].float().topk(3).indices.tolist()
    assert out.token_ids[3] == logits[3].float().topk(2).indices[1]
    assert len(out.logprobs) == 5
    alone = Sampler("cpu", seed=9, fused=True).sample(logits[2:3], [rows[2]]).token_ids
    assert alone[0] == out.token_ids[2]


@pytest.mark.parametrize("case", [dict(k=5, top_p=1.0, min_p=0.0), dict(k=40, top_p=0.5, min_p=0.0),
                                  dict(k=300, top_p=0.9, min_p=0.1)], ids=["k5", "k40_p0.5", "k300_p0.9_min_p"])
def test_top_k_floor_then_top_p_over_what_top_k_kept(case):
    """A floor (top_k_floor's k-th largest) leaves the rest out everywhere, and top-p's share is of what top-k kept,
    as top_k_mask then top_p_keep give it: every draw lies in that set."""
    from tpgraph.engine.sampler import top_k_floor, top_k_mask

    row = torch.randn(3000, generator=torch.Generator().manual_seed(10)) * 2
    floor = float(top_k_floor(row.unsqueeze(0), [case["k"]])[0])
    kept, edge = kept_set(top_k_mask(row.unsqueeze(0), [case["k"]])[0], 1.0, case["top_p"], case["min_p"])
    assert len(kept) < case["k"] + 1
    ids = sample_rows(row.expand(24, -1), per_row(24, 1.0, case["top_p"], case["min_p"], floor),
                      torch.arange(24) * 977).tolist()
    assert set(ids) <= kept | edge and (len(set(ids)) > 1 or len(kept) == 1)
