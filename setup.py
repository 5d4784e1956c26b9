"""Build tpgraph._C: CUDA sources compiled by nvcc, driven by ninja, bound with pybind11.

The extension has no libtorch linkage: raw device pointers and stream handles cross the boundary,
and it links the static CUDA runtime. Without nvcc the package still installs (with a warning) and
any call that needs the extension raises an error that names the fix.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
DEFAULT_ARCHS = "90a;100a"  # SM90 (H100/H200) and SM100 (B200); override with TPGRAPH_CUDA_ARCHS


def find_nvcc() -> Path | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found).resolve() if found else None


def cuda_archs() -> str:
    """TPGRAPH_CUDA_ARCHS (unset or blank: DEFAULT_ARCHS), each entry an arch as nvcc names it (90a, 100a), refused by
    the variable's name otherwise: torch's "9.0a" failed in nvcc as compute_9.0a, naming no variable, and a blank
    value built for nvcc's default arch, which none of the kernels run on."""
    text = os.environ.get("TPGRAPH_CUDA_ARCHS", "").strip()
    archs = [arch.strip() for arch in text.split(";") if arch.strip()]
    for arch in archs:
        if not re.fullmatch(r"\d{2,3}[af]?", arch):
            raise SystemExit(f"error: TPGRAPH_CUDA_ARCHS={text!r}: {arch!r} is no CUDA arch as nvcc names it: give "
                             f"entries such as 90a (sm_90a) or 100a, joined by ';' (default {DEFAULT_ARCHS!r})")
    return ";".join(archs) or DEFAULT_ARCHS


def gencode_flags(archs: str) -> list[str]:
    flags = []
    for arch in filter(None, (a.strip() for a in archs.split(";"))):
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def build_folder(archs: str, pybind11_version: str) -> Path:
    """The ninja folder kept between builds: one per set of archs, Python ABI (the Python headers every object
    includes; SOABI names version, debug and free-threaded builds and the platform) and pybind11 (its headers and the
    internals ABI it stamps). Keyed by archs alone, two Pythons' builds in one checkout rebuilt each other's objects,
    or clobbered them when run at once. No torch header is compiled: torch's version changes no object."""
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    return ROOT / "build" / f"tpgraph_C-{archs.replace(';', '_')}-{abi}-pybind11-{pybind11_version}"


class NinjaNvccBuild(build_ext):
    """Writes a build.ninja for the CUDA/C++ sources and runs ninja on it."""

    def build_extension(self, ext: Extension) -> None:
        nvcc = find_nvcc()
        if nvcc is None:
            warnings.warn(
                "nvcc not found: installing tpgraph WITHOUT its CUDA extension (tpgraph._C). "
                "CPU paths work; the custom all-reduce and IPC need it. Put nvcc on PATH (or set "
                "CUDA_HOME) and reinstall.",
                stacklevel=1,
            )
            return
        import pybind11

        archs = cuda_archs()
        # a build folder that outlives the build (build_folder: one per archs, Python ABI and pybind11): editable
        # installs build in a temporary folder, so each reinstall (and the wheel after it) compiled every source
        # again; here ninja rebuilds only what changed
        build_dir = build_folder(archs, pybind11.__version__)
        build_dir.mkdir(parents=True, exist_ok=True)
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)

        # pybind11's headers through a link in the folder: an isolated build's pybind11 lives in a temporary folder,
        # and a new path in the command would rebuild every object
        headers = build_dir / "pybind11_include"
        headers.unlink(missing_ok=True)
        headers.symlink_to(pybind11.get_include(), target_is_directory=True)
        includes = [str(headers), sysconfig.get_paths()["include"], str(CSRC)]
        inc = " ".join(f"-I{p}" for p in includes)
        cxx = os.environ.get("CXX", "c++")
        arch_macro = f"'-DTPGRAPH_ARCHS=\"{archs.replace(';', ',')}\"'"
        nvcc_flags = " ".join(["-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC",
                               "-Xcompiler", "-fvisibility=hidden", arch_macro, *gencode_flags(archs)])
        cxx_flags = "-O2 -std=c++17 -fPIC -fvisibility=hidden"

        objs, lines = [], [
            # (each object's headers in a depfile: the folder stays, so an edited header must rebuild its users)
            f"rule nvcc\n  command = {nvcc} {nvcc_flags} {inc} -MD -MF $out.d -c $in -o $out\n  depfile = $out.d"
            "\n  deps = gcc\n  description = NVCC $in",
            f"rule cxx\n  command = {cxx} {cxx_flags} {inc} -MD -MF $out.d -c $in -o $out\n  depfile = $out.d"
            "\n  deps = gcc\n  description = CXX $in",
            # nvcc links: it knows where its own static runtime lives.
            f"rule link\n  command = {nvcc} -shared --cudart static $in -o $out"
            "\n  description = LINK $out",
        ]
        for src in ext.sources:
            src_path = ROOT / src
            obj = build_dir / (src_path.name + ".o")
            rule = "nvcc" if src_path.suffix == ".cu" else "cxx"
            lines.append(f"build {obj}: {rule} {src_path}")
            objs.append(str(obj))
        lines.append(f"build {out}: link {' '.join(objs)}")
        (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")
        print(f"tpgraph: building {ext.name} with {nvcc} for sm_{archs.replace(';', ', sm_')}", flush=True)
        subprocess.run([sys.executable, "-m", "ninja", "-v", "-C", str(build_dir)], check=True)


setup(
    # configs/ (the all-reduce and GEMV tables) ships inside the package as tpgraph/configs, so a wheel or
    # `pip install .` reads the same tables as a checkout
    packages=find_packages(include=["tpgraph*"]) + ["tpgraph.configs", "tpgraph.configs.allreduce",
                                                    "tpgraph.configs.gemv"],
    package_dir={"tpgraph.configs": "configs"},
    package_data={"tpgraph": ["py.typed"], "tpgraph.configs.allreduce": ["*.json"], "tpgraph.configs.gemv": ["*.json"]},
    ext_modules=[
        Extension(
            "tpgraph._C",
            sources=["csrc/device.cu", "csrc/ipc.cu", "csrc/ar_context.cu", "csrc/push.cu", "csrc/push_norm.cu",
                     "csrc/pull.cu",
                     "csrc/multicast.cu", "csrc/bindings.cpp"],
        )
    ],
    cmdclass={"build_ext": NinjaNvccBuild},
)
