"""Weight loading: each rank reads only its own slices of each checkpoint tensor.

Sources: a Hugging Face safetensors directory (one file or many plus the index JSON), or seeded random
weights for any config (`dummy`, and the built-in default model). Failures on any rank become a
one-line error on every rank, never a hang.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm

from tpgraph.comm import TPCommunicator
from tpgraph.config import BUILTIN_MODEL, ModelConfig
from tpgraph.distributed import ParallelState, run_on_all_ranks
from tpgraph.errors import CheckpointError, ConfigError
from tpgraph.model.llama import LlamaForCausalLM
from tpgraph.model.shards import ShardSpec

logger = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
LOAD_FORMATS = ("auto", "safetensors", "dummy")


class TensorSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored tensor's shape, or None if the source has no such tensor."""

    def read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Only the slice [start, start+length) along dim."""

    def describe(self, name: str) -> str:
        """Where the tensor lives, for error messages."""


def _check_safetensors_file(path: Path) -> None:
    """Catch truncation up front: the header's data offsets must fit inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise CheckpointError(f"{path} is truncated: its header claims {header_len} bytes, file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path} has a corrupt safetensors header") from None
    data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{path} is truncated: its tensors need {8 + header_len + data_end} bytes, the file has {size}"
        )


class SafetensorsSource:
    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self.file_of: dict[str, Path] = {}
        index = model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} is malformed ({exc})") from None
            for name, fname in weight_map.items():
                self.file_of[name] = model_dir / fname
            files = sorted(set(self.file_of.values()))
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard file(s) that are missing: {', '.join(missing)}")
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {model_dir} (only safetensors checkpoints load)")
        for f in files:
            _check_safetensors_file(f)
        self._handles = {}
        if not index.is_file():
            for f in files:
                for name in self._open(f).keys():
                    self.file_of[name] = f

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open {path}: {exc}") from None
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...] | None:
        path = self.file_of.get(name)
        if path is None:
            return None
        handle = self._open(path)
        if name not in handle.keys():
            raise CheckpointError(f"tensor {name!r} is listed in {INDEX_FILE} but absent from {path.name}")
        return tuple(handle.get_slice(name).get_shape())

    def read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        sl = self._open(self.file_of[name]).get_slice(name)
        try:
            if dim == 0:
                return sl[start:start + length]
            return sl[:, start:start + length]
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.file_of[name]}: {exc}") from None

    def describe(self, name: str) -> str:
        path = self.file_of.get(name)
        return str(path) if path else str(self.dir)


class RandomSource:
    """Seeded random weights in checkpoint layout. Each tensor is generated whole from a seed derived
    from its name, then sliced, so any TP size sees the same model."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device, std: float = 0.02) -> None:
        self.cfg, self.seed, self.device, self.std = cfg, seed, device, std

    def shape(self, name: str) -> tuple[int, ...] | None:
        return None  # shapes come from the config

    def read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        raise NotImplementedError  # RandomSource is read through read_full

    def read_full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            return 1.0 + 0.1 * torch.randn(shape, generator=gen)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen, device=self.device) * self.std

    def describe(self, name: str) -> str:
        return f"random weights (seed {self.seed})"


def _copy_slice(spec: ShardSpec, src: torch.Tensor) -> None:
    dst = spec.param.data.narrow(spec.dim, spec.dst_start, spec.length)
    dst.copy_(src)


def load_weights(model: LlamaForCausalLM, source: SafetensorsSource | RandomSource, show_progress: bool) -> None:
    specs = model.shard_specs()
    for spec in tqdm(specs, desc="loading weights", disable=not show_progress, unit="tensor"):
        if isinstance(source, RandomSource):
            full = source.read_full(spec.hf_name, spec.hf_shape)
            _copy_slice(spec, full.narrow(spec.dim, spec.src_start, spec.length))
            continue
        shape = source.shape(spec.hf_name)
        if shape is None:
            raise CheckpointError(f"tensor {spec.hf_name!r} is missing from the checkpoint in {source.dir}")
        if shape != spec.hf_shape:
            raise CheckpointError(
                f"tensor {spec.hf_name!r} in {source.describe(spec.hf_name)} has shape {shape}, expected "
                f"{spec.hf_shape}: is config.json from the same checkpoint?"
            )
        _copy_slice(spec, source.read(spec.hf_name, spec.dim, spec.src_start, spec.length))


def default_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype on GPU; fp32 on CPU (CPU bf16 matmuls are slow and inexact)."""
    if device.type == "cpu":
        return torch.float32
    return {"float16": torch.float16, "float32": torch.float32}.get(cfg.torch_dtype, torch.bfloat16)


def load_model(
    state: ParallelState,
    comm: TPCommunicator,
    model_dir: str | Path | None = None,
    load_format: str = "auto",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    config: ModelConfig | None = None,
) -> LlamaForCausalLM:
    """Build the TP model on this rank and fill it.

    model_dir None loads the built-in default (seeded random weights of BUILTIN_MODEL, or of `config`).
    load_format 'dummy' fills random weights for the directory's config (benchmarks).
    A failure on any rank raises on every rank.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")

    def build() -> LlamaForCausalLM:
        cfg = config or (ModelConfig.from_dir(model_dir) if model_dir is not None else BUILTIN_MODEL)
        cfg.check_tp(state.world_size)
        model = LlamaForCausalLM(cfg, comm, dtype or default_dtype(cfg, state.device), state.device)
        if model_dir is None or load_format == "dummy":
            source: SafetensorsSource | RandomSource = RandomSource(cfg, seed, state.device)
        else:
            source = SafetensorsSource(Path(model_dir))
        load_weights(model, source, show_progress=state.is_driver)
        return model.eval()

    return run_on_all_ranks(state, build, "loading the model")
