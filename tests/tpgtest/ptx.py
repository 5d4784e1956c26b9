"""Kernels compiled ahead of time for sm_90 (no GPU needed), and checks on their PTX."""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

# One compiler process a test worker, asked a JSON line at a time: a process a kernel spent most of its CPU importing
# torch and Triton. It runs outside the tests' interpreter mode (TRITON_INTERPRET=1 has no compiler or launcher).
_SERVER = r"""
import importlib, json, os, sys, traceback
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # (whatever the compiler prints stays off the replies)


def compile_kernel(module, kernel, typed, scalars, constexprs, options, divisible, cubin):
    signature = {**typed, **{name: "i32" for name in scalars}, **{name: "constexpr" for name in constexprs}}
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    fn = getattr(importlib.import_module(module), kernel)
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    if cubin:
        open(cubin, "wb").write(compiled.asm["cubin"])
    return compiled.asm["ptx"]


def specialize(module, kernel, typed, constexprs, calls):
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature
    fn = getattr(importlib.import_module(module), kernel)
    binder = create_function_from_signature(fn.signature, fn.params, CUDABackend(GPUTarget("cuda", 90, 32)))
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "i32": torch.int32,
              "i64": torch.int64}
    pointers = {name: torch.empty(64, dtype=dtypes[kind.lstrip("*")]) for name, kind in typed.items()}
    return [repr(binder(**pointers, **scalars, **constexprs)[1]) for scalars in calls]


for line in sys.stdin:
    op, path, args = json.loads(line)
    sys.path[:0] = [entry for entry in path if entry not in sys.path]
    try:
        reply = {"out": (compile_kernel if op == "compile" else specialize)(*args)}
    except BaseException as exc:
        reply = {"error": traceback.format_exc(), "kind": type(exc).__name__}
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
"""


# a request's reply time past which the compiler is taken for hung (the slowest kernels compile in seconds; a loaded
# machine running many workers can take minutes)
REPLY_TIMEOUT_S = 300.0


class _Compiler:
    """The worker's compiler process, started at its first request and again if it died or was killed for a request it
    did not answer within `timeout_s` (a hung compile then fails its test by name, not hangs the run)."""

    def __init__(self, server: str = _SERVER, timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self.server, self.timeout_s = server, timeout_s
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        atexit.register(self.close)

    def ask(self, op: str, args: list, what: str | None = None) -> dict:
        """The reply to one request; `what` names it in the timeout's message (default: the op)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
                # (a session of its own: a kill takes the ptxas a hung compile may be waiting on too)
                self.proc = subprocess.Popen([sys.executable, "-c", self.server], env=env, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                             start_new_session=True)
            # the caller's PYTHONPATH as it is now (tests add bench/ to it for bench's kernels)
            path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
            self.proc.stdin.write(json.dumps([op, path, args]) + "\n")
            self.proc.stdin.flush()
            line = self._reply()
            if line is None:
                self._kill()
                raise TimeoutError(f"the kernel compiler process gave no reply in {self.timeout_s:g} s to "
                                   f"{what or op}: killed (the next request starts a new one)")
        if not line:
            raise RuntimeError("the kernel compiler process died")
        return json.loads(line)

    def _reply(self) -> str | None:
        """The process's next line ("" at its end), or None if none came within the timeout. Read by a thread that
        the wait can give up on (a pipe's readline takes no timeout); a kill then ends its read."""
        got: list[str] = []
        reader = threading.Thread(target=lambda out=self.proc.stdout: got.append(out.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout_s)
        return got[0] if got else None

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # (ended by itself meanwhile)
            pass
        self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Ends the process (at exit; tests' own instances)."""
        if self.proc is not None:
            self._kill()


_compiler = _Compiler()


def sm90_ptx(module: str, kernel: str, typed: dict[str, str], scalars: list[str], constexprs: dict,
             num_warps: int = 4, num_stages: int = 3, divisible: tuple[str, ...] = ()) -> str:
    """PTX of `module.kernel` for sm_90. Its arguments in order: `typed` with their Triton types ("*bf16", "fp32"),
    then `scalars` (i32), then the constexprs; `divisible`: the arguments known to be multiples of 16 (as Triton
    specializes them at run time: pointers and sizes, for vector loads)."""
    return _compile(module, kernel, typed, scalars, constexprs, num_warps, num_stages, divisible)


def _compile(module: str, kernel: str, typed: dict[str, str], scalars: list[str], constexprs: dict, num_warps: int,
             num_stages: int, divisible: tuple[str, ...], cubin: str = "") -> str:
    """The kernel's PTX (see sm90_ptx); with `cubin`, its cubin written to that path too."""
    pytest.importorskip("triton.backends.nvidia")
    reply = _compiler.ask("compile", [module, kernel, typed, scalars, constexprs,
                                      {"num_warps": num_warps, "num_stages": num_stages}, list(divisible), cubin],
                          what=f"compile {module}.{kernel} for sm_90")
    if "error" in reply:
        raise RuntimeError(f"compiling {module}.{kernel} for sm_90 failed:\n{reply['error']}")
    return reply["out"]


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


def launch_specializations(module: str, kernel: str, typed: dict[str, str], constexprs: dict,
                           calls: list[dict[str, int]]) -> list[str]:
    """For each dict of integer arguments in `calls`, what Triton keys a launch of `module.kernel` on sm_90 by (its
    arguments' types and specialisations; pointers as 16-byte aligned tensors of `typed`'s dtypes): launches with
    different keys compile apart. Skips where this Triton binds arguments another way."""
    pytest.importorskip("triton.backends.nvidia")
    reply = _compiler.ask("specialize", [module, kernel, typed, constexprs, calls],
                          what=f"specialize {module}.{kernel}")
    if reply.get("kind") in ("ImportError", "AttributeError"):
        pytest.skip(f"this Triton binds launch arguments another way: {reply['error'].strip().splitlines()[-1]}")
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return reply["out"]


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
