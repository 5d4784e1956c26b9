"""Weight loading: each rank reads only its own slices of each checkpoint tensor.

Sources: a Hugging Face safetensors directory (one file or many plus the index JSON), PyTorch .bin weights where it
holds no safetensors (as vLLM falls back to them), or seeded random weights for any config (`dummy`, and the
built-in default model). Failures on any rank become a one-line error on every rank, never a hang.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm

from tpgraph.comm import TPCommunicator
from tpgraph.config import BUILTIN_MODEL, DTYPE_NAMES, LOAD_FORMATS, ModelConfig, torch_dtype_name
from tpgraph.distributed import ParallelState, run_on_all_ranks
from tpgraph.errors import CheckpointError, ConfigError
from tpgraph.model.llama import LlamaForCausalLM
from tpgraph.model.shards import ShardSpec

logger = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
BASE_PREFIX = "model."  # LlamaForCausalLM's name for its base model (LlamaModel), before every tensor's but lm_head's
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors names of the dtypes a checkpoint may store weights in
PICKLED_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}
TRAINING_FILES = ("training_args.bin", "optimizer.bin")  # .bin files a fine-tune's trainer saves that hold no weights
# buffers older Llama checkpoints saved beside the weights, which the model computes itself
RECOMPUTED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
UNUSED_SHOWN = 8  # unused tensors a warning names (then how many more)


class TensorSource(Protocol):
    def read_shard(self, spec: ShardSpec) -> torch.Tensor:
        """This rank's slice of spec.hf_name (and only that slice), checked against spec.hf_shape."""


def _check_safetensors_file(path: Path) -> None:
    """Catch truncation up front: the header's data offsets must fit inside the file."""
    try:
        size = path.stat().st_size
        f = path.open("rb")
    except OSError as exc:  # (a link to nothing, a file it may not read: named, not a traceback)
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    with f:
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


class _PickledTensor:
    """A tensor of a .bin file, read as a safetensors slice is (get_shape, get_dtype, indexing)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return PICKLED_DTYPES.get(self.tensor.dtype, str(self.tensor.dtype).removeprefix("torch."))

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.tensor[index]


class _PickledFile:
    """A PyTorch .bin weights file (transformers' pytorch_model*.bin) read as safe_open's handle is: memory-mapped,
    so each rank reads the pages of its own slices (a legacy, pre-zip file is read whole), and unpickled with
    weights_only, which runs none of the file's code (as vLLM loads them)."""

    def __init__(self, path: Path) -> None:
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # (the legacy format cannot be mapped)
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # (pickle's, zipfile's and torch's own error types)
            raise CheckpointError(f"cannot read {path} as PyTorch weights: {type(exc).__name__}: {exc}") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise CheckpointError(f"{path} holds no state dict of tensors (a .bin file of other data?)")
        self.state = state

    def keys(self) -> Iterable[str]:
        return self.state.keys()

    def get_slice(self, name: str) -> _PickledTensor:
        return _PickledTensor(self.state[name])


class SafetensorsSource:
    """A checkpoint directory's weights: its safetensors files, else its PyTorch .bin files."""

    def __init__(self, model_dir: Path, pickles: bool = True) -> None:
        """pickles False: safetensors files alone (load_format "safetensors")."""
        self.dir = model_dir
        self.file_of: dict[str, Path] = {}
        index = model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is malformed ({type(exc).__name__}: {exc})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index} is malformed: its weight_map must map tensor names to file names")
            for name, fname in weight_map.items():
                self.file_of[name] = model_dir / fname
            files = sorted(set(self.file_of.values()))
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard file(s) that are missing: {', '.join(missing)}")
        else:
            # (as vLLM's "auto" load format: safetensors where there are any, else .bin files, every one of them but
            # those a trainer saves beside the weights)
            files = sorted(model_dir.glob("*.safetensors")) or sorted(
                f for f in model_dir.glob("*.bin") if pickles and f.name not in TRAINING_FILES)
            if not files:
                raise CheckpointError(f"no *.safetensors files in {model_dir}" if not pickles else
                                      f"no *.safetensors or PyTorch *.bin weights files in {model_dir}")
        for f in files:
            if f.suffix == ".safetensors":
                _check_safetensors_file(f)
        self._handles = {}
        if not index.is_file():
            for f in files:
                for name in self._open(f).keys():
                    self.file_of[name] = f
        # the name each tensor has in its file, where it is not the one the model asks for
        self.stored: dict[str, str] = {}
        # a name saved without the base model's prefix (LlamaModel's, as a base model saves them) is also read under
        # it: transformers adds the prefix name by name, where the model holds the name under it (never lm_head's)
        # and the checkpoint does not hold the prefixed name itself
        for name in [n for n in self.file_of if not n.startswith((BASE_PREFIX, "lm_head."))]:
            if BASE_PREFIX + name not in self.file_of:
                self.stored[BASE_PREFIX + name] = name
                self.file_of[BASE_PREFIX + name] = self.file_of[name]

    def _open(self, path: Path):
        if path not in self._handles and path.suffix == ".bin":
            self._handles[path] = _PickledFile(path)
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
        if self.stored.get(name, name) not in self._open(path).keys():
            raise CheckpointError(f"tensor {self._named(name)} is listed in {INDEX_FILE} but absent from {path.name}")
        return tuple(self._slice(name).get_shape())

    def _named(self, name: str) -> str:
        """A tensor as an error names it: by its name in its file (and the model's, where that is another)."""
        stored = self.stored.get(name, name)
        return repr(name) if stored == name else f"{stored!r} (read as {name!r})"

    def _slice(self, name: str):
        """The lazily read tensor `name` (as the model names it) in its file."""
        return self._open(self.file_of[name]).get_slice(self.stored.get(name, name))

    def read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        sl = self._slice(name)
        try:
            if dim == 0:
                return sl[start:start + length]
            return sl[:, start:start + length]
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {self._named(name)} from {self.file_of[name]}: {exc}") from None

    def same_values(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether tensors a and b hold equal values, read a block of rows at a time (never two whole tensors)."""
        shape = self.shape(a)
        if shape is None or shape != self.shape(b):
            return False
        return all(torch.equal(self.read(a, 0, start, rows), self.read(b, 0, start, rows))
                   for start in range(0, shape[0], rows))

    def read_shard(self, spec: ShardSpec) -> torch.Tensor:
        shape = self.shape(spec.hf_name)
        if shape is None:
            raise CheckpointError(f"tensor {spec.hf_name!r} is missing from the checkpoint in {self.dir}")
        if shape != spec.hf_shape:
            raise CheckpointError(
                f"tensor {self._named(spec.hf_name)} in {self.file_of[spec.hf_name]} has shape {shape}, expected "
                f"{spec.hf_shape}: is config.json from the same checkpoint?"
            )
        stored = self._slice(spec.hf_name).get_dtype()
        if stored not in FLOAT_DTYPES:  # (a quantized weight cast to float without its scales is silently wrong)
            raise CheckpointError(f"tensor {self._named(spec.hf_name)} in {self.file_of[spec.hf_name]} is stored as "
                                  f"{stored}; tpgraph loads {', '.join(FLOAT_DTYPES)} weights (quantized checkpoints "
                                  f"are not supported)")
        return self.read(spec.hf_name, spec.dim, spec.src_start, spec.length)


class RandomSource:
    """Seeded random weights in checkpoint layout. Each tensor is generated whole from a seed derived
    from its name, then sliced, so any TP size sees the same model."""

    STD = 0.02  # (transformers' LlamaConfig initializer_range)

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed, self.device = seed, device

    def read_shard(self, spec: ShardSpec) -> torch.Tensor:
        # (in 64 bits, as torch takes seeds: a negative one is its two's complement, so every seed keeps its weights)
        seed = (self.seed * 1_000_003 + zlib.crc32(spec.hf_name.encode())) % 2 ** 64
        if spec.hf_name.endswith("norm.weight"):
            full = 1.0 + 0.1 * torch.randn(spec.hf_shape, generator=torch.Generator().manual_seed(seed))
        else:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            full = torch.randn(spec.hf_shape, generator=gen, device=self.device) * self.STD
        return full.narrow(spec.dim, spec.src_start, spec.length)


def load_weights(model: LlamaForCausalLM, source: TensorSource, show_progress: bool) -> None:
    for spec in tqdm(model.shard_specs(), desc="loading weights", disable=not show_progress, unit="tensor"):
        spec.param.data.narrow(spec.dim, spec.dst_start, spec.length).copy_(source.read_shard(spec))
    extra = layers_past_the_config(getattr(source, "file_of", {}), model.cfg.num_hidden_layers)
    if extra:  # (a config from another checkpoint of the family: the model runs, but not as trained)
        logger.warning("the checkpoint holds layers %s, which config.json's num_hidden_layers (%d) leaves out",
                       extra, model.cfg.num_hidden_layers)
    unused = unused_tensors(source, model) if isinstance(source, SafetensorsSource) else []
    if unused:  # (a bias or a norm config.json does not describe: the model runs without it, not as trained)
        shown = ", ".join(unused[:UNUSED_SHOWN]) + (f" and {len(unused) - UNUSED_SHOWN} more"
                                                   if len(unused) > UNUSED_SHOWN else "")
        logger.warning("the checkpoint holds tensors the model does not read, which are left out (is config.json "
                       "from the same checkpoint?): %s", shown)


def unused_tensors(source: SafetensorsSource, model: LlamaForCausalLM) -> list[str]:
    """The checkpoint's tensors (by their names in its files) that no parameter reads, as transformers names its
    unexpected keys: but for rotary buffers older checkpoints saved, layers past the config (said apart) and a tied
    model's copy of the embedding as lm_head.weight."""
    read = {source.stored.get(spec.hf_name, spec.hf_name) for spec in model.shard_specs()}
    read_as = {stored: name for name, stored in source.stored.items()}  # (a file's name -> the model's name for it)
    past = set(layers_past_the_config(source.file_of, model.cfg.num_hidden_layers))
    tied_head = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    unused = []
    for name in set(source.file_of) - set(source.stored) - read - tied_head:
        layer = re.match(r"model\.layers\.(\d+)\.", read_as.get(name, name))
        if not name.endswith(RECOMPUTED_BUFFERS) and (layer is None or int(layer.group(1)) not in past):
            unused.append(name)
    return sorted(unused)


def layers_past_the_config(names: Iterable[str], num_layers: int) -> list[int]:
    """Layer numbers of checkpoint tensors at or past num_layers."""
    found = {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    return sorted(i for i in found if i >= num_layers)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name the model runs in (config.py's DTYPE_NAMES), or of such a torch dtype: itself."""
    return getattr(torch, torch_dtype_name(dtype))


def default_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype on GPU, a float32 one's downcast to the GPU's half type as vLLM's dtype "auto" does
    (bf16, or fp16 before sm_80, which has no bf16: a bf16 checkpoint's too, as vLLM falls back); fp32 on CPU (CPU
    bf16 matmuls are slow and inexact)."""
    if device.type == "cpu":
        return torch.float32
    if cfg.torch_dtype not in DTYPE_NAMES:  # (one read as bf16 ran a float8 or float64 checkpoint with no word)
        raise ConfigError(f"config.json's torch_dtype {cfg.torch_dtype!r} is not a dtype tpgraph runs in (one of "
                          f"{sorted(DTYPE_NAMES)}): pass --dtype to choose one")
    dtype = parse_dtype(cfg.torch_dtype)
    if dtype is torch.float16:
        return dtype
    has_bf16 = torch.cuda.get_device_capability(device)[0] >= 8
    if dtype is torch.bfloat16 and not has_bf16:
        logger.warning("this GPU (before sm_80) has no bfloat16: the bfloat16 checkpoint runs in float16, as vLLM's "
                       "dtype auto falls back (--dtype float32 keeps its range)")
    return torch.bfloat16 if has_bf16 else torch.float16


def load_model(
    state: ParallelState,
    comm: TPCommunicator,
    model_dir: str | Path | None = None,
    load_format: str = "auto",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    config: ModelConfig | None = None,
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """Build the TP model on this rank and fill it.

    model_dir None loads the built-in default (seeded random weights of BUILTIN_MODEL, or of `config`).
    load_format 'dummy' fills random weights for the directory's config (benchmarks).
    max_positions: the rope tables' rows (LlamaForCausalLM), where the max_model_len is known before the load.
    A failure on any rank raises on every rank.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "safetensors" and model_dir is None:  # (not the built-in model's random weights instead)
        raise ConfigError("load_format 'safetensors' needs a checkpoint directory (--model DIR)")

    def build() -> LlamaForCausalLM:
        cfg = config or (ModelConfig.from_dir(model_dir) if model_dir is not None else BUILTIN_MODEL)
        if model_dir is None or load_format == "dummy":
            source: TensorSource = RandomSource(seed, state.device)
        else:
            source = SafetensorsSource(Path(model_dir), pickles=load_format == "auto")
            if (cfg.tie_word_embeddings and "lm_head.weight" in source.file_of
                    and not source.same_values("lm_head.weight", "model.embed_tokens.weight")):
                # transformers ties only a checkpoint without an lm_head.weight of other values: one it holds is the
                # output projection. (An equal copy stays tied: the same logits, one embedding's memory less.)
                cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
                if state.is_driver:
                    logger.warning("config.json ties lm_head to the embedding, but the checkpoint holds an "
                                   "lm_head.weight of other values: it is loaded untied, as transformers loads it "
                                   "(vLLM drops it for the embedding)")
        model = LlamaForCausalLM(cfg, comm, dtype or default_dtype(cfg, state.device), state.device, max_positions)
        load_weights(model, source, show_progress=state.is_driver)
        return model.eval()

    return run_on_all_ranks(state, build, "loading the model")
