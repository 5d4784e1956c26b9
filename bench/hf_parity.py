"""GPU parity check: our TP Llama vs transformers.LlamaForCausalLM on a random checkpoint.

    torchrun --nproc-per-node 2 bench/hf_parity.py --out bench/results/hf_parity.json [--arch qwen2|qwen3]

Rank 0 writes a random Llama-3.2-1B-shaped checkpoint (fewer layers; --arch: Qwen2.5-1.5B's shape with its q, k and v
biases drawn at random, or Qwen3-1.7B's with its q and k norms) with save_pretrained. Every rank
loads its TP shard and generates greedily in bf16 (prefill + paged decode with the Triton kernel).
Rank 0 then runs HF on one GPU: its own greedy tokens (generate with KV cache), and its logits along
our tokens (one teacher-forced pass). Pass: identical tokens and per-step relative logits error < 1e-2.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tpgraph.comm import TPCommunicator
from tpgraph.distributed import destroy_distributed, init_distributed
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.model.loader import load_model

TEARDOWN_TIMEOUT_S = 60
MODEL_LEN = 256
SHAPE = dict(  # Llama 3.2 1B, 4 of its 16 layers
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192, rope_theta=500000.0),
)
# the other architectures' shapes (--arch): Qwen2.5-1.5B (biases on q, k, v) and Qwen3-1.7B (q and k normed per head)
ARCH_SHAPES = {
    "llama": SHAPE,
    "qwen2": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=4,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "qwen3": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
}
PROMPTS = [[128000, 791, 6864, 315, 9822, 374], [128000, 40, 1093, 311, 1373, 264, 3446, 922, 264, 2697, 11, 279],
           [128000] + list(range(1000, 1040))]


def make_checkpoint(path: Path, seed: int, layers: int, embed_std: float | None, arch: str = "llama") -> None:
    """HF's default init, or (embed_std set) a well-conditioned variant: large embeddings that dominate the
    residual stream and an untied head whose rows are a permutation of them, so each step's top logit is
    far above bf16 rounding noise (HF's default init has exact bf16 ties at the top). Biases (which HF's init makes
    0) are drawn at random, and Qwen3's q and k norms (all 1 there) moved 0.1 apart, so that one left out, added
    twice or taken for the other would show."""
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    torch.manual_seed(seed)
    shape = {**ARCH_SHAPES[arch], "num_hidden_layers": layers}
    if embed_std is not None:
        shape["tie_word_embeddings"] = False
    cfg = getattr(transformers, f"{name}Config")(initializer_range=0.02, dtype="bfloat16", **shape)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif param_name.endswith((".q_norm.weight", ".k_norm.weight")):
                param.add_(0.1 * torch.randn_like(param))
    if embed_std is not None:
        with torch.no_grad():
            emb = model.model.embed_tokens.weight
            emb.normal_(0.0, embed_std)
            model.lm_head.weight.copy_(emb[torch.randperm(emb.shape[0])] / embed_std * 0.02)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="1GB")


def hf_reference(path: Path, prompts, our_tokens, steps: int, dtype: torch.dtype):
    """HF greedy tokens (generate, KV cache) and HF logits along our tokens (one teacher-forced pass)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    hf_tokens, forced = [], []
    with torch.no_grad():
        for prompt, ours in zip(prompts, our_tokens, strict=True):
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            hf_tokens.append(out[0, len(prompt):].tolist())
            seq = torch.tensor([prompt + ours[:-1]], device="cuda")
            forced.append(model(seq).logits[0, len(prompt) - 1:].float().cpu())
    del model
    torch.cuda.empty_cache()
    return hf_tokens, forced


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, each refused by name before any GPU work (a checkpoint written, a model loaded) is spent."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--arch", default="llama", choices=tuple(ARCH_SHAPES),
                   help="the checkpoint's architecture and shape (ARCH_SHAPES)")
    p.add_argument("--embed-std", type=float, default=None, help="well-conditioned checkpoint (see make_checkpoint)")
    p.add_argument("--copies", type=int, default=1,
                   help="run the prompts this many times over in one batch (8: 24 rows a decode step), each checked")
    args = p.parse_args(argv)
    for name in ("steps", "layers", "copies"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.embed_std is not None and not args.embed_std > 0:
        p.error(f"--embed-std must be positive, got {args.embed_std}")
    if args.out is not None and not args.out.resolve().parent.is_dir():
        p.error(f"--out {args.out}: folder {args.out.resolve().parent} does not exist")
    return args


def model_len(prompts: list[list[int]], steps: int) -> int:
    """The runner's max_model_len: 256 (what every recorded run used: it sizes decode attention's splits), or more
    where the longest prompt and its `steps` new tokens need more."""
    return max(MODEL_LEN, max(len(prompt) for prompt in prompts) + steps)


def main() -> None:
    args = parse_args()

    state = init_distributed("cuda")
    workdir = [tempfile.mkdtemp(prefix="tpgraph_parity_") if state.is_driver else None]
    dist.broadcast_object_list(workdir, src=0, group=state.cpu_group)
    ckpt = Path(workdir[0])
    if state.is_driver:
        make_checkpoint(ckpt, args.seed, args.layers, args.embed_std, args.arch)
    dist.barrier(group=state.cpu_group)

    comm = TPCommunicator(state)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_model(state, comm, ckpt, dtype=dtype)
    prompts = PROMPTS * args.copies
    runner = ModelRunner(model, RunnerConfig(block_size=16, max_batch=len(prompts),
                                             max_model_len=model_len(prompts, args.steps)))
    modes = f"decode {runner.modes.decode}, prefill {runner.modes.prefill} ({runner.prefill_attention})"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = greedy_generate(runner, prompts, args.steps, keep_logits=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    dist.barrier(group=state.cpu_group)
    # every rank gives back its graphs (NCCL kernels captured in them), KV cache and all-reduce workspace before the
    # process group goes: left open, both ranks waited forever in destroy_process_group (2xH200, 2026-11-30)
    runner.close()
    comm.close()
    del model, runner
    torch.cuda.empty_cache()

    ok = True  # (the driver's verdict; the other ranks' exit leaves it to the driver's)
    if state.is_driver:
        hf_tokens, forced = hf_reference(ckpt, prompts, result.tokens, args.steps, dtype)
        # fp32 HF on the same (bf16-stored) weights: the noise floor of bf16 arithmetic itself
        _, forced32 = hf_reference(ckpt, prompts, result.tokens, args.steps, torch.float32)
        shutil.rmtree(ckpt, ignore_errors=True)  # about 1.5 GB a run, left in /tmp by every earlier run
        report = {"tp": state.world_size, "dtype": args.dtype, "steps": args.steps, "copies": args.copies,
                  "layers": args.layers, "embed_std": args.embed_std, "arch": args.arch,
                  "shape": ARCH_SHAPES[args.arch],
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "prompts": []}
        for b, prompt in enumerate(prompts):
            ours = torch.stack([step[b] for step in result.step_logits])
            ref = forced[b]
            rel = rel_err(ours, ref)
            ours_vs_fp32 = rel_err(ours, forced32[b]).max().item()
            hf_vs_fp32 = rel_err(ref, forced32[b]).max().item()
            top2 = ref.topk(2, dim=-1).values
            same = result.tokens[b] == hf_tokens[b]
            pairs = zip(result.tokens[b], hf_tokens[b], strict=False)
            first_diff = next((i for i, (a, c) in enumerate(pairs) if a != c), None)
            ok &= same and rel.max().item() < 1e-2
            report["prompts"].append({
                "prompt_len": len(prompt), "tokens_identical": same, "first_divergence": first_diff,
                "max_rel_logits_err": rel.max().item(), "median_rel_logits_err": rel.median().item(),
                "min_top1_top2_margin": (top2[:, 0] - top2[:, 1]).min().item(),
                "max_rel_err_ours_vs_hf_fp32": ours_vs_fp32, "max_rel_err_hf_vs_hf_fp32": hf_vs_fp32,
                "ours": result.tokens[b], "hf": hf_tokens[b],
            })
            print(f"prompt {b} (len {len(prompt)}): tokens identical={same} first_divergence={first_diff} "
                  f"max rel err={rel.max().item():.2e} median={rel.median().item():.2e} | vs HF fp32: "
                  f"ours {ours_vs_fp32:.2e}, HF {args.dtype} {hf_vs_fp32:.2e}")
        report["pass"] = ok
        report["our_generate_s"] = elapsed
        report["graphs"] = modes
        # what chose the paths: the knobs set (e.g. TPGRAPH_GEMV_ALLREDUCE, TPGRAPH_SHARED_GPU) and NCCL's version
        report["settings"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("TPGRAPH_", "NCCL_"))}
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        print(f"PASS={ok}  (ours: {args.steps} steps x {len(prompts)} prompts in {elapsed:.2f}s; graphs: {modes})")
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    dist.barrier(group=state.cpu_group)  # rank 0 compared against HF meanwhile: start the teardown together
    # a teardown that hangs dumps every thread's stack and exits, instead of holding the job to its time limit
    faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_S, exit=True)
    destroy_distributed(state)
    faulthandler.cancel_dump_traceback_later()
    if not ok:  # a failed comparison fails the command (torchrun, and the scripts that run it, see the exit status)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
