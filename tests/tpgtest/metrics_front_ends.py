"""A front end's request metrics recorded in a process of its own (tpgtest.spawn.run_ranks), as several front ends
(--api-server-count) record them: prometheus-client's multiprocess mode in a shared directory. Nothing here imports
prometheus_client at import time: each process names the directory first, as run_frontend does."""

from __future__ import annotations

# (request id, prompt tokens, max_tokens, tokens generated, finish reason) per front end
Requests = list[tuple[str, int, int, int, str]]


def record_requests(rank: int, world_size: int, init: str, metrics_dir: str, requests: list[Requests],
                    max_model_len: int) -> bytes:
    """Record rank's requests (each sample's tokens, then its end), wait for every rank to have recorded its own,
    and return this rank's /metrics exposition of the request metrics."""
    from tpgraph.server.frontend import share_metrics_in

    share_metrics_in(metrics_dir)  # (as run_frontend: before prometheus_client's import)
    import torch.distributed as dist

    from tpgraph.server.metrics import ServerMetrics

    metrics = ServerMetrics(max_model_len=max_model_len, multiprocess_dir=metrics_dir)
    record(metrics, requests[rank])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        dist.barrier()
        return metrics.exposition()
    finally:
        dist.destroy_process_group()


def record(metrics: object, requests: Requests) -> None:
    """Each request of one sample: its arrival, its tokens (the last one ending it), its end."""
    from tpgraph.engine.core import StepUpdate

    for rid, prompt, max_tokens, tokens, reason in requests:
        metrics.arrived(rid, prompt, 1, max_tokens)
        for i in range(tokens):
            metrics.observe(StepUpdate(rid, 0, 7, "x", reason if i == tokens - 1 else None, queue_s=0.01 if not i
                                       else None, prefill_s=0.02 if not i else None))
        metrics.finished(rid, reason)
