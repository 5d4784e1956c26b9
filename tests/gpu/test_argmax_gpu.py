"""The argmax on CUDA, both paths (the one-launch kernel, the default, and the two torch stages): torch.argmax's
answer, ties and NaN included."""

import pytest
import torch

from tpgraph.engine.argmax import row_argmax

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("fused", [False, True], ids=["two_stage", "fused"])
def test_cuda_equals_torch_argmax_with_ties_and_nan(fused):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 128256, device="cuda", generator=g).to(torch.bfloat16)
    x[3, [300, 5000, 100000]] = 100.0  # ties across chunks
    x[4, [256, 257]] = 100.0  # ties in one chunk
    x[5, 99999] = float("nan")
    ids = row_argmax(x, fused=fused)
    assert torch.equal(ids, x.argmax(dim=-1))
    assert ids[3].item() == 300 and ids[4].item() == 256


@pytest.mark.parametrize("setting", [None, "0"], ids=["default", "off"])
def test_the_fused_kernel_equals_torch_argmax_on_cuda(monkeypatch, setting):
    """The one launch, taken by default (and not with TPGRAPH_FUSED_ARGMAX=0): the same rows as above, on a view
    with a padded row stride as the runner's decode logits are, and its counters back at zero."""
    import tpgraph.engine.argmax as engine_argmax
    from tpgraph.kernels._counters import split_counters

    ran = []
    real = engine_argmax.argmax_rows
    monkeypatch.setattr(engine_argmax, "argmax_rows", lambda x, out=None: ran.append(1) or real(x, out=out))
    if setting is None:
        monkeypatch.delenv("TPGRAPH_FUSED_ARGMAX", raising=False)
    else:
        monkeypatch.setenv("TPGRAPH_FUSED_ARGMAX", setting)
    g = torch.Generator(device="cuda").manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        buf = torch.randn(16, 128320, device="cuda", generator=g).to(dtype)
        x = buf[:, :128256]
        x[3, [300, 5000, 100000]] = 100.0
        x[4, [256, 257]] = 100.0
        x[5, [99999, 1234]] = float("nan")
        x[6] = float("-inf")
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert len(ran) == (2 if setting is None else 0)
    assert not split_counters(x.device, 16).any()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_shard_slots_combine_to_torch_argmax_on_cuda_inside_a_graph(world):
    """TP > 1 greedy decode on CUDA: each shard's slot kernel (a padded row stride, as the runner's shard buffer), the
    ranks' slots summed (as the all-reduce sums them) and the combine, captured in a CUDA graph as a decode step
    captures them, give torch.argmax of the whole row; the slots equal torch's path bit for bit."""
    from tpgraph.engine.argmax import combine_slots, shard_argmax_slots
    from tpgraph.kernels._counters import split_counters

    vocab = 128256 + 7  # shards of unequal real width: the last one short
    per_rank = -(-vocab // world)
    g = torch.Generator(device="cuda").manual_seed(world)
    buf = torch.randn(16, world * per_rank + 64, device="cuda", generator=g).to(torch.bfloat16)
    x = buf[:, :vocab]
    x[3, [300, per_rank, vocab - 1]] = 100.0  # a tie across shards: the first shard's
    x[4, [per_rank + 5, per_rank + 6]] = 100.0
    x[5, [vocab - 2, per_rank + 1]] = float("nan")
    x[5, 0] = float("inf")
    x[6] = float("-inf")
    x[7] = -1.0  # negative maxima, a tie across every shard
    x[8] = 0.0
    x[8, : per_rank // 2] = -0.0  # -0.0 ties +0.0: index 0
    parts = [(x[:, r * per_rank:min((r + 1) * per_rank, vocab)], r * per_rank) for r in range(world)]
    ids = torch.full((16,), -1, dtype=torch.int64, device="cuda")

    def step():
        slots = torch.stack([shard_argmax_slots(part, base, rank, world, fused=True)
                             for rank, (part, base) in enumerate(parts)])
        combine_slots(slots.sum(dim=0), out=ids, fused=True)
        return slots

    step()  # eager first: the counters are made outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots = step()
    x.mul_(-1)  # new values in place, as a decode step's logits
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids, x.argmax(dim=-1))
    reference = torch.stack([shard_argmax_slots(part, base, rank, world, fused=False)
                             for rank, (part, base) in enumerate(parts)])
    assert torch.equal(slots, reference)
    assert not split_counters(x.device, 16).any()


def test_the_slot_keys_order_fp32_values_as_torch_argmax_on_cuda():
    """The keys' hard cases on the GPU, where a flushed denormal or a -0.0 would change the winner: every ordered pair
    of them across two ranks, one column each."""
    from tpgraph.engine.argmax import combine_slots, shard_argmax_slots

    values = [float("-inf"), -3.0e38, -1.0, -1.0e-40, -0.0, 0.0, 1.0e-45, 1.0e-40, 2.0, 3.0e38, float("inf"),
              float("nan")]
    x = torch.tensor([[a, b] for a in values for b in values], dtype=torch.float32, device="cuda")
    slots = sum(shard_argmax_slots(x[:, r:r + 1], r, r, 2, fused=True) for r in range(2))
    assert torch.equal(combine_slots(slots, fused=True), x.argmax(dim=-1))
