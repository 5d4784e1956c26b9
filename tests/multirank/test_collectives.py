import torch
from tpgtest.spawn import run_ranks
from tpgtest.workers import collectives


def test_all_reduce_and_all_gather_on_gloo():
    results = run_ranks(collectives, 3)
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    for summed, gathered in results:
        assert torch.equal(summed, base * 6)
        assert torch.equal(gathered, torch.tensor([[0.0, 1.0, 2.0]] * 2))
