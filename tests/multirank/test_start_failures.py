"""A rank whose engine fails to start while the others wait for it in the process group's rendezvous: the others
stop at once with its reason, instead of waiting out the rendezvous's timeout (600 s) for a rank that never comes.
(torchrun ends them too, once the failed rank exits; other launchers, and torchrun across hosts, do not.)"""

import pytest
from tpgtest.spawn import run_ranks
from tpgtest.workers import (
    a_failed_start_retried_in_a_kept_store,
    engine_failing_after_joining_on,
    engine_start_failing_on,
    engine_start_failing_with_a_slow_store_on,
    process_groups_in_a_kept_store,
)

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



def test_the_rank_hosting_the_store_stays_until_the_last_rank_is_done_with_it():
    """Rank 0 hosts the rendezvous's store (tcp://). Failing its start, it stayed only until every rank had counted
    itself done, and its store went while the last rank still cleared the start's keys: that rank's next request met
    the lost connection, raised instead of rank 0's reason. (That rank's requests are slowed here, as on a loaded
    host.)"""
    outcomes = run_ranks(engine_start_failing_with_a_slow_store_on, 2, 0, "config", free_tcp_init(), 1, timeout_s=90)
    assert outcomes[0][0] == "ConfigError", outcomes
    kind, message, seconds = outcomes[1]
    assert kind == "PeerError" and "rank 0" in message and outcomes[0][1] in message, outcomes
    assert seconds < PROMPT_S

@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_rank_failing_after_the_process_group_formed_stops_the_others_with_its_reason(failing_rank):
    """Once the group has formed, the others meet the failed rank's absence in their next collective (gloo: the
    connection closed by the peer, at once) and raised that, with nothing of the failed rank's reason: it now leaves
    its error in the group's store before it leaves, and they raise it, naming the rank."""
    outcomes = run_ranks(engine_failing_after_joining_on, 2, failing_rank, timeout_s=90)
    own = outcomes[failing_rank]
    assert own[0] == "ConfigError" and "KV cache cannot be sized" in own[1]
    kind, message, seconds = outcomes[1 - failing_rank]
    assert kind == "PeerError" and f"rank {failing_rank}" in message and own[1] in message, message
    assert seconds < 60.0


def test_process_groups_one_after_another_in_a_store_that_stays_each_form():
    """Under torchrun every process group of a job meets in its agent's store, which keeps the keys of the groups
    before (a second TPEngine after the first was closed): gloo took a peer's address from the last group before the
    peer wrote its new one, and one rank waited for good on a connection that never came (1 in 3 starts of a second
    engine hung). Each start's group now keeps its keys under a prefix of its own."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    rounds = 12
    assert run_ranks(process_groups_in_a_kept_store, 2, store.port, rounds, timeout_s=120) == [rounds, rounds]


def test_a_rank_starting_again_after_its_failed_start_waits_until_the_others_have_read_it():
    """A rank whose start failed returned at once, and its next start posted over its failure in the store (a store
    that stays: torchrun's agent's): a rank coming later read that post as this start's and went on into a process
    group of its own, and the last rank done deleted the second start's posts with the first's: every rank then waited
    out its timeout. The failed rank now returns once every rank has read its failure."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    late, failed = run_ranks(a_failed_start_retried_in_a_kept_store, 2, store.port, 1, 1.0, timeout_s=120)
    assert failed[0][0] == "ConfigError" and "tpu" in failed[0][1] and failed[1:] == [[0, 1]], failed
    assert late[0][0] == "PeerError" and "rank 1 failed to start: ConfigError" in late[0][1], late
    assert late[1:] == [[0, 1]], late
