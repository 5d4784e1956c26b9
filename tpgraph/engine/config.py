"""EngineConfig: everything TPEngine needs, validated once (vLLM's names where vLLM has the setting)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpgraph.chat import GENERATION_CONFIG_SOURCES, check_generation_config_dir, check_overrides
from tpgraph.checks import positive_int, unit_fraction
from tpgraph.config import LOAD_FORMATS, torch_dtype_name
from tpgraph.engine.sampling_params import MAX_LOGPROBS
from tpgraph.engine.scheduler_config import SCHEDULING_POLICIES, check_token_budget
from tpgraph.errors import ConfigError
from tpgraph.graphs.config import GraphConfig, from_compilation_config
from tpgraph.hub import checkpoint_dirs

if TYPE_CHECKING:
    import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")  # (vLLM's names, and float32: a CPU model's)


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path | None = None  # an HF checkpoint directory; None: the built-in model
    tp_size: int = 1
    device: str | None = None  # "cuda" | "cpu"; default: cuda if a GPU is visible
    # "auto" or None: the checkpoint's (a float32 one's bf16 on GPU, as vLLM's; fp32 on CPU); else bf16 | fp16 | fp32
    dtype: str | None = None
    # vLLM's kv_cache_dtype: "auto" or the name of the model's dtype, which the KV cache always holds (no fp8 cache)
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0  # random weights (built-in / dummy) and the shared sampling generator
    block_size: int = 16
    max_num_seqs: int = 8
    max_model_len: int | None = None
    # vLLM's: a checkpoint's sliding window (Mistral-7B-v0.1's) runs as full attention over a context capped at the
    # window (the same attention); without it such a checkpoint is refused
    disable_sliding_window: bool = False
    max_num_batched_tokens: int | None = None  # default: scheduler_config.default_token_budget's
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority": SamplingParams.priority orders the queue and preemption
    overlap_scheduling: bool = True  # schedule and launch each step before reading the last one's tokens
    enable_prefix_caching: bool = True  # share the K/V blocks of token prefixes already computed
    # vLLM's: every all-reduce (eager and in graphs) through NCCL (torch.distributed), never the custom kernels
    disable_custom_all_reduce: bool = False
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # override the KV sizing (tests, small machines)
    # vLLM's kv_cache_memory_bytes: the KV cache's bytes on each GPU (null block included), in place of what
    # gpu_memory_utilization leaves
    kv_cache_memory_bytes: int | None = None
    chat_template: str | Path | None = None  # a Jinja chat template, or a file holding one; default: the checkpoint's
    # a directory whose tokenizer.json, tokenizer_config.json and chat template replace the model's (vLLM's --tokenizer)
    tokenizer: str | Path | None = None
    # vLLM's --generation-config: "auto" (the checkpoint's generation_config.json gives request defaults), "vllm"
    # (none; its EOS ids still end a generation) or a directory whose generation_config.json is read instead
    generation_config: str | Path = "auto"
    # vLLM's --override-generation-config: temperature, top_p, top_k, min_p, repetition_penalty or max_new_tokens
    # set over the defaults above (null unsets one)
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # the most log-probability alternatives a request may ask a token (vLLM's --max-logprobs; more is a 400). Up to
    # MAX_LOGPROBS, what the sampler computes: vLLM's -1 (the whole vocabulary) is not served
    max_logprobs: int = MAX_LOGPROBS
    graphs: GraphConfig = field(default_factory=GraphConfig)

    def __post_init__(self) -> None:
        for name in ("tp_size", "max_num_seqs", "block_size"):
            positive_int(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):  # (RunnerConfig refuses it too, but only after the weights load)
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}", ("block_size",))
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks} and kv_cache_memory_bytes="
                              f"{self.kv_cache_memory_bytes} both size the KV cache: give one of them",
                              ("num_kv_blocks", "kv_cache_memory_bytes"))
        if self.num_kv_blocks is not None:  # (the runner's checks, before the weights load on every rank)
            check_num_kv_blocks(self.num_kv_blocks, self.block_size, self.max_model_len)
        if self.device not in (None, "cuda", "cpu"):
            raise ConfigError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise ConfigError(f"model must be a checkpoint directory (a str or Path) or None, got {self.model!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, (str, Path)):
            raise ConfigError(f"chat_template must be a template (a str) or a file's path (a str or Path), got "
                              f"{self.chat_template!r}")
        if self.generation_config not in GENERATION_CONFIG_SOURCES:
            check_generation_config_dir(self.generation_config)
        check_overrides(self.override_generation_config)
        logprobs = self.max_logprobs
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"max_logprobs must be an integer from 0 to {MAX_LOGPROBS} (the alternatives a token the "
                              f"sampler computes; -1, the whole vocabulary, is not served), got {logprobs!r}")
        if self.tokenizer is not None:
            check_tokenizer_dir(self.tokenizer)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2 ** 63) <= self.seed < 2 ** 64:
            none = (" (vLLM's None, no fixed seed, is not taken: every rank draws alike from this one, and it makes "
                    "the built-in model's weights; a request's own is SamplingParams(seed=...))")
            raise ConfigError(f"seed must be an integer of 64 bits (what torch.manual_seed takes), got {self.seed!r}"
                              + (none if self.seed is None else ""), ("seed",))
        if self.dtype not in (None, "auto"):
            torch_dtype_name(self.dtype)  # (an unknown name is said here, before any rank starts)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not taken: the KV cache is kept in the "
                              f"model's dtype (no fp8 cache); give {' or '.join(map(repr, KV_CACHE_DTYPES))}",
                              ("kv_cache_dtype",))
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in ("overlap_scheduling", "enable_prefix_caching", "enable_chunked_prefill",
                     "disable_custom_all_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                              f"{self.scheduling_policy!r}")
        if not isinstance(self.graphs, GraphConfig):
            raise ConfigError(f"graphs must be a GraphConfig, got {type(self.graphs).__name__}")
        unit_fraction("gpu_memory_utilization", self.gpu_memory_utilization)  # (the runner's check, before the weights)
        if self.max_num_batched_tokens is not None:  # (SchedulerConfig checks it too, after the weights load)
            check_token_budget(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                               self.enable_chunked_prefill)


def check_num_kv_blocks(num_blocks: int, block_size: int, max_model_len: int | None,
                        named: str = "num_kv_blocks") -> None:
    """A KV cache sized by hand (num_kv_blocks, or vLLM's `named` for it) must leave a block past the null one (block
    0, which padded slots write), and hold one sequence of an asked max_model_len."""
    if num_blocks < 2:
        raise ConfigError(f"{named} {num_blocks} leaves no block to use (block 0 is the null block padded slots "
                          f"write): give {named} 2 or more", ("num_kv_blocks",))
    capacity = (num_blocks - 1) * block_size
    if max_model_len is not None and capacity < max_model_len:
        raise ConfigError(f"max_model_len {max_model_len} needs that many tokens of KV cache, but only {capacity} fit "
                          f"({num_blocks - 1} blocks of {block_size}; block 0 is the null block): lower max_model_len, "
                          f"or raise {named} to {-(-max_model_len // block_size) + 1} (the null block and one "
                          "sequence's)", ("max_model_len", "num_kv_blocks"))


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def check_override_blocks(blocks: int | None, kwargs: dict[str, Any]) -> None:
    """EngineConfig's num_kv_blocks check, naming num_gpu_blocks_override, the keyword the script gave. A block_size or
    max_model_len of no count is left for EngineConfig to refuse."""
    size, length = kwargs.get("block_size", _FIELD_DEFAULTS["block_size"]), kwargs.get("max_model_len")
    counts = all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1) for v in (size, length))
    if blocks is not None and counts and size is not None and not size & (size - 1):
        check_num_kv_blocks(blocks, size, length, named="num_gpu_blocks_override")


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """A kv_cache_dtype naming a dtype must name the one the model runs in (dtype resolved: "auto" read as the
    checkpoint's), which the cache holds: another would be ignored."""
    model = str(dtype).removeprefix("torch.")
    if kv_cache_dtype != "auto" and torch_dtype_name(kv_cache_dtype) != model:
        raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not the model's dtype ({model}): the KV cache is kept "
                          f"in the model's dtype; give 'auto' or {model!r}", ("kv_cache_dtype",))


def check_tokenizer_dir(tokenizer: object) -> None:
    """A tokenizer given apart from the model: a directory with tokenizer.json (the fast tokenizer's one file, which
    is what tpgraph reads), refused now rather than found missing after the weights load on every rank."""
    if not isinstance(tokenizer, (str, Path)):
        raise ConfigError(f"tokenizer must be a directory (a str or Path), got {tokenizer!r}")
    if not Path(tokenizer).is_dir():
        raise ConfigError(f"tokenizer {str(tokenizer)!r} is not a directory (tpgraph reads a tokenizer from disk and "
                          f"downloads nothing)")
    if not (Path(tokenizer) / "tokenizer.json").is_file():
        raise ConfigError(f"tokenizer directory {str(tokenizer)!r} has no tokenizer.json; write one with transformers: "
                          f"AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")


_DOWNLOADS = ('nothing is downloaded: a hub id is read from the hub cache, where `hf download` (which takes the '
              'token) puts it, and a directory from disk; leave it out')
_GRAPHS = ("graphs=GraphConfig(...) sets the CUDA graphs (ladder: the decode batch sizes captured), or vLLM's "
           "compilation_config={'cudagraph_capture_sizes': [...]}; enforce_eager=True runs none")
# vLLM's LLM(...) keywords with no setting here, and what to do instead: TPEngine refuses them by name (a keyword
# taken and then ignored would run another engine than the script's author meant)
VLLM_KEYWORDS_NOT_TAKEN = {
    "quantization": "weights run as bfloat16, float16 or float32 (dtype=...): give an unquantized checkpoint",
    "cpu_offload_gb": "the weights stay on the device: leave it out",
    "hf_token": _DOWNLOADS,
    "max_seq_len_to_capture": _GRAPHS,
    "cuda_graph_sizes": _GRAPHS,
}
# vLLM's keywords at vLLM's own defaults, which ask for nothing: no quantization, no CPU offload, no hub token, and None
# where vLLM's engine chooses (its EngineArgs' None). Scripts pass them through from their configs: taken as left out,
# so this engine's defaults hold (any other value is read as ever: refused, or taken as that setting)
VLLM_DEFAULTS: dict[str, object] = {"quantization": None, "cpu_offload_gb": 0, "hf_token": None, "max_num_seqs": None,
                                    "block_size": None, "enable_prefix_caching": None, "enable_chunked_prefill": None}


def at_vllm_default(name: str, value: object) -> bool:
    """Whether a keyword is one of VLLM_DEFAULTS given at that default (a bool is no count: False is not 0)."""
    if name not in VLLM_DEFAULTS:
        return False
    default = VLLM_DEFAULTS[name]
    return value is None if default is None else not isinstance(value, bool) and value == default


# vLLM's keywords taken at the values that mean what tpgraph does anyway, as the server's flags take them
# (engine/cli.py): no checkpoint code runs, so trusting it changes nothing; preemption recomputes, as vLLM's V1 engine
# does, so the swap space goes unused; no statistics are logged periodically;
# prompts are chunked with no concurrent partial prefills; one pipeline stage and one data-parallel replica
_TENSOR_PARALLEL_ALONE = "1 alone (tpgraph shards by tensor parallelism alone: tensor_parallel_size, or tp_size)"
VLLM_KEYWORDS_TAKEN = {
    "trust_remote_code": (lambda v: isinstance(v, bool), "True or False (no checkpoint code runs here)"),
    "swap_space": (lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and v >= 0,
                   "GiB >= 0 (unused: a preempted sequence is recomputed)"),
    "disable_log_stats": (lambda v: isinstance(v, bool), "True or False (no statistics are logged periodically)"),
    "tokenizer_mode": (lambda v: v in ("auto", "hf"), "'auto' or 'hf' (tokenizer.json, the fast tokenizer)"),
    "config_format": (lambda v: v in ("auto", "hf"), "'auto' or 'hf' (config.json, Hugging Face's format; Mistral's "
                                                     "params.json is not read)"),
    "max_num_partial_prefills": (lambda v: not isinstance(v, bool) and v == 1,
                                 "1 alone (prompts are chunked as vLLM's V1 engine chunks them, one partial prefill at "
                                 "a time)"),
    # (RL frameworks pass these at their defaults, from config)
    "skip_tokenizer_init": (lambda v: v is False, "False alone (generate detokenizes with the checkpoint's tokenizer; "
                                                  "prompts may be token ids all the same)"),
    "enable_lora": (lambda v: v is False, "False alone (no LoRA adapters are served: merge one into the weights, "
                                          "peft's merge_and_unload, and load the merged checkpoint)"),
    "enable_sleep_mode": (lambda v: v is False, "False alone (there is no sleep mode here: no LLM.sleep or wake_up)"),
    "pipeline_parallel_size": (lambda v: not isinstance(v, bool) and v == 1, _TENSOR_PARALLEL_ALONE),
    "data_parallel_size": (lambda v: not isinstance(v, bool) and v == 1, _TENSOR_PARALLEL_ALONE),
}


def check_executor_backend(backend: object, tp_size: int, named: str = "distributed_executor_backend=",
                           starter: str = "TPEngine(tensor_parallel_size=N)") -> None:
    """vLLM's distributed_executor_backend, taken where it names how tpgraph runs its ranks: "external_launcher"
    under torchrun (every rank builds an engine, as vLLM's torchrun example does), "mp" in a plain process (the engine
    starts its ranks), "uni" at one rank. Any other is refused, naming the one that fits here. `starter`: what starts
    the ranks in a plain process, as the caller's user writes it (the command line's -tp N)."""
    launched = "WORLD_SIZE" in os.environ  # (torchrun's; TPEngine reads it alike)
    fits = "external_launcher" if launched else "mp"
    if backend is None or backend == fits or (backend == "uni" and tp_size == 1):
        return
    how = "under torchrun every rank builds a TPEngine" if launched else \
        f"in a plain process {starter} starts its own ranks"
    raise ConfigError(f"{named}{backend!r} (vLLM's) is not taken: {how}, as vLLM's {fits!r} "
                      f"does; give {fits!r} or leave it out")


def async_scheduling(value: object, overlap: object) -> dict[str, Any]:
    """vLLM's async_scheduling (EngineArgs; the server's --async-scheduling) is overlap_scheduling here; its None
    leaves the choice to the engine, whose default is to overlap."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"async_scheduling must be True, False or None, got {value!r}")
    if value is None:
        return {}
    if overlap is not None and overlap != value:
        raise ConfigError(f"overlap_scheduling={overlap!r} and async_scheduling={value!r} differ: give one of them")
    return {"overlap_scheduling": value}


# vLLM's LLM(...) keywords that vllm_keywords reads as tpgraph's settings (beside VLLM_KEYWORDS_TAKEN): it takes them
# out of the keywords by this list alone, and check_known names them, so one read but missing here is refused
VLLM_KEYWORDS_READ = ("tensor_parallel_size", "distributed_executor_backend", "num_gpu_blocks_override",
                      "enforce_eager", "async_scheduling", "revision", "tokenizer_revision", "download_dir",
                      "compilation_config")


def check_known(kwargs: dict[str, Any]) -> None:
    """A keyword neither EngineConfig nor vllm_keywords reads is refused by name (not a bare TypeError from the
    dataclass), listing what is taken: a misspelt one would otherwise leave its setting at the default unsaid."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "tp_size"}
    unknown = sorted(set(kwargs) - fields, key=str)
    if unknown:
        vllms = (*VLLM_KEYWORDS_READ, *VLLM_KEYWORDS_TAKEN)
        raise ConfigError(f"{', '.join(map(str, unknown))} (an unknown keyword) is not taken: TPEngine takes model, "
                          f"tp_size, {', '.join(sorted(fields))} and vLLM's {', '.join(sorted(vllms))}")


def vllm_keywords(model: str | Path | None, tp_size: int,
                  kwargs: dict[str, Any]) -> tuple[str | None, int, dict[str, Any]]:
    """TPEngine's model, tp_size and EngineConfig keywords, with vLLM's LLM(...) names read as tpgraph's:
    tensor_parallel_size is tp_size, num_gpu_blocks_override is num_kv_blocks, enforce_eager is the graphs'
    GraphConfig.enforce_eager, compilation_config's capture sizes and cudagraph_mode are the graphs' (their ladder and
    modes: graphs/config.py's from_compilation_config) and async_scheduling is overlap_scheduling. Both names given,
    differing, is refused; so
    is a vLLM keyword with no setting here (VLLM_KEYWORDS_NOT_TAKEN, naming what to do) unless at vLLM's default,
    which asks nothing (VLLM_DEFAULTS: left out), one at a value meaning other
    than what tpgraph does (VLLM_KEYWORDS_TAKEN, check_executor_backend), and any other keyword (check_known). A model
    or tokenizer given as a hub id is its cached snapshot at `revision` / `tokenizer_revision` in `download_dir` or
    the hub's cache (hub.py; nothing is downloaded)."""
    kwargs = {name: value for name, value in kwargs.items() if not at_vllm_default(name, value)}
    for name, hint in VLLM_KEYWORDS_NOT_TAKEN.items():
        if name in kwargs:
            raise ConfigError(f"{name} (vLLM's) is not taken: {hint}")
    vllm = {name: kwargs.pop(name) for name in (*VLLM_KEYWORDS_TAKEN, *VLLM_KEYWORDS_READ) if name in kwargs}
    check_known(kwargs)  # (what is left is EngineConfig's)
    for name, (takes, meaning) in VLLM_KEYWORDS_TAKEN.items():
        if name in vllm and not takes(vllm[name]):
            raise ConfigError(f"{name}={vllm[name]!r} (vLLM's) is not taken: {name} takes {meaning}")
    if "tensor_parallel_size" in vllm:
        size = positive_int("tensor_parallel_size", vllm["tensor_parallel_size"])
        if tp_size != 1 and size != tp_size:  # (tp_size=1 is also its default, so it cannot be told apart)
            raise ConfigError(f"tp_size={tp_size!r} and tensor_parallel_size={size!r} differ: give one of them")
        tp_size = size
    check_executor_backend(vllm.get("distributed_executor_backend"), tp_size)
    if "num_gpu_blocks_override" in vllm:
        blocks = vllm["num_gpu_blocks_override"]
        if blocks is not None:  # (vLLM's default: the cache sized from memory)
            positive_int("num_gpu_blocks_override", blocks)
        if kwargs.get("num_kv_blocks", blocks) != blocks:
            raise ConfigError(f"num_kv_blocks={kwargs['num_kv_blocks']!r} and num_gpu_blocks_override={blocks!r} "
                              f"differ: give one of them")
        kwargs["num_kv_blocks"] = blocks
        check_override_blocks(blocks, kwargs)
    graphs_given = "graphs" in kwargs
    if "enforce_eager" in vllm:
        eager = vllm["enforce_eager"]
        if not isinstance(eager, bool):
            raise ConfigError(f"enforce_eager must be True or False, got {eager!r}")
        graphs = kwargs.get("graphs", GraphConfig())
        if isinstance(graphs, GraphConfig):  # (anything else is refused by EngineConfig)
            if "graphs" in kwargs and graphs.enforce_eager != eager:
                raise ConfigError(f"enforce_eager={eager} and graphs' enforce_eager={graphs.enforce_eager} differ: "
                                  f"give one of them")
            kwargs["graphs"] = replace(graphs, enforce_eager=eager)
    if vllm.get("compilation_config") is not None:
        if graphs_given:
            raise ConfigError("graphs=GraphConfig(...) and compilation_config (vLLM's) both set the CUDA graphs: give "
                              "one of them")
        kwargs["graphs"] = from_compilation_config(vllm["compilation_config"], kwargs.get("graphs", GraphConfig()))
    if "async_scheduling" in vllm:
        kwargs.update(async_scheduling(vllm["async_scheduling"], kwargs.get("overlap_scheduling")))
    hub = {name: vllm.get(name) for name in ("revision", "tokenizer_revision", "download_dir")}
    if model is not None or any(v is not None for v in hub.values()) or kwargs.get("tokenizer") is not None:
        model, tokenizer = checkpoint_dirs(model, kwargs.get("tokenizer"), hub["revision"], hub["tokenizer_revision"],
                                           hub["download_dir"], named=str)
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
    return model, tp_size, kwargs
