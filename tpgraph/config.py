"""Typed, frozen configuration: the model (from HF config.json) and the runner."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpgraph.errors import CheckpointError, ConfigError
from tpgraph.hub import HUB_ID

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
# (Mistral's is Llama's model without a sliding window: vLLM runs both with its Llama code; Qwen2's is Llama's with
# biases on q, k and v; Qwen3's, Llama's with an RMSNorm over each head of q and k before the rotation)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# each model_type's defaults for absent config.json fields, where transformers' config class for it has other ones
# than LlamaConfig (MistralConfig's: its sliding window of 4096 is then refused below, unless disable_sliding_window;
# Qwen2Config's and Qwen3Config's)
_QWEN_DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                  "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "sliding_window": 4096}
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": _QWEN_DEFAULTS,
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128},  # (not hidden / heads)
}
# the architecture a model_type's checkpoints name, where it decides the model's code (Qwen2's q, k and v carry biases
# that a Llama does not): a config naming one with the other's model_type is refused, not run as either
ARCHITECTURE_OF_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# the model_types whose window is unused unless use_sliding_window (their config classes drop it)
SLIDING_WINDOW_SWITCHED = ("qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# config.json fields whose other values change the model: the values here are the ones tpgraph computes
# (not pretraining_tp: transformers' slices of each matmul, joined again, are the same model at any value)
UNIMPLEMENTED_FIELDS = {
    "sliding_window": (None,),
    "use_sliding_window": (None, False),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "quantization_config": (None,),  # (fp8 / int weights with scales)
    "partial_rotary_factor": (None, 1, 1.0),  # (rope over part of each head; also refused inside the rope dict)
}
# vLLM's switch for a max_model_len past the model's context (its envs.py reads "1" or "true", any case)
LONG_MAX_MODEL_LEN_VARIABLE = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# the dtypes the model runs in: each name taken (vLLM's) and torch's name for it. Names alone, so that the command
# line and EngineConfig check them without torch (model/loader.py's parse_dtype resolves them, as the model is built)
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16", "float": "float32"}
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # (model/loader.py's load_model reads them)


def long_max_model_len_allowed() -> bool:
    """Whether VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, as vLLM reads it: "1" or "true" (any case), else off."""
    return os.environ.get(LONG_MAX_MODEL_LEN_VARIABLE, "0").strip().lower() in ("1", "true")


@functools.cache
def _warn_once(message: str) -> None:
    """A warning said once in a process (the engine checks max_model_len before and after the weights load)."""
    logger.warning(message)


def torch_dtype_name(dtype: str | torch.dtype) -> str:
    """torch's name ("bfloat16") of a dtype the model runs in, given by one of DTYPE_NAMES' names or as a torch dtype
    (told by its type, torch.dtype, which needs no import of torch here); any other is refused."""
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPE_NAMES.values():  # (one the model cannot run in, int8 say, failed in its first matmul)
            raise ConfigError(f"dtype {dtype} is not one tpgraph runs in; choose torch.bfloat16, torch.float16 or "
                              f"torch.float32 (or one of {sorted(DTYPE_NAMES)})")
        return name
    try:
        return DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # (TypeError: a list or a dict, which no name is)
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_NAMES)}") from None


def _token_id(value: Any) -> int:
    """A token id from config.json: an integer (a bool or a string is a mistake, not 1 or a number)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"token ids must be integers, got {value!r}")
    return value


def _integer(name: str, value: Any) -> int:
    """A count or size from config.json: an integer (int() would cut 100.7 to 100 and read true as 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    """A true/false field of config.json: a JSON bool, or null for false (bool("false") would be True)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")
    return value


_ROPE_FIELDS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}


def _positive(name: str, value: Any) -> float:
    """A rope scale from config.json: a finite number > 0 (0 or less made the frequencies inf or NaN, and the model
    ran on them, giving garbage; a string or a bool is a mistake, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"config.json rope {name} must be a number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN's (transformers' defaults): the ramp's rotation bounds, whether they are cut to whole dimensions, and the
    # factor on cos and sin (1 for every other rope)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); older versions `rope_theta` + `rope_scaling`.
        # Where a config has both, transformers reads rope_scaling (an edit of it must not be ignored).
        params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        source = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"  # (as refusals name it)
        theta = _positive("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"config.json {source} type {rope_type!r} is not supported; tpgraph supports "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if params.get("partial_rotary_factor") not in (None, 1, 1.0):  # (transformers rotates part of each head)
            raise ConfigError(f"config.json rope partial_rotary_factor {params['partial_rotary_factor']!r} is not "
                              f"supported; tpgraph rotates whole heads")
        # (as transformers 5 computes llama3's and yarn's frequencies: a field beside the rope dict wins over the
        # dict's, and without either it is the model's context, not a fixed 8192; transformers 4 requires the dict's)
        original = int(cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                       or cfg.get("max_position_embeddings", 2048))
        if rope_type == "yarn" and "factor" in params and params["factor"] is None:
            # (transformers 5 derives a null one: the post-YaRN context over the pre-YaRN one)
            params["factor"] = cfg.get("max_position_embeddings", 2048) / original
        missing = [k for k in _ROPE_FIELDS.get(rope_type, ()) if params.get(k) is None]
        if missing:  # (transformers refuses such a config too; a default would silently be another rope)
            raise ConfigError(f"config.json {source} of type {rope_type!r} needs {', '.join(missing)}")
        # (a "default" rope ignores factor, as transformers does)
        factor = _positive("factor", params["factor"]) if rope_type in _ROPE_FIELDS else \
            float(params.get("factor", 1.0))
        # (llama3's divide the context by them: 0 was a ZeroDivisionError on every rank as the model was built)
        low, high = (_positive(name, params[name]) if rope_type == "llama3" else float(params.get(name, default))
                     for name, default in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)))
        return RopeConfig(
            theta=theta,
            type=rope_type,
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
            **(_yarn_fields(params, factor) if rope_type == "yarn" else {}),
        )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times longer (its paper's 0.1 * mscale * ln(factor) + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_fields(params: dict[str, Any], factor: float) -> dict[str, Any]:
    """A yarn rope's fields as transformers reads them: betas 32 and 1 where absent (or 0), bounds truncated unless
    `truncate` is false, and the attention factor given, else from the factor (and mscale / mscale_all_dim where
    both are set)."""
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = _yarn_mscale(factor, _positive("mscale", mscale)) / _yarn_mscale(
            factor, _positive("mscale_all_dim", mscale_all_dim)) if mscale and mscale_all_dim else _yarn_mscale(factor)
    return dict(beta_fast=_positive("beta_fast", params.get("beta_fast") or 32),
                beta_slow=_positive("beta_slow", params.get("beta_slow") or 1),
                truncate=_flag("truncate", params.get("truncate", True)),
                attention_factor=_positive("attention_factor", attention))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # (these defaults serve configs built in code, like BUILTIN_MODEL; from_hf_dict gives an absent config.json field
    # transformers' LlamaConfig default instead)
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    # a sliding window run as full attention over a context no longer than it (vLLM's disable_sliding_window: the
    # same attention, the window covering every position); None: no window
    sliding_window: int | None = None
    # biases on the projections, as transformers builds them: a Llama's attention_bias puts one on q, k, v and o,
    # its mlp_bias on gate, up and down; Qwen2 has them on q, k and v only
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # Qwen3's RMSNorm over each head of q and k (weights [head_dim]), after the projection, before the rotation
    qk_norm: bool = False

    def __post_init__(self) -> None:
        # (max_position_embeddings too: the rope tables and the context limit are sized by it, and 0 or less failed
        # as an unrelated buffer's shape or a torch.arange traceback while the engine was built)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "sliding_window"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim % 2:  # (rotary pairs each channel with another; transformers refuses an odd head too)
            raise ConfigError(f"head_dim must be even (rotary embeddings rotate channel pairs), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def _scaled_context(self) -> tuple[str, int] | None:
        """(the field, its value) that a rope's factor scales into the model's context; None for an unscaled rope."""
        if self.rope.type == "linear":  # (it squeezes positions by its factor: vicuna-7b-v1.5-16k's 4096 x 4 are 16k)
            return "max_position_embeddings", self.max_position_embeddings
        if self.rope.type == "yarn":  # (the pre-YaRN context, stretched)
            return "original_max_position_embeddings", self.rope.original_max_position_embeddings
        return None

    @property
    def max_context(self) -> int:
        """The positions the model was trained on, as vLLM derives them: max_position_embeddings, or for a linear or
        yarn rope the context it scales times its factor; no more than a disabled sliding window."""
        return min(self._trained_context, self.sliding_window or math.inf)

    @property
    def _trained_context(self) -> int:
        """max_context but for a disabled sliding window's cap."""
        scaled = self._scaled_context
        # (vLLM's int() of the product; a hair over it first, so that a product floating point leaves a rounding
        # short of a whole number, as a yarn factor derived as a ratio of contexts does, is that number)
        return self.max_position_embeddings if scaled is None else int(scaled[1] * self.rope.factor + 1e-6)

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise ConfigError where max_model_len is past the positions the model was trained on, unless
        VLLM_ALLOW_LONG_MAX_MODEL_LEN allows it (as vLLM: then a warning)."""
        if max_model_len <= self.max_context:
            return
        scaled = self._scaled_context
        context = f"max_position_embeddings ({self.max_position_embeddings})" if scaled is None else \
            f"context ({scaled[0]} {scaled[1]} x the {self.rope.type} rope factor {self.rope.factor:g} = " \
            f"{self._trained_context})"
        if self.max_context < self._trained_context:
            context = f"sliding window ({self.sliding_window}), which disable_sliding_window caps its context at"
        message = f"max_model_len {max_model_len} exceeds the model's {context}"
        if not long_max_model_len_allowed():
            raise ConfigError(f"{message}; to allow it, set the environment variable {LONG_MAX_MODEL_LEN_VARIABLE}=1 "
                              f"(positions past the model's context may give garbage)", ("max_model_len",))
        _warn_once(f"{message}; allowed by {LONG_MAX_MODEL_LEN_VARIABLE}: positions past the model's context may "
                   f"give garbage")

    def check_tp(self, tp_size: int) -> None:
        """Raise ConfigError unless this model can be split over tp_size ranks."""
        if tp_size < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {tp_size}")
        if self.num_attention_heads % tp_size:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by the tensor-parallel size "
                f"({tp_size}); choose a TP size that divides it"
            )
        kv = self.num_key_value_heads
        if kv % tp_size and tp_size % kv:
            raise ConfigError(
                f"num_key_value_heads ({kv}) and the tensor-parallel size ({tp_size}) must divide one another "
                "(KV heads are split when kv >= tp and replicated when kv < tp)"
            )
        if self.intermediate_size % tp_size:
            raise ConfigError(
                f"intermediate_size ({self.intermediate_size}) is not divisible by the tensor-parallel size "
                f"({tp_size})"
            )

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any], disable_sliding_window: bool = False) -> ModelConfig:
        """disable_sliding_window: a sliding window is taken (as vLLM's flag of that name takes it: full attention
        over a context capped at the window), not refused."""
        model_type = cfg.get("model_type", "llama")
        archs = cfg.get("architectures") or [ARCHITECTURE_OF_MODEL_TYPE.get(model_type, "LlamaForCausalLM")]
        unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if unsupported or model_type not in MODEL_TYPE_DEFAULTS:
            raise ConfigError(
                f"unsupported architecture {archs} (model_type={cfg.get('model_type')!r}); tpgraph runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        own = ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
        if any(a != own if own else a in ARCHITECTURE_OF_MODEL_TYPE.values() for a in archs):
            named = "" if "model_type" in cfg else " (its default: config.json names none)"
            raise ConfigError(f"config.json names architecture {archs} with model_type {model_type!r}{named}: the two "
                              f"do not go together (transformers builds the model_type's own model), so it is not run "
                              f"as either")
        defaulted = {k: v for k, v in MODEL_TYPE_DEFAULTS[model_type].items() if k not in cfg}
        cfg = {**cfg, **defaulted}
        if model_type in SLIDING_WINDOW_SWITCHED and not _some_layer_slides(cfg):
            # (Qwen2.5's and Qwen3's configs name a window no layer uses: without use_sliding_window, or with every
            # layer below max_window_layers, transformers runs full attention throughout)
            unused = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
            cfg = {k: v for k, v in cfg.items() if k not in unused}
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # (transformers' swish is SiLU)
            raise ConfigError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only 'silu', or 'swish', "
                              f"the same function)")
        # fields that change the computation and that this model does not implement: refused, never ignored
        window = cfg.get("sliding_window")
        for name, harmless in UNIMPLEMENTED_FIELDS.items():
            # (use_sliding_window: Qwen2's switch for its window, taken with it)
            excused = disable_sliding_window and name in ("sliding_window", "use_sliding_window")
            if cfg.get(name) not in harmless and not excused:
                where = f"leaves out {name}, so model_type {model_type!r} takes its default of {cfg[name]!r}" if \
                    name in defaulted else f"sets {name}={cfg.get(name)!r}"
                hint = f"; disable_sliding_window (--disable-sliding-window) runs it as vLLM's does, with full " \
                    f"attention over a context capped at the window, {window}" if name == "sliding_window" else ""
                raise ConfigError(f"config.json {where}, which tpgraph does not implement (it would run as if unset "
                                  f"and give wrong results){hint}")
        # (after the window's own refusal, which names disable_sliding_window; under it a sliding layer is the window
        # it runs as full attention, as vLLM's flag runs every layer)
        taken = {"full_attention", "sliding_attention"} if disable_sliding_window else {"full_attention"}
        layer_types = cfg.get("layer_types") or []
        if any(t not in taken for t in layer_types):
            raise ConfigError(f"config.json sets layer_types with {sorted(set(layer_types) - taken)}: only full "
                              f"attention in every layer is implemented")
        try:
            heads = _integer("num_attention_heads", cfg["num_attention_heads"])
            hidden = _integer("hidden_size", cfg["hidden_size"])
            eos = cfg.get("eos_token_id", 2)  # (absent fields take transformers' LlamaConfig defaults)
            eos_ids = tuple(_token_id(e) for e in eos) if isinstance(eos, list) else (
                () if eos is None else (_token_id(eos),))
            bos = cfg.get("bos_token_id", 1)
            # (only an absent or null field takes the default: a 0 is refused below, not read as absent)
            kv, head_dim = cfg.get("num_key_value_heads"), cfg.get("head_dim")
            return ModelConfig(
                vocab_size=_integer("vocab_size", cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=_integer("intermediate_size", cfg["intermediate_size"]),
                num_hidden_layers=_integer("num_hidden_layers", cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=heads if kv is None else _integer("num_key_value_heads", kv),
                head_dim=hidden // heads if head_dim is None else _integer("head_dim", head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(cfg),
                max_position_embeddings=_integer("max_position_embeddings", cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=_flag("tie_word_embeddings", cfg.get("tie_word_embeddings")),
                bos_token_id=None if bos is None else _token_id(bos),
                eos_token_id=eos_ids,
                # (transformers' own name since 4.56 wins over the legacy one where a config has both, as
                # transformers and vLLM read it)
                torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
                sliding_window=None if window is None or not disable_sliding_window else
                _integer("sliding_window", window),
                **_biases(model_type, cfg),
                qk_norm=model_type == "qwen3",
            )
        except KeyError as exc:
            raise ConfigError(f"config.json is missing the required field {exc.args[0]!r}") from None
        except ConfigError:
            raise
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"config.json has a field of the wrong type or value: {exc}") from None

    @staticmethod
    def from_dir(model_dir: str | Path, disable_sliding_window: bool = False) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            hub = HUB_ID.fullmatch(str(model_dir)) is not None
            hint = (f" (a Hugging Face hub id? tpgraph loads a local checkpoint and downloads nothing: `hf download "
                    f"{model_dir} --local-dir DIR`, then give DIR)") if hub else ""
            raise CheckpointError(f"model directory {str(model_dir)!r} does not exist{hint}")
        if not path.is_file():
            raise CheckpointError(_no_config(Path(model_dir)))
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{path} holds a JSON {type(cfg).__name__}, not an object")
        return ModelConfig.from_hf_dict(cfg, disable_sliding_window)


def _some_layer_slides(cfg: dict[str, Any]) -> bool:
    """Whether a Qwen2 / Qwen3 config gives any layer a window, as its config class decides: none without
    use_sliding_window or a window; else the layers its layer_types name sliding, or where it names none, the layers
    from max_window_layers on."""
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return False
    if cfg.get("layer_types"):  # (a type other than these two is kept, for the layer_types check to name)
        return any(t != "full_attention" for t in cfg["layer_types"])
    first, layers = cfg.get("max_window_layers", 28), cfg.get("num_hidden_layers")
    # (fields of the wrong type: taken as sliding, so that the window's own refusal names what is wrong)
    return not (isinstance(first, int) and isinstance(layers, int)) or first < layers


def _biases(model_type: str, cfg: dict[str, Any]) -> dict[str, bool]:
    """ModelConfig's bias fields as transformers builds the model_type's projections: Qwen2 always has q, k and v
    biases (and reads no attention_bias); a Llama's attention_bias and mlp_bias give them, a Qwen3's attention_bias
    (its MLP has none); Mistral's code builds none, whatever the fields say."""
    if model_type == "qwen2":
        return {"qkv_bias": True}
    if model_type not in ("llama", "qwen3"):
        return {}
    attention = _flag("attention_bias", cfg.get("attention_bias"))
    mlp = model_type == "llama" and _flag("mlp_bias", cfg.get("mlp_bias"))
    return {"qkv_bias": attention, "o_proj_bias": attention, "mlp_bias": mlp}


def _no_config(model_dir: Path) -> str:
    """Why a directory without config.json is no checkpoint, and which directory is: a Hugging Face repo's original/
    folder (Meta's consolidated weights and params.json) has the checkpoint as its parent."""
    parent = model_dir.resolve().parent
    beside = (parent / "config.json").is_file()
    if (model_dir / "params.json").is_file():
        where = f"the Hugging Face checkpoint beside it is its parent, {str(parent)!r}" if beside else \
            "give the model's Hugging Face checkpoint (config.json and safetensors weights)"
        return (f"{str(model_dir)!r} holds params.json, not config.json: a checkpoint in Meta's or Mistral's own "
                f"format (consolidated weights), which is not read here; {where}")
    hint = f"its parent, {str(parent)!r}, has one" if beside else "is this a Hugging Face checkpoint?"
    return f"no config.json in {str(model_dir)!r}; {hint}"


# The built-in default: small enough for a laptop CPU, shaped like Llama 3 (GQA, llama3 rope, tied
# embeddings) and with a byte-level vocabulary (256 bytes + <bos> + <eos>), so it needs no download.
BUILTIN_MODEL = ModelConfig(
    vocab_size=258,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=512),
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=256,
    eos_token_id=(257,),
    torch_dtype="float32",
)
