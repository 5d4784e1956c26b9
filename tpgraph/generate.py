"""`python -m tpgraph.generate`: greedy completions, any TP, CPU or GPU.

    python -m tpgraph.generate --prompt "Hello"                          # built-in model, one process
    torchrun --nproc-per-node 2 -m tpgraph.generate --prompt "Hi" --model DIR
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tpgraph.comm import TPCommunicator
from tpgraph.config import parse_dtype
from tpgraph.distributed import destroy_distributed, init_distributed
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.errors import TPGraphError
from tpgraph.graphs.config import add_graph_args, graph_config_from_args
from tpgraph.model.loader import LOAD_FORMATS, load_model
from tpgraph.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tpgraph.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the built-in model)")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: checkpoint dtype; fp32 on CPU)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8, help="largest decode batch (graphs are captured up to it)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: min(model's, 4096))")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use; the KV cache gets what is left of it")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights (built-in/dummy)")
    add_graph_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        state = init_distributed(args.device)
        comm = TPCommunicator(state)
        dtype = parse_dtype(args.dtype) if args.dtype else None
        model = load_model(state, comm, args.model, args.load_format, dtype, seed=args.seed)
        tokenizer = load_tokenizer(args.model, model.cfg.vocab_size)
        runner = ModelRunner(model, RunnerConfig(
            block_size=args.block_size, max_batch=max(args.max_num_seqs, len(args.prompt)),
            max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
            graphs=graph_config_from_args(args)))
        prompts = [tokenizer.encode(p).ids for p in args.prompt]
        start = time.perf_counter()
        result = greedy_generate(runner, prompts, args.max_tokens, eos_ids=model.cfg.eos_token_id)
        elapsed = time.perf_counter() - start
    except TPGraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if state.is_driver:
        print(runner.stats.summary())
        for prompt, ids in zip(args.prompt, result.tokens, strict=True):
            print(f"prompt: {prompt!r}\ncompletion: {tokenizer.decode(ids)!r}\ntoken ids: {ids}\n")
        n = sum(len(t) for t in result.tokens)
        print(f"[tp={state.world_size} device={state.device.type} dtype={model.embed_tokens.weight.dtype}] "
              f"{n} tokens in {elapsed:.2f}s")
    runner.close()  # graphs (which hold NCCL work) go before the process group
    comm.close()
    destroy_distributed(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
