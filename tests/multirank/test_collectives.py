import torch
from tpgtest.spawn import run_ranks
from tpgtest.workers import collectives


def test_all_reduce_and_all_gather_on_gloo():
    results = run_ranks(collectives, 3)
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    parts = [torch.tensor([[r, 10 + r], [20 + r, 30 + r]], dtype=torch.float32) for r in range(3)]
    for summed, gathered, buffer, stacked in results:
        assert torch.equal(summed, base * 6)
        assert torch.equal(gathered, torch.tensor([[0.0, 1.0, 2.0]] * 2))
        assert torch.equal(buffer[:2, :-1], torch.cat(parts, dim=-1))
        assert (buffer[2:] == -1).all() and (buffer[:, -1] == -1).all()  # the rest: untouched
        assert torch.equal(stacked, torch.cat(parts, dim=0))


def test_a_custom_all_reduce_set_up_failing_on_one_rank_sends_every_rank_to_nccl():
    """A CUDA error in one rank's set-up (its peer's workspace refused to map) was raised as it was on that rank,
    which ended, while the others went on with NCCL: every rank now falls back alike, the reason named."""
    from tpgtest.workers import custom_setup_failing_on

    ranks = run_ranks(custom_setup_failing_on, 2, 1, timeout_s=120)
    for got_one, reason in ranks:
        assert not got_one and "cudaErrorPeerAccessUnsupported" in reason


def test_a_peer_workspace_failing_to_map_on_one_rank_sends_every_rank_to_nccl():
    """The failure named above happens after the ranks exchanged their workspace handles: the rank whose
    cudaIpcOpenMemHandle failed went to the fallback's exchange while the others went on to set-up's next ones,
    which then paired with its exchanges (the others kept a custom all-reduce, or failed on a closed peer). Every
    rank now learns of the failure in set-up's exchange after mapping, and every rank falls back to NCCL."""
    from tpgtest.workers import custom_setup_failing_to_map_on

    ranks = run_ranks(custom_setup_failing_to_map_on, 2, 1, timeout_s=120)
    for got_one, reason in ranks:
        assert not got_one and "cudaErrorPeerAccessUnsupported" in reason
