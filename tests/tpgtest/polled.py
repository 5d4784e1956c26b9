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
