"""Triton's interpreter (TRITON_INTERPRET=1, the CPU tests' kernels) made faster where it is slow for no reason.

A launch patches triton.language's builtins into numpy ones (inspect.getmembers over its modules) and restores them
when its programs end. Triton 3.x also redoes that patching on every call of a @triton.jit device function inside the
launch, though nothing is left to patch: a third of the CPU kernel tests' time went there (tests/unit
test_fused_sampling.py's draws: 53,213 calls, 36 of 100 s under cProfile). Here a call made while a launch's patching
stands skips it; the launch's own patching, and its restoring, are Triton's.

Its reductions run numpy's for max, min, sum and argmax, but any other combine function one element at a time in
Python. tl.sort's compare-and-swap steps reduce with an xor (standard._xor_combine), so a sort of a few thousand
keys took seconds (tests/unit/test_top_k_kernel.py: 50 of 64 s in that loop). Here the bitwise combines of
triton.language.standard (xor, or) reduce with numpy's bitwise ones: exact for integers, in any order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def patch_language_once_a_launch() -> bool:
    """Install the skip; False where this Triton's interpreter lacks the hooks (then nothing changes)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch: Callable | None = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    launcher = getattr(interpreter, "GridExecutor", None)
    if patch is None or scope_type is None or launcher is None or getattr(patch, "once_a_launch", False):
        return False
    languages = (tl, tl.core)  # the modules Triton patches, where a function's globals name them
    patched: set[int] | None = None  # (inside a launch) the language modules patched so far
    named_by: dict[object, frozenset[int]] = {}  # a function's language modules, read from its globals once
    run = launcher.__call__

    def run_marked(self, *args, **kwargs):
        nonlocal patched
        patched = set()
        try:
            return run(self, *args, **kwargs)
        finally:
            patched = None

    def patch_once(fn):
        if patched is None:
            return patch(fn)  # (outside a launch: as Triton does)
        named = named_by.get(fn)
        if named is None:
            named = named_by[fn] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in languages))
        if named and named <= patched:
            return scope_type()  # this launch patched these modules already
        patched.update(named)
        return patch(fn)

    patch_once.once_a_launch = True
    launcher.__call__ = run_marked
    interpreter._patch_lang = patch_once
    return True


def reduce_bitwise_with_numpy() -> bool:
    """Install numpy's xor and or reductions for standard's combines; False where this Triton lacks the hooks."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    reducer = getattr(interpreter, "ReduceOps", None)
    standard = getattr(tl, "standard", None)
    bitwise = {getattr(standard, name, None): ufunc for name, ufunc in
               (("_xor_combine", np.bitwise_xor), ("_or_combine", np.bitwise_or))}
    bitwise.pop(None, None)
    if reducer is None or not bitwise or getattr(reducer.apply_impl, "bitwise_by_numpy", False):
        return False
    apply = reducer.apply_impl

    def apply_bitwise(self, input):
        ufunc = bitwise.get(self.combine_fn)
        if ufunc is None or len(input) != 1:
            return apply(self, input)
        data = input[0].handle.data
        return self.to_tensor(ufunc.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)

    apply_bitwise.bitwise_by_numpy = True
    reducer.apply_impl = apply_bitwise
    return True
