"""A spy on a module's Triton kernel launches that the kernel tests share."""


def spy_launches(monkeypatch, module, name: str, keys: tuple[str, ...] = (), record=None, run: bool = True) -> list:
    """From now on, each launch of module.<name> (kernel[grid](...)) appends the values of its keyword arguments
    `keys`, as a tuple, to the returned list (or what `record(grid, args, kwargs)` returns), then runs the real kernel
    (run False: does not, where nothing could run it)."""
    seen: list = []
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(record(grid, args, kwargs) if record else tuple(kwargs[k] for k in keys))
                return real[grid](*args, **kwargs) if run else None
            return launch

    monkeypatch.setattr(module, name, Spy())
    return seen
