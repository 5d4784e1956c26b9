"""Whole engine steps by sampling mix: what a user's decode step costs once sampling options are on.

    python bench/bench_engine_steps.py --shape llama3-8b-half --batches 8,32 --prompt-len 4096 \\
        --mixes greedy,penalties,sampled,sampled+penalties --out steps.json

`bench_decode.py` times the runner's forward; this drives `EngineCore.step` as `TPEngine.generate` does (overlapped
scheduling, the sampler, the host's token handling) on random weights of a named shape at TP=1, from a config.json
written to a temporary directory. Per point (batch, prompt length, mix) it queues `batch` requests of
`--prompt-len` random token ids that each generate `--tokens` tokens (ignore_eos), steps until they finish, and
reports over the steps that decoded the whole batch (after every prefill): the median wall time a step (one
`core.step()` call; in the overlapped loop that is one step's period), the share that overlapped the last step's
read-back, and the host's parts of a step (StepTiming). The first point pays one-time costs; `--warmup` runs a short
point first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench_decode import SHAPES

from tpgraph import TPEngine
from tpgraph.config import BUILTIN_MODEL, ModelConfig
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.structured import StructuredOutput
from tpgraph.graphs.config import GraphConfig

MIXES = {
    "greedy": dict(temperature=0.0),
    "penalties": dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2),
    "sampled": dict(temperature=0.8, top_p=0.95),
    "temperature": dict(temperature=0.8),
    "top-k": dict(temperature=0.8, top_k=50),
    "top-k+top-p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "top-k+min-p": dict(temperature=0.7, top_k=50, min_p=0.05),
    "top-k+penalties": dict(temperature=0.8, top_k=50, repetition_penalty=1.1),
    "sampled+penalties": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.2),
    # 300 biased ids a request (the OpenAI limit; run_point lists them): the bias upload a step (session 58)
    "logit-bias": dict(temperature=0.0),
    # one constrained row among greedy ones (row 0 below): the grammar bitmask's host work a step (session 58)
    "one-regex": dict(temperature=0.0),
}
# mixes whose first row differs from the rest; its regex outlasts any --tokens, so every step is constrained
FIRST_ROW = {"one-regex": dict(temperature=0.0, structured=StructuredOutput("regex", "[a-z ]{1000,3000}"))}


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json a checkpoint of this shape would have (ModelConfig.from_hf_dict reads it back)."""
    rope = cfg.rope
    scaling = None if rope.type == "default" else {
        "rope_type": rope.type, "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings}
    if cfg.qkv_bias or cfg.o_proj_bias or cfg.mlp_bias:
        raise ValueError("hf_config writes Llama and Qwen3 shapes without biases")
    # Qwen3's config names its per-head q/k norms by its architecture alone
    arch, model_type = ("Qwen3ForCausalLM", "qwen3") if cfg.qk_norm else ("LlamaForCausalLM", "llama")
    return {"architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": rope.theta, "rope_scaling": scaling,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2}


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A byte-level tokenizer.json whose every id decodes (the built-in byte tokenizer has 258: the random model's ids
    past it were held back undecoded, which understated the detokenizer's work a token): the 256 byte symbols, then
    words of a space and letters, as a real BPE vocabulary's ids decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = ["<unk>", "<s>", "</s>", *pre_tokenizers.ByteLevel.alphabet()]
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(tokens) < vocab_size:
        i, word = len(tokens), ""
        while True:
            i, r = divmod(i, len(letters))
            word += letters[r]
            if not i:
                break
        tokens.append("\u0120" + word)  # (Ġ: the byte-level symbol of a space)
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens[:vocab_size])}, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(model_dir / "tokenizer.json"))


def run_point(engine: TPEngine, batch: int, prompt_len: int, tokens: int, mix: str, seed: int) -> dict:
    core, vocab = engine.core, engine.model.cfg.vocab_size
    table = getattr(engine.runner, "penalties", None)  # (None in trees from before the count table)
    fills = table.fills if table is not None else 0
    rng = random.Random(seed)
    biased = {"logit_bias": {token: 0.5 for token in range(min(300, vocab))}} if mix == "logit-bias" else {}
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, **MIXES[mix], **biased)
    # (a constrained row cannot ignore the EOS: its grammar allows it only past 1000 letters)
    first = SamplingParams(max_tokens=tokens, **FIRST_ROW[mix]) if mix in FIRST_ROW else params
    for i in range(batch):
        core.add_request(f"{mix}-{batch}-{seed}-{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)],
                         first if i == 0 else params)
    steps = []
    while core.has_work:
        t0 = time.perf_counter()
        core.step()
        wall = time.perf_counter() - t0
        t = core.timing
        if t.decode_batch == batch and not t.prefill:
            steps.append({"wall": wall, "overlapped": t.overlapped, "schedule": t.schedule, "prepare": t.prepare,
                          "submit": t.submit, "sample": t.sample, "postprocess": t.postprocess})
    if not steps:
        raise SystemExit(f"no step decoded all {batch} rows at once: raise --tokens, or the KV cache's size")
    ms = lambda key: round(1e3 * statistics.median(s[key] for s in steps), 4)  # noqa: E731
    return {"batch": batch, "prompt_len": prompt_len, "mix": mix, "steps": len(steps),
            "step_ms": ms("wall"), "overlapped": sum(s["overlapped"] for s in steps) / max(len(steps), 1),
            "host_ms": {k: ms(k) for k in ("schedule", "prepare", "submit", "sample", "postprocess")},
            "fills": table.fills - fills if table is not None else None}  # this point's sequences filled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=(*SHAPES, "builtin"), default="llama3-8b-half",
                   help="builtin: the small default model (a run on CPU)")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--mixes", default="greedy,penalties")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the prompt, the tokens and a block")
    p.add_argument("--warmup", action="store_true", help="run a short point of each mix first, untimed")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    mixes = args.mixes.split(",")
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        raise SystemExit(f"unknown mixes {unknown}; choose from {', '.join(MIXES)}")
    max_len = args.max_model_len or args.prompt_len + args.tokens + 16
    with tempfile.TemporaryDirectory() as model_dir:
        cfg = SHAPES.get(args.shape, BUILTIN_MODEL)
        (Path(model_dir) / "config.json").write_text(json.dumps(hf_config(cfg)))
        write_tokenizer(Path(model_dir), cfg.vocab_size)
        with TPEngine(model_dir, load_format="dummy", max_num_seqs=max(batches), max_model_len=max_len,
                      max_num_batched_tokens=max(max_len, 8192),
                      graphs=GraphConfig(ladder=tuple(sorted(set(batches))))) as engine:
            if args.warmup:
                for mix in mixes:
                    run_point(engine, min(batches), 64, 8, mix, seed=0)
            results = []
            for batch in batches:
                for mix in mixes:
                    r = run_point(engine, batch, args.prompt_len, args.tokens, mix, seed=1)
                    results.append(r)
                    print(f"batch {batch:3d} prompt {args.prompt_len} {mix:18s} step {r['step_ms']:.3f} ms "
                          f"(overlapped {r['overlapped']:.0%}, {r['steps']} steps) host {r['host_ms']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "tokens": args.tokens, "results": results}, indent=1))


if __name__ == "__main__":
    main()
