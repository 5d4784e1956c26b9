"""Spies on the polled split-K reductions the kernel tests share."""


def spy_polled_rope(monkeypatch) -> list[int]:
    """The sizes of the partials buffers qkv_rope_store took (its polled launches), as it takes them: the buffer
    requests that follow a polled_rope decision of True (linear_small_m's own requests are not counted)."""
    from tpgraph.kernels import gemv

    polled, decided = [], []
    real_decide, real_buffer = gemv.polled_rope, gemv.partials_buffer

    def decide(rows):
        decided.append(real_decide(rows))
        return decided[-1]

    def buffer(device, numel):
        buf = real_buffer(device, numel)
        if decided and decided.pop() and buf is not None:
            polled.append(numel)
        return buf

    monkeypatch.setattr(gemv, "polled_rope", decide)
    monkeypatch.setattr(gemv, "partials_buffer", buffer)
    return polled


def spy_partials(monkeypatch, kernels: str) -> list[int]:
    """The sizes of the partials buffers that tpgraph.kernels.<kernels> took, as it takes them: its polled launches
    (a request that did not fit, and so kept the count, is not counted)."""
    import importlib

    module = importlib.import_module(f"tpgraph.kernels.{kernels}")
    taken, real_buffer = [], module.partials_buffer

    def buffer(device, numel):
        buf = real_buffer(device, numel)
        if buf is not None:
            taken.append(numel)
        return buf

    monkeypatch.setattr(module, "partials_buffer", buffer)
    return taken


def arrive_late(monkeypatch, address: int, late: int | None) -> list[int]:
    """Under the interpreter (which runs programs in order, so every partial is in before its reducer looks): the
    first `late` volatile loads of the fp32 at `address` see the sentinel, as if its writer's store were still on
    its way (None: it never arrives). Returns a list that grows by one at each volatile load of it."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    from tpgraph.kernels._counters import PARTIAL_SENTINEL

    sentinel = np.array([PARTIAL_SENTINEL], dtype=np.int32).view(np.float32)[0]
    real, seen = interpreter.InterpreterBuilder.create_masked_load, []

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        out = real(self, ptrs, mask, other, cache_policy, is_volatile)
        hit = (ptrs.data == address) & mask.data
        if is_volatile and hit.any():
            seen.append(1)
            if late is None or len(seen) <= late:
                out.data[hit] = sentinel
        return out

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", load)
    return seen
