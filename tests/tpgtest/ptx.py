"""Checks on PTX compiled ahead of time (no GPU needed)."""


def assert_semaphore_order(ptx: str) -> None:
    """The last-arriving pattern as it must reach the GPU: the block's stores, a barrier, the acq_rel arrival count
    by one thread, its result through shared memory behind a barrier, and only then the loads of the other
    programs' partials."""
    atom = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[:atom][-2000:]  # the barrier just before the count
    after = ptx[atom:]
    first_partial = after.index("ld.global.cg")
    shared_store, barrier, shared_load = (after.index("st.shared"), after.index("bar.sync"), after.index("ld.shared"))
    assert shared_store < barrier < shared_load < first_partial

