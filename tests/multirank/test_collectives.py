import pytest
import torch
from tpgtest.spawn import run_ranks
from tpgtest.workers import collectives

from tpgraph.errors import ConfigError


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


def test_an_expected_custom_all_reduce_failure_on_one_rank_falls_back_everywhere_and_says_why():
    """P2P or CUDA IPC that this machine does not offer (here: cudaIpcOpenMemHandle refusing a peer's workspace on
    rank 1) is a reason to use NCCL: every rank falls back, with the failing rank and its reason in a warning."""
    from tpgtest.workers import custom_setup_raising_on

    error = RuntimeError("CUDA error cudaErrorPeerAccessUnsupported (peer access is not supported between these two "
                         "devices) in `cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess)`")
    for outcome, got_one, reason, warnings in run_ranks(custom_setup_raising_on, 2, 1, error, timeout_s=120):
        assert outcome == "fell back" and not got_one
        assert "rank 1" in reason and "cudaErrorPeerAccessUnsupported" in reason
        assert len(warnings) == 1 and "NCCL" in warnings[0] and reason in warnings[0]


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error cudaErrorIllegalAddress (an illegal memory access was encountered) in "
                 "`cudaStreamSynchronize(stream)`"),
    RuntimeError("expected a tensor of shape [8192], got [4096]"),
    ValueError("IPC handle must be 64 bytes, got 3"),
    ConfigError("timeout_s must be >= 0, got -1"),
], ids=["kernel fault", "shape mistake", "bad argument", "config error"])
def test_an_unexpected_custom_all_reduce_failure_on_one_rank_is_raised_on_every_rank(error):
    """A bug met while setting up the custom all-reduce (a kernel fault, a wrong shape, an argument the extension
    refuses, a bad setting) is no reason to use NCCL: it was turned into a silent slow path (every RuntimeError fell
    back), or, not being a RuntimeError, raised on its rank alone while the others fell back and waited for it. The
    failing rank raises its own error; the others raise, naming it."""
    from tpgtest.workers import custom_setup_raising_on

    mine, theirs = run_ranks(custom_setup_raising_on, 2, 1, error, timeout_s=120)[::-1]
    assert mine == ("raised", type(error).__name__, str(error))
    assert theirs[0] == "raised" and theirs[1] == "PeerError"
    assert "rank 1" in theirs[2] and str(error) in theirs[2] and type(error).__name__ in theirs[2]


@pytest.mark.parametrize("failing_call, error, env, named", [
    ("ar_create", RuntimeError("CUDA error cudaErrorMemoryAllocation (out of memory) in `cudaMalloc(&ctx->workspace, "
                               "ctx->layout.total_bytes())`"), None, "cudaErrorMemoryAllocation"),
    ("ipc_get_handle", RuntimeError("CUDA error cudaErrorNotSupported (operation not supported) in "
                                    "`cudaIpcGetMemHandle`"), None, "cudaErrorNotSupported"),
    (None, None, {"NCCL_P2P_DISABLE": "1"}, "NCCL_P2P_DISABLE=1"),
], ids=["no memory for the workspace", "IPC export refused", "P2P disabled on one rank"])
def test_a_custom_all_reduce_refused_before_the_handle_exchange_on_one_rank_sends_every_rank_to_nccl(
        failing_call, error, env, named):
    """The steps of set-up that one rank takes alone before the ranks exchange their workspace handles (its gates,
    allocating and exporting its workspace) raised on that rank alone: it went to the agreement while the others
    waited in set-up's next exchange, which paired with it (the others took its verdict for a handle, then waited
    for it in the next exchange, which it never made). Every rank now learns of it in an exchange of set-up's own
    and falls back, the rank and the reason named."""
    from tpgtest.workers import custom_setup_with_a_fake_extension

    for outcome in run_ranks(custom_setup_with_a_fake_extension, 2, 1, failing_call, error, env, timeout_s=60):
        assert outcome[:2] == ("fell back", False) and "rank 1" in outcome[2] and named in outcome[2], outcome
