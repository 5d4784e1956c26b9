"""kernels/top_k.py under TRITON_INTERPRET=1: each row's k-th largest logit against torch.topk's, in every dtype, with
ties, NaN, -inf, -0, rows shorter than k, several chunks, a masked chunk, and keys that differ in their last bits only;
the sampler's draws the same with it as with torch.topk's floor; refusals."""

import os

import pytest
import torch

from tpgraph.engine.sampler import Sampler, SampleRow, top_k_floor
from tpgraph.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU-tensor kernel tests need TRITON_INTERPRET=1")
triton = pytest.importorskip("triton")

from tpgraph.kernels import top_k as top_k_kernel  # noqa: E402
from tpgraph.kernels.top_k import top_k_floors  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def floors_of(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    out = torch.full((x.shape[0],), 7.0)  # (every row is written)
    return top_k_floors(x, torch.tensor(ks, dtype=torch.float32), out)


def reference(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """torch.topk's k-th value of each row, NaN counted below -inf; -inf where k is 0 or over the row's length."""
    clean = x.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    return torch.tensor([float(clean[i].topk(k).values[-1]) if 0 < k <= x.shape[1] else float("-inf")
                         for i, k in enumerate(ks)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_floor_is_topks_kth_value(dtype):
    """Rows over two chunks (CHUNK 4096), k from 1 to MAX_K, past the row's length, 0 and negative."""
    torch.manual_seed(0)
    vocab = 5003
    ks = [1, 2, 50, top_k_kernel.MAX_K, vocab + 3, 0, -1]
    x = (torch.randn(len(ks), vocab) * 4).to(dtype)
    assert torch.equal(floors_of(x, ks), reference(x, ks))


@pytest.mark.parametrize("slots, block, small", [(64, 1024, 256), (4096, 64, 16), (4096, 1024, 16)],
                         ids=["row", "blocks", "one_block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_candidates_select_by_blocks_or_over_the_whole_row(monkeypatch, dtype, slots, block, small):
    """Ties at the top (300 logits at the largest value) and large k make many candidates: more than the row's slots
    (64 here), and the last program selects over the row itself; more than a block (64 here), and it reads them a
    block at a time; more than the small block (16), and it takes them in one large block. The same answers every
    way."""
    monkeypatch.setattr(top_k_kernel, "CANDIDATES", slots)
    monkeypatch.setattr(top_k_kernel, "SELECT_BLOCK", block)
    monkeypatch.setattr(top_k_kernel, "SMALL_SELECT_BLOCK", small)
    torch.manual_seed(2)
    vocab = 1000
    x = torch.randn(4, vocab).to(dtype)
    x[0, 100:400] = 5.0
    x[2, :500] = float("-inf")
    ks = [5, 900, 300, vocab]
    got = floors_of(x, ks)
    assert float(got[0]) == 5.0
    assert torch.equal(got, reference(x, ks))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_nan_inf_and_signed_zeros(dtype):
    """A row of ties at the k-th value (kept whole: the floor is that value), NaN (below -inf), -inf and +inf entries,
    -0 beside +0, and a row of only -inf."""
    vocab = 300
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)).to(dtype)
    x[0, 10:40] = 2.0
    x[0, 5] = 3.0  # k = 10 lands inside the run of 2.0
    x[1, :100] = float("nan")
    x[2, 3] = float("inf")
    x[2, 50:250] = float("-inf")
    x[3] = 0.0
    x[3, ::2] = -0.0
    x[3, 7] = 1.0
    x[4] = float("-inf")
    x[5, :] = float("nan")
    ks = [10, 200, 150, 5, 3, 1]
    got = floors_of(x, ks)
    assert float(got[0]) == 2.0 and float(got[3]) == 0.0
    assert torch.equal(got, reference(x, ks)), (got, reference(x, ks))
    assert float(got[1]) > float("-inf") and float(got[2]) == float("-inf")  # (100 finite: the 150th is -inf)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_samplers_torch_floor_ranks_nan_as_the_kernel_does(dtype):
    """engine/sampler.top_k_floor (torch.topk: past MAX_K, or with the kernel off) on rows holding NaN gives the
    kernel's floors: NaN below -inf, not first as torch.topk ranks it."""
    from tpgraph.engine.sampler import top_k_floor

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[0, :40] = float("nan")
    x[1, ::3] = float("nan")
    x[2, 7] = float("nan")
    x[3] = float("nan")  # all NaN: -inf
    x[4, 50:] = float("nan")  # k past the 50 others: -inf
    ks = [10, 150, 1, 5, 100]
    got = top_k_floor(x, ks).float()
    assert torch.equal(got, floors_of(x, ks)) and got[3:].tolist() == [float("-inf")] * 2, got


def test_keys_close_together_settle_in_the_last_bits():
    """fp32 values one ulp apart: only the last of the select's four rounds tells them apart."""
    base = torch.tensor(1.2345678, dtype=torch.float32)
    steps = torch.arange(0, 64, dtype=torch.int32)
    x = (base.view(torch.int32) + steps).view(torch.float32)[torch.randperm(64)].unsqueeze(0)
    for k in (1, 17, 64):
        assert torch.equal(floors_of(x, [k]), reference(x, [k]))


def test_the_floor_goes_into_a_strided_column_and_calls_leave_the_counters_at_zero():
    """Written into column 3 of [B, 4] parameters (the other columns untouched); a second call on other logits is
    right too, and both leave the shared counters (arrivals and candidates' counts) at zero for the next kernel."""
    from tpgraph.kernels._counters import MAX_COUNTERS, split_counters

    params = torch.arange(12, dtype=torch.float32).view(3, 4)
    ks = torch.tensor([5.0, 0.0, 20.0])
    for seed in (0, 1):
        x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(seed))
        top_k_floors(x, ks, params[:, 3])
        assert torch.equal(params[:, :3], torch.arange(12, dtype=torch.float32).view(3, 4)[:, :3])
        assert torch.equal(params[:, 3], reference(x, [5, 0, 20]))
        assert not split_counters(x.device, MAX_COUNTERS).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_over_several_chunks_and_a_masked_chunk(dtype):
    """Three full chunks and a partial one (12293 entries): the largest logits in different chunks (each chunk's
    share of k is ceil(k / 3)), and a chunk wholly -inf, whose m-th part maximum is -inf (the bound then comes from
    the union of the chunks' largest part maxima)."""
    vocab = 12293
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    x[0] -= 100.0
    x[0, [5, 4100, 8200, 12290]] = torch.tensor([10.0, 5.0, 7.0, 9.0])  # (k 5: m is 2 in each full chunk, not 1)
    x[2] = x[1]
    x[2, 4096:8192] = float("-inf")
    x[3, 4096:8192] = float("-inf")
    x[3, 4100:4103] = 50.0
    ks = [3, 50, 50, 4]
    x = x.to(dtype)
    assert torch.equal(floors_of(x, ks), reference(x, ks))
    assert torch.equal(floors_of(x, [5, 200, 7, 2]), reference(x, [5, 200, 7, 2]))


class _NoGather:
    """Stands in for the gather launch, so that the floor column keeps the bound launch's bound."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("vocab, k_last", [(8192, 200), (12293, 385)])
def test_the_bound_is_finite_and_at_most_the_floor(monkeypatch, vocab, k_last):
    """The bound launch alone: at most the k-th largest logit, and above -inf, for a random row, a row with a masked
    (-inf) chunk (the union's k-th largest kept maximum, not the least of the chunks' m-th), and a large k: on two
    whole chunks (128 maxima kept each), and on three and a partial one, where k 385 is past MAX_K and past the
    full chunks' 3 x 128 kept maxima, so that the union of all four chunks' (the partial one keeps 5) gives it."""
    monkeypatch.setattr(top_k_kernel, "_gather_kernel", _NoGather())
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    x[1, 4096:8192] = float("-inf")
    ks = [50, 50, k_last]
    bounds = floors_of(x, ks)
    assert (bounds > float("-inf")).all(), bounds
    assert (bounds <= reference(x, ks)).all(), (bounds, reference(x, ks))


def test_refusals_name_what_is_wrong():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="ks"):
        top_k_floors(x, torch.ones(3), torch.empty(2))
    with pytest.raises(ValueError, match="floors"):
        top_k_floors(x, torch.ones(2), torch.empty(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        top_k_floors(x.double(), torch.ones(2), torch.empty(2))
    assert torch.equal(top_k_floors(torch.empty(2, 0), torch.ones(2), torch.zeros(2)), torch.full((2,), -float("inf")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_sampler_draws_alike_with_either_floor(monkeypatch, dtype):
    """The same seeds draw the same tokens whether the floor comes from this kernel or torch.topk, with top-k alone and
    with top-p and min-p, beside a greedy row; every token within its row's top k."""
    torch.manual_seed(1)
    logits = (torch.randn(4, 700) * 3).to(dtype)
    rows = [SampleRow(SamplingParams(temperature=1.0, top_k=5, seed=3), [], []),
            SampleRow(SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=4), [], []),
            SampleRow(SamplingParams(temperature=0.0), [], []),
            SampleRow(SamplingParams(temperature=2.0, top_k=2), [], [])]
    drawn = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TPGRAPH_FUSED_TOP_K", flag)
        drawn[flag] = Sampler("cpu", seed=9, fused=True).sample(logits, rows).token_ids
    assert drawn["1"] == drawn["0"]
    for row, (token, k) in enumerate(zip(drawn["1"], [5, 40, 1, 2], strict=True)):
        assert token in logits[row].float().topk(k).indices.tolist()
    assert torch.equal(top_k_floor(logits, [5, 40, 0, 2]).float(), reference(logits, [5, 40, 0, 2]))
