"""`python -m tpgraph.generate`: completions from the command line, any TP, CPU or GPU (a thin CLI over TPEngine).

    python -m tpgraph.generate --prompt "Hello"                          # built-in model, one process
    python -m tpgraph.generate --chat --prompt "Hi" --model DIR          # a user message, through the chat template
    torchrun --nproc-per-node 2 -m tpgraph.generate --prompt "Hi" --model DIR --temperature 0.7
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from tpgraph.engine.cli import add_engine_args, dashed_names, engine_from_args
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.errors import RequestError, TPGraphError
from tpgraph.server.logs import check_environment, configure_logging, logging_config

if TYPE_CHECKING:
    from tpgraph.engine.tp_engine import TPEngine

DEFAULT_MAX_TOKENS = 32
# each SamplingParams field a flag sets, and the flag
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                  "min_p": "--min-p", "seed": "--sampling-seed"}
INTERRUPTED = 128 + 2  # (a shell's status for a command SIGINT stopped)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tpgraph.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true",
                   help="each prompt as one user message, rendered through the chat template (the checkpoint's, or "
                        "--chat-template's), as vLLM's LLM.chat")
    # (left out, a sampling flag is --generation-config's default, as the server's requests take it, else its own)
    sampling = p.add_argument_group("sampling (default: the checkpoint's generation_config.json, else the value shown)")
    sampling.add_argument("--max-tokens", type=int, default=None, help=f"default {DEFAULT_MAX_TOKENS}")
    sampling.add_argument("--temperature", type=float, default=None, help="0: greedy (the default)")
    sampling.add_argument("--top-p", type=float, default=None, help="default 1.0")
    sampling.add_argument("--top-k", type=int, default=None, help="default 0 (off)")
    sampling.add_argument("--min-p", type=float, default=None, help="default 0.0 (off)")
    sampling.add_argument("--sampling-seed", type=int, default=None, help="a per-request seed (reproducible samples)")
    add_engine_args(p)
    # (--max_num_seqs=4 as the server, and vLLM's parsers, take it)
    args = p.parse_args(dashed_names(sys.argv[1:] if argv is None else argv))
    if args.chat_template is not None and not args.chat:  # (refused, not taken and ignored)
        p.error("--chat-template renders chats: add --chat to send each prompt as a user message through it")
    return args


def sampling_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the command line gave (the rest are the engine's defaults)."""
    given = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in SAMPLING_FLAGS.items()}
    return {name: value for name, value in given.items() if value is not None}


def check_sampling_flags(flags: dict[str, Any]) -> None:
    """SamplingParams' refusal of a flag's value, naming the flag (--max-tokens, not max_tokens)."""
    try:
        SamplingParams(**flags)
    except TPGraphError as exc:
        message = str(exc)
        for field in flags:  # (a whole word: max_tokens is not renamed inside another field's name)
            message = re.sub(rf"\b{field}\b", SAMPLING_FLAGS[field], message)
        raise RequestError(message) from None


def own_defaults(engine: TPEngine) -> dict[str, Any]:
    """This command's defaults (greedy, DEFAULT_MAX_TOKENS) where the checkpoint's generation_config gives none."""
    defaults = engine.prompts.generation_defaults
    own: dict[str, Any] = {} if "temperature" in defaults.sampling else {"temperature": 0.0}
    return own if defaults.max_tokens is not None else {**own, "max_tokens": DEFAULT_MAX_TOKENS}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:  # (Ctrl-C, loading or generating: the engine, and its ranks, closed on the way out)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED


def run(args: argparse.Namespace) -> int:
    try:  # (vLLM's logging variables, as the server reads them: vLLM's offline LLM reads them too)
        check_environment()
        log_config = logging_config()
        configure_logging(log_config)
        flags = sampling_flags(args)
        check_sampling_flags(flags)  # (a flag out of range said now, before the weights load)
        # (ranks it starts itself, -tp N without torchrun, log as this one does)
        engine = engine_from_args(args, rank_setup=partial(configure_logging, log_config))
    except TPGraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with engine:
        try:
            params = engine.default_params(**{**own_defaults(engine), **flags})
            start = time.perf_counter()
            if args.chat:
                outputs = engine.chat([[{"role": "user", "content": prompt}] for prompt in args.prompt], params)
            else:
                outputs = engine.generate(args.prompt, params)
            elapsed = time.perf_counter() - start
        except TPGraphError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if engine.state.is_driver:
            print(engine.runner.stats.summary())
            for out in outputs:
                c = out.outputs[0]
                print(f"prompt: {out.prompt!r}\ncompletion: {c.text!r}\ntoken ids: {c.token_ids}\n"
                      f"finish reason: {c.finish_reason}\n")
            n = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(f"[tp={engine.state.world_size} device={engine.state.device.type} "
                  f"dtype={engine.model.embed_tokens.weight.dtype}] {n} tokens in {elapsed:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
