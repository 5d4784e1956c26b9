"""Driving a Scheduler without a model: what the runner and sampler would do with a scheduled step."""


def run_step(step) -> None:
    """Cache the scheduled tokens, and add a token where a prompt completed or a sequence decoded."""
    for s, n in step.prefill:
        s.num_cached += n
        if s.num_uncached == 0:
            s.output_ids.append(7)
    for s in step.decode:
        s.num_cached += 1
        s.output_ids.append(7)
