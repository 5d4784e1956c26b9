"""Where a whole `TPEngine.generate` makes the host wait for the GPU, by call site (torch's sync debug mode, 'warn').

    python bench/sync_scan.py

The built-in model on one GPU, bf16, graphs on, four prompts of 32 tokens by sampling mix. In the overlapped loop the
one wait a step needs is the sampled ids' event, which the debug mode does not count; anything listed here is a copy
or a read that stalls the loop behind the GPU (bench/results/2026-12-04_h200_fused_sampling found chunked prefill's).
"""
import collections
import warnings

import torch

from tpgraph import SamplingParams, TPEngine

PROMPTS = ["The quick brown fox", "tpgraph " * 20, "a" * 300, "Hello, world! How are you today, my friend?"]
MIXES = {"greedy": SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
         "sampled": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True),
         "sampled+penalties": SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                                             frequency_penalty=0.3, max_tokens=32, ignore_eos=True),
         "top-k+seed+logprobs": SamplingParams(temperature=0.7, top_k=40, seed=5, logprobs=3, max_tokens=32,
                                               ignore_eos=True)}
with TPEngine(device="cuda", max_num_seqs=8, max_model_len=512, dtype="bfloat16", gpu_memory_utilization=0.3) as eng:
    for name, params in MIXES.items():
        eng.generate(PROMPTS, params, use_tqdm=False)  # warm
        sites = collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outs = eng.generate(PROMPTS, params, use_tqdm=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                sites[f"{w.filename.split('tpgraph/')[-1]}:{w.lineno}"] += 1
        steps = sum(len(c.token_ids) for o in outs for c in o.outputs)
        print(f"== {name}: {sum(sites.values())} synchronizing calls over {steps} tokens")
        for site, n in sites.most_common(12):
            print(f"   {n:5d} {site}")
