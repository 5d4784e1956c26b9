"""A front end's request metrics recorded in a process of its own (tpgtest.spawn.run_ranks), as several front ends
(--api-server-count) record them: prometheus-client's multiprocess mode in a shared directory. Nothing here imports
prometheus_client at import time: each process names the directory first, as run_frontend does."""

from __future__ import annotations

# (request id, prompt tokens, max_tokens, tokens generated, finish reason: None, still streaming) per front end
Requests = list[tuple[str, int, int, int, str | None]]


def record_requests(rank: int, world_size: int, init: str, metrics_dir: str, requests: list[Requests],
                    max_model_len: int) -> bytes:
    """Record rank's requests (each sample's tokens, then its end), wait for every rank to have recorded its own,
    and return this rank's /metrics exposition of the request metrics (rank 0's taken first, then rank 1's, ...)."""
    from tpgraph.server.frontend import share_metrics_in

    share_metrics_in(metrics_dir)  # (as run_frontend: before prometheus_client's import)
    import torch.distributed as dist

    from tpgraph.server.metrics import ServerMetrics

    metrics = ServerMetrics(max_model_len=max_model_len, multiprocess_dir=metrics_dir)
    record(metrics, requests[rank])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        dist.barrier()
        for turn in range(world_size):  # (one rank's exposition at a time, in rank order: rank 0's before any other's)
            if turn == rank:
                exposition = metrics.exposition()
            dist.barrier()
        return exposition
    finally:
        dist.destroy_process_group()


def record(metrics: object, requests: Requests) -> None:
    """Each request of one sample: its arrival, its tokens (the last one ending it), its end. One whose finish reason
    is None is a stream still open: its last token comes 10 s after the others, and it does not end."""
    import time

    from tpgraph.engine.updates import StepUpdate

    for rid, prompt, max_tokens, tokens, reason in requests:
        metrics.arrived(rid, prompt, 1, max_tokens)
        start = time.perf_counter()
        for i in range(tokens):
            last = i == tokens - 1
            metrics.observe(StepUpdate(rid, 0, 7, "x", reason if last else None, queue_s=None if i else 0.01,
                                       prefill_s=None if i else 0.02), start + (10.0 if last and not reason else 0.0))
        if reason is not None:
            metrics.finished(rid, reason)
