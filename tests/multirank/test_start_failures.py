"""A rank whose engine fails to start while the others wait for it in the process group's rendezvous: the others
stop at once with its reason, instead of waiting out the rendezvous's timeout (600 s) for a rank that never comes.
(torchrun ends them too, once the failed rank exits; other launchers, and torchrun across hosts, do not.)"""

import pytest
from tpgtest.spawn import run_ranks
from tpgtest.workers import engine_start_failing_on

from tpgraph.engine.followers import free_tcp_init

PROMPT_S = 15.0  # well under the rendezvous's 600 s (they stop within a second here)


@pytest.mark.parametrize("failing_rank, how, tcp", [
    (1, "config", False),
    (1, "device", False),
    (0, "config", True),  # (rank 0 hosts the rendezvous's store: it stays up until the others have read the failure)
    (2, "device", True),
], ids=["config_refused_on_rank1", "no_gpu_for_rank1", "config_refused_on_rank0_tcp", "no_gpu_for_rank2_of_4_tcp"])
def test_a_rank_failing_before_the_rendezvous_stops_the_others_with_its_reason(failing_rank, how, tcp):
    world = 4 if failing_rank == 2 else 2
    init = free_tcp_init() if tcp else None
    outcomes = run_ranks(engine_start_failing_on, world, failing_rank, how, init, timeout_s=90)
    own = outcomes[failing_rank]
    assert own[0] == "ConfigError" and (("max_model_len" in own[1]) if how == "config" else ("cuda" in own[1]))
    for rank, (kind, message, seconds) in enumerate(outcomes):
        if rank != failing_rank:
            assert kind == "PeerError" and f"rank {failing_rank}" in message and own[1] in message, message
            assert seconds < PROMPT_S

