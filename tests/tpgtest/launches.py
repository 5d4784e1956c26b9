"""A spy on a module's Triton kernel launches that the kernel tests share."""


def spy_launches(monkeypatch, module, name: str, keys: tuple[str, ...]) -> list[tuple]:
    """From now on, each launch of module.<name> (kernel[grid](...)) appends the values of its keyword arguments
    `keys`, as a tuple, to the returned list, then runs the real kernel."""
    seen: list[tuple] = []
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(tuple(kwargs[k] for k in keys))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, Spy())
    return seen
