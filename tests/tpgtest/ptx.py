"""Kernels compiled ahead of time for sm_90 (no GPU needed), and checks on their PTX."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, kernel, typed, scalars, constexprs, options, divisible, cubin = json.loads(sys.argv[1])
signature = {**typed, **{name: "i32" for name in scalars}, **{name: "constexpr" for name in constexprs}}
names = list(signature)
attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
fn = getattr(importlib.import_module(module), kernel)
compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)
print(compiled.asm["ptx"])
if cubin:
    open(cubin, "wb").write(compiled.asm["cubin"])
"""


def sm90_ptx(module: str, kernel: str, typed: dict[str, str], scalars: list[str], constexprs: dict,
             num_warps: int = 4, num_stages: int = 3, divisible: tuple[str, ...] = ()) -> str:
    """PTX of `module.kernel` for sm_90. Its arguments in order: `typed` with their Triton types ("*bf16", "fp32"),
    then `scalars` (i32), then the constexprs; `divisible`: the arguments known to be multiples of 16 (as Triton
    specializes them at run time: pointers and sizes, for vector loads). In a subprocess: the tests' interpreter mode
    (TRITON_INTERPRET=1) has no compiler."""
    return _compile(module, kernel, typed, scalars, constexprs, num_warps, num_stages, divisible)


def _compile(module: str, kernel: str, typed: dict[str, str], scalars: list[str], constexprs: dict, num_warps: int,
             num_stages: int, divisible: tuple[str, ...], cubin: str = "") -> str:
    """The kernel's PTX (see sm90_ptx); with `cubin`, its cubin written to that path too."""
    pytest.importorskip("triton.backends.nvidia")
    args = json.dumps([module, kernel, typed, scalars, constexprs,
                       {"num_warps": num_warps, "num_stages": num_stages}, list(divisible), cubin])
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    return subprocess.run([sys.executable, "-c", _COMPILE, args], env=env, capture_output=True, text=True,
                          check=True).stdout


def sm90_ptx_and_usage(module: str, kernel: str, typed: dict[str, str], scalars: list[str], constexprs: dict,
                       num_warps: int = 4, num_stages: int = 3,
                       divisible: tuple[str, ...] = ()) -> tuple[str, dict[str, int]]:
    """sm90_ptx's PTX, and what ptxas gave that build, as the cuobjdump that Triton ships reads it from the cubin:
    registers a thread ("REG") and the stack frame, where ptxas puts spilled registers ("STACK"). Mark in `divisible`
    every argument the launch would pass as a multiple of 16: unmarked, loads stay scalar and the count can be far
    above the real one (the qkv + rope kernel at 32 rows: 254 registers unmarked, 80 marked;
    bench/results/2026-12-03_h200_wide_rows)."""
    triton = pytest.importorskip("triton")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.isfile(tool):
        pytest.skip("this Triton ships no cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        ptx = _compile(module, kernel, typed, scalars, constexprs, num_warps, num_stages, divisible, cubin)
        report = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    return ptx, {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", report)}


_SPECIALIZE = """
import importlib, json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import create_function_from_signature
module, kernel, typed, constexprs, calls = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), kernel)
binder = create_function_from_signature(fn.signature, fn.params, CUDABackend(GPUTarget("cuda", 90, 32)))
dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "i32": torch.int32, "i64": torch.int64}
pointers = {name: torch.empty(64, dtype=dtypes[kind.lstrip("*")]) for name, kind in typed.items()}
print(json.dumps([repr(binder(**pointers, **scalars, **constexprs)[1]) for scalars in calls]))
"""


def launch_specializations(module: str, kernel: str, typed: dict[str, str], constexprs: dict,
                           calls: list[dict[str, int]]) -> list[str]:
    """For each dict of integer arguments in `calls`, what Triton keys a launch of `module.kernel` on sm_90 by (its
    arguments' types and specialisations; pointers as 16-byte aligned tensors of `typed`'s dtypes): launches with
    different keys compile apart. Without a GPU, in a subprocess (the tests' interpreter mode has no launcher); skips
    where this Triton binds arguments another way."""
    pytest.importorskip("triton.backends.nvidia")
    args = json.dumps([module, kernel, typed, constexprs, calls])
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", _SPECIALIZE, args], env=env, capture_output=True, text=True)
    if run.returncode and ("ImportError" in run.stderr or "AttributeError" in run.stderr):
        pytest.skip(f"this Triton binds launch arguments another way: {run.stderr.strip().splitlines()[-1]}")
    if run.returncode:
        raise RuntimeError(run.stderr)
    return json.loads(run.stdout)


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


def gemv_signature(dtype: str, out: str, counter: str = "i32") -> dict[str, str]:
    """gemv._gemv_kernel's arguments before its constexprs, typed."""
    return {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{out}", "y_ptr": f"*{dtype}",
            "counter_ptr": f"*{counter}", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
            "stride_om": "i32", "stride_os": "i32", "ch_ptr": "*i64", "res_ptr": f"*{dtype}", "nw_ptr": f"*{dtype}",
            "rout_ptr": f"*{dtype}", "xs_ptr": f"*{dtype}", "sq_ptr": "*fp32", "tiles": "i32", "slot_elems": "i32",
            "timeout_ns": "i64", "eps": "fp32", "mean_scale": "fp32"}


# the constexprs of a gemv kernel without a fused all-reduce on either side
NO_ALL_REDUCE = {"ALL_REDUCE": False, "STAGED": False, "WS": 1, "RANK": 0, "PIECES": 1, "EARLY_TRIGGER": True,
                 "RES_EARLY": False, "RESIDENT": False, "POLLED": False}


_INSTRUCTION = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.]*)\s+([^;]*);")
_REGISTER = re.compile(r"%\w+")
_NO_DESTINATION = ("st.", "red.", "bar", "bra", "prefetch", "cp.async", "griddepcontrol", "trap", "ret", "fence",
                   "membar")


def _defined(op: str, operands: str) -> list[str]:
    """The registers an instruction writes: a load's whole {...} list, else its first operand; none for a store,
    reduction, barrier, branch or prefetch."""
    if op.startswith(_NO_DESTINATION):
        return []
    braced = re.match(r"\s*\{([^}]*)\}", operands)
    return _REGISTER.findall(braced.group(1)) if braced else _REGISTER.findall(operands)[:1]


def branch_sources(ptx: str) -> list[set[str]]:
    """For each conditional branch, the opcodes of the instructions its predicate is computed from through registers
    (not through memory): each register's last definition above its use and that definition's guard, followed back
    to loads and constants. A count that reached a branch only through shared memory shows `ld.shared` and none of
    the global loads it counted. (Straight-line and loop-entry flow: a value carried round a loop from below the
    branch is not followed, nor is control flow.)"""
    lines = [m for line in ptx.splitlines() if (m := _INSTRUCTION.match(line))]
    found = []
    for at, m in enumerate(lines):
        if not (m.group(1) and m.group(2).startswith("bra")):
            continue
        opcodes, wanted, seen = set(), [(at, m.group(1).strip().lstrip("@!"))], set()
        while wanted:
            use, reg = wanted.pop()
            for back in range(use - 1, -1, -1):
                guard, op, operands = lines[back].groups()
                defined = _defined(op, operands)
                if reg in defined:
                    opcodes.add(op)
                    if (back, reg) not in seen and not op.startswith("ld."):
                        seen.add((back, reg))
                        wanted.extend((back, r) for r in _REGISTER.findall(operands) if r not in defined)
                    if guard and (back, guard) not in seen:
                        seen.add((back, guard))
                        wanted.append((back, guard.strip().lstrip("@!")))
                    break
        found.append(opcodes)
    return found
