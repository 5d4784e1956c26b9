"""The engine's command-line flags, shared by `tpgraph.generate` and `tpgraph.serve` (vLLM's names)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpgraph.checks import is_unit_fraction
from tpgraph.config import DTYPE_NAMES, LOAD_FORMATS
from tpgraph.engine.config import KV_CACHE_DTYPES, EngineConfig, check_executor_backend
from tpgraph.engine.sampling_params import MAX_LOGPROBS
from tpgraph.engine.scheduler_config import DEFAULT_CHUNK_TOKENS, SCHEDULING_POLICIES
from tpgraph.errors import ConfigError
from tpgraph.graphs.config import add_graph_args, graph_config_from_args
from tpgraph.hub import checkpoint_dirs
from tpgraph.ranks import env_int

if TYPE_CHECKING:
    from tpgraph.engine.tp_engine import TPEngine


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=checkpoint_name, default=None,
                   help="HF checkpoint directory, or a hub id whose snapshot is in the hub cache (default: the "
                        "built-in model)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks to shard over: under torchrun its world size (the default, and the only value taken); "
                        "in a plain process 1 by default, and N starts the other N-1 ranks itself")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="auto: the checkpoint's *.safetensors, else its PyTorch *.bin files; safetensors: those "
                        "alone; dummy: random weights of --model's config (default: %(default)s)")
    p.add_argument("--dtype", default="auto", type=dtype_name,
                   help="auto (the checkpoint's, a float32 one's as bf16 on GPU; fp32 on CPU) | bfloat16 | float16 | "
                        "float32 (and bf16 / fp16 / half / fp32 / float)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="default: cuda where a GPU is visible, else cpu")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, in place of the checkpoint's")
    p.add_argument("--tokenizer", type=checkpoint_name, default=None, metavar="DIR",
                   help="a directory (or a cached hub id) whose tokenizer.json, tokenizer_config.json (special tokens, "
                        "chat template) and chat_template.jinja replace --model's")
    hub = p.add_argument_group("the hub's cache (vLLM's flags; nothing is downloaded)")
    hub.add_argument("--revision", default=None,
                     help="the branch, tag or commit of --model's cached snapshot (a plain directory has none)")
    hub.add_argument("--tokenizer-revision", default=None,
                     help="the same for the tokenizer (--tokenizer or --model; default: --revision, as vLLM's)")
    hub.add_argument("--download-dir", default=None, metavar="DIR",
                     help="the hub cache holding hub ids' snapshots (default: $HF_HUB_CACHE, $HF_HOME/hub or "
                          "~/.cache/huggingface/hub)")
    p.add_argument("--tokenizer-mode", default="auto", type=accepted("auto", "hf", why="tpgraph runs the fast "
                                                                     "tokenizer (tokenizer.json), which both name"),
                   help="auto | hf: the fast tokenizer, tokenizer.json (vLLM's slow, mistral and custom are refused)")
    p.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                   help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens): auto "
                        "takes the checkpoint's generation_config.json, vllm none (its EOS ids still stop), DIR the "
                        "generation_config.json there")
    p.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help="defaults set over --generation-config's, e.g. '{\"temperature\": 0.5}' (null unsets one)")
    p.add_argument("--max-logprobs", type=logprobs_cap, default=MAX_LOGPROBS, metavar="N",
                   help=f"the most log-probabilities a token a request may ask (logprobs, top_logprobs, "
                        f"prompt_logprobs); more is refused (by the server, a 400). Default: %(default)s, and at most "
                        f"{MAX_LOGPROBS} (vLLM's -1, no cap, is refused)")
    p.add_argument("--seed", type=int, default=0,
                   help="random weights (built-in/dummy) and unseeded sampling (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens a KV cache block holds (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="largest decode batch, graphs captured up to it (default: %(default)s, where vLLM's is 256: "
                        "this engine is built for small decode batches)")
    p.add_argument("--max-model-len", type=model_len, default=None, metavar="N",
                   help="context limit, e.g. 8192, 8k (8000) or 8K (8192); default, or -1 / auto: the model's, capped "
                        "by what the KV cache holds")
    p.add_argument("--disable-sliding-window", action="store_true",
                   help="a checkpoint with a sliding window (Mistral-7B-v0.1's) runs with full attention over a "
                        "context capped at the window, as vLLM's flag does (without it, it is refused)")
    p.add_argument("--max-num-batched-tokens", type=token_count, default=None, metavar="N",
                   help="tokens per step, e.g. 8192 or 8K; longer prompts run in chunks (default: min(max_model_len, "
                        f"{DEFAULT_CHUNK_TOKENS}); max_model_len with --no-enable-chunked-prefill)")
    # (vLLM's pairs: --enable-X and --no-enable-X, so a vLLM command line that spells out the default runs too)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="longer prompts run in chunks of --max-num-batched-tokens (--no-enable-chunked-prefill: each "
                        "prompt in one step)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs: first come first served; priority: a request's `priority` (lower first, arrival breaks "
                        "ties) orders the queue, and the lowest is preempted first")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="K/V blocks of token prefixes computed before are shared: system prompts, earlier chat turns, "
                        "repeated prompts (--no-enable-prefix-caching: every prompt computed in full)")
    p.add_argument("--no-overlap-scheduling", dest="overlap_scheduling", action="store_false",
                   help="read each step's tokens before scheduling the next (default: the next step is launched "
                        "first, so the host's work hides behind the GPU's)")
    p.add_argument("--async-scheduling", dest="overlap_scheduling", action=argparse.BooleanOptionalAction,
                   default=True, help="vLLM's name for the same: on by default (--no-async-scheduling turns it off)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of GPU memory the engine may use; the KV cache gets what is left of it "
                        "(default: %(default)s)")
    p.add_argument("--disable-custom-all-reduce", action=argparse.BooleanOptionalAction, default=False,
                   help="every all-reduce, eager and in CUDA graphs, through NCCL (torch.distributed) instead of "
                        "tpgraph's custom all-reduce kernels (default: those where every GPU pair allows them)")
    p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV cache blocks, instead of sizing the cache from memory (vLLM's --num-gpu-blocks-override)")
    p.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=token_count, default=None, metavar="BYTES",
                   help="the KV cache's bytes on each GPU, e.g. 8G (x1024^3) or 8g (x1000^3), in place of what "
                        "--gpu-memory-utilization leaves (vLLM's)")
    add_graph_args(p)
    add_fixed_args(p)


def add_fixed_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for settings this engine has one way of doing: the value that is that way is taken (so a vLLM
    command line that spells it out runs), any other is refused when parsed, never taken and ignored."""
    fixed = p.add_argument_group("vLLM flags taken at the value this engine runs")
    fixed.add_argument("--kv-cache-dtype", default="auto", type=accepted(*KV_CACHE_DTYPES, why="the KV cache is kept "
                                                                         "in the model's dtype (no fp8 cache)"),
                       help="auto, or the model's dtype's name: the KV cache in the model's dtype (another dtype, and "
                            "fp8 caches, are refused)")
    fixed.add_argument("--config-format", default="auto", type=accepted("auto", "hf", why="tpgraph reads the "
                                                                        "checkpoint's config.json (Hugging Face's "
                                                                        "format), not Mistral's params.json"),
                       help="auto or hf: the checkpoint's config.json (Mistral's params.json format is refused)")
    fixed.add_argument("--quantization", "-q", default=None, type=no_quantization, metavar="METHOD",
                       help="refused: tpgraph runs unquantized weights (a checkpoint with a quantization_config is "
                            "refused too)")
    # (checkpoints load as LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM, read by
    # tpgraph's own code: no checkpoint's code runs, so trusting it changes nothing)
    fixed.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                       help="taken: the Llama, Mistral, Qwen2 and Qwen3 checkpoints tpgraph loads need no code of "
                            "their own, and none is run")
    # (vLLM's V1 engine preempts by recomputation and never swaps, as this one: the CPU swap space goes unused there)
    fixed.add_argument("--swap-space", type=non_negative, default=4.0, metavar="GIB",
                       help="taken, unused: a preempted sequence is recomputed, as in vLLM's V1 engine, never swapped "
                            "(default: %(default)s)")
    # (a step's token budget goes to the running sequences first, and a prompt is cut only where it runs out, as in
    # vLLM's V1 engine, which takes this flag at 1 alone)
    fixed.add_argument("--max-num-partial-prefills", type=accepted("1", why="prompts are chunked as vLLM's V1 engine "
                                                                   "chunks them, with no concurrent partial prefills"),
                       default="1", metavar="1", help="1: prompts are chunked as in vLLM's V1 engine (more concurrent "
                                                      "partial prefills are refused)")
    # (one pipeline stage and one replica: vLLM's defaults, which a launch command may spell out)
    one = accepted("1", why="tpgraph shards by tensor parallelism alone (--tensor-parallel-size)")
    fixed.add_argument("--pipeline-parallel-size", "-pp", type=one, default="1", metavar="1",
                       help="1: no pipeline stages (tensor parallelism alone; more are refused)")
    fixed.add_argument("--data-parallel-size", "-dp", type=one, default="1", metavar="1",
                       help="1: one replica (run a server per replica; more are refused)")
    fixed.add_argument("--distributed-executor-backend", default=None, metavar="{mp,uni,external_launcher}",
                       help="how the ranks run: mp where `python -m tpgraph.serve -tp N` starts them itself (uni at "
                            "one rank), external_launcher under torchrun; ray is refused")
    fixed.add_argument("--disable-log-stats", action="store_true",
                       help="the server logs no line of engine stats every 10 s (or $VLLM_LOG_STATS_INTERVAL: "
                            "throughput, running and waiting requests, KV cache use, prefix cache hit rate; /metrics "
                            "serves them all the same)")


def dashed_names(argv: list[str]) -> list[str]:
    """--max_num_seqs=8 as --max-num-seqs=8: vLLM's parser takes either spelling of a flag's name (not of a value)."""
    def dashed(arg: str) -> str:
        if not arg.startswith("--"):
            return arg
        name, eq, value = arg.partition("=")
        return name.replace("_", "-") + eq + value

    return [dashed(arg) for arg in argv]


def checkpoint_name(text: str) -> str:
    """A directory or hub id: an empty one (`--model "$UNSET"`) would be the working directory, whatever it holds."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give a checkpoint directory or a hub id, or "
                                         "leave it out")
    return text


def accepted(*values: str, why: str) -> Callable[[str], str]:
    """An argparse type for a vLLM flag whose other values this engine cannot honour: they are refused when parsed,
    saying what is supported and why, rather than taken and ignored."""
    def check(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not supported: {why}; use {' or '.join(map(repr, values))}")
        return text

    return check


def dtype_name(text: str) -> str:
    """--dtype: auto, or a dtype's name the model runs in; another is refused when parsed, naming the flag (EngineConfig
    refused it later as "unknown dtype", no flag named)."""
    if text != "auto" and text not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is no dtype tpgraph runs in: use 'auto' or one of "
                                         f"{', '.join(map(repr, sorted(DTYPE_NAMES)))}")
    return text


_DECIMAL = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
_BINARY = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
# digits, with a decimal point, before a unit: as vLLM's human_readable_int reads one (float()'s 1e3, inf, 1_0, .5
# and signs are no count there, so none is one here)
_WITH_UNIT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def token_count(text: str) -> int:
    """A count as vLLM reads one: 8192, 8k (x1000, 25.6k too) or 8K (x1024, whole numbers only)."""
    text = text.strip()
    match = _WITH_UNIT.fullmatch(text)
    try:
        if match is None:
            return int(text)
        number, unit = match.groups()
        if unit in _DECIMAL:
            return int(float(number) * _DECIMAL[unit])
        return int(number) * _BINARY[unit]
    except (ValueError, OverflowError):  # (a float too large for an int: 400 digits and k)
        unit = text[-1:]
        hint = f" ({unit} multiplies whole numbers: {text[:-1]}{unit.lower()} is x1000)" if unit in _BINARY else ""
        raise argparse.ArgumentTypeError(f"must be a whole number, with k/m/g (x1000) or K/M/G (x1024) if you like, "
                                         f"got {text!r}{hint}") from None


def model_len(text: str) -> int | None:
    """--max-model-len: a token count, or vLLM's -1 / auto (the longest the KV cache holds: the default, None)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    value = token_count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive token count, or -1 / auto, got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {text!r}")
    return value


def no_quantization(text: str) -> str:
    raise argparse.ArgumentTypeError(f"{text!r} is not supported: tpgraph runs unquantized bf16, fp16 or fp32 weights; "
                                     "leave --quantization out and serve an unquantized checkpoint")


def non_negative(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def logprobs_cap(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be 0 to {MAX_LOGPROBS}, the alternatives a token the sampler computes "
                                         f"(vLLM's -1, the whole vocabulary, is not served), got {text}")
    return value


def fraction(text: str) -> float:
    """A value in (0, 1], refused at parse time rather than after the weights load."""
    value = float(text)
    if not is_unit_fraction(value):
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def positive_number(text: str) -> float:
    value = float(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def checkpoint_dirs_from_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """hub.checkpoint_dirs of --model, --tokenizer, --revision, --tokenizer-revision and --download-dir."""
    return checkpoint_dirs(args.model, args.tokenizer, args.revision, args.tokenizer_revision, args.download_dir,
                           named=lambda name: f"--{name.replace('_', '-')}")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """TPEngine(**engine_kwargs(args)): tp_size from the flag, else from torchrun's WORLD_SIZE."""
    world = env_int("WORLD_SIZE")  # (a ConfigError naming it where it is no integer, not a ValueError traceback)
    world = 1 if world is None else world
    tp_size = world if args.tensor_parallel_size is None else args.tensor_parallel_size  # (0 is refused, not 1)
    check_executor_backend(args.distributed_executor_backend, tp_size, named="--distributed-executor-backend ",
                           starter="-tp N")
    model, tokenizer = checkpoint_dirs_from_args(args)
    graphs = graph_config_from_args(args)
    # every EngineConfig field from the flag of its name (a field given a flag is passed on with no list to forget it
    # in), then those read otherwise
    taken = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return {**taken, "model": model, "tp_size": tp_size, "tokenizer": tokenizer, "graphs": graphs,
            "override_generation_config": args.override_generation_config or {}}


def engine_from_args(args: argparse.Namespace, rank_setup: Callable[[], None] | None = None) -> TPEngine:
    """TPEngine(**engine_kwargs(args)), its refusals naming the flags typed (-tp 0: --tensor-parallel-size/-tp, not
    EngineConfig's tp_size, the keyword a TPEngine user gives)."""
    from tpgraph.engine.tp_engine import TPEngine

    try:
        return TPEngine(**engine_kwargs(args), rank_setup=rank_setup)
    except ConfigError as exc:
        flags = setting_flags(args)
        named = [name for name in exc.settings if name in flags]
        if not named:
            raise
        message = str(exc)
        for name in named:  # (a whole word: max_model_len is not renamed inside another setting's name)
            message = re.sub(rf"\b{re.escape(name)}\b", flags[name], message)
        raise ConfigError(message, exc.settings) from None


def setting_flags(args: argparse.Namespace) -> dict[str, str]:
    """Each EngineConfig field engine_kwargs takes from a flag, and that flag as argparse names it in its own errors
    (every spelling: --num-kv-blocks/--num-gpu-blocks-override). tp_size only where -tp gave it (else torchrun's
    WORLD_SIZE did)."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    flags = {action.dest: "/".join(action.option_strings) for action in p._actions if action.option_strings}
    fields = {f.name: f.name for f in dataclasses.fields(EngineConfig) if f.name in flags}
    if args.tensor_parallel_size is not None:
        fields["tp_size"] = "tensor_parallel_size"
    return {name: flags[dest] for name, dest in fields.items()}
