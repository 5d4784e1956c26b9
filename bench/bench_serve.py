"""Serving benchmark: a loaded run at each of a list of concurrencies (streaming requests) against `tpgraph.serve`.

    torchrun --nproc-per-node 2 -m tpgraph.serve --model DIR --load-format dummy --max-num-seqs 64 &
    python bench/bench_serve.py --url http://127.0.0.1:8000 --model DIR --concurrency 64 --out serve.json

Client side (stdlib only, one thread per request): TTFT (request sent -> first token) and TPOT ((last - first token)
/ (tokens - 1)) per request, p50 and p99, and output tokens/s over the run. Server side, from /metrics, the mean host
time per decode step by part (schedule, control path, input preparation, launch, postprocess), the mean decode GPU
time, and the mean decode batch. `ignore_eos` makes every request generate exactly --max-tokens tokens.

--score-batch B adds a scoring run at each concurrency: each client sends one request of B prompts to be scored
(echo, logprobs 1, max_tokens 0: every prompt token's log-probability, nothing generated; lm-eval's loglikelihood
requests send max_tokens 1 and drop that token), and the run reports prompt tokens scored per second and the
request latency.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def stream_one(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                stamps.append(time.perf_counter())
    ttft = stamps[0] - sent if stamps else float("nan")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return {"ttft_s": ttft, "tpot_s": tpot, "chunks": len(stamps), "done_s": stamps[-1] - sent if stamps else 0.0}


def score_one(url: str, model: str, prompts: list[str]) -> dict:
    body = json.dumps({"model": model, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.loads(r.read())
    entries = sum(len(c["logprobs"]["token_logprobs"]) for c in reply["choices"])
    return {"latency_s": time.perf_counter() - sent, "prompt_tokens": reply["usage"]["prompt_tokens"],
            "complete": entries == reply["usage"]["prompt_tokens"]}


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def summed(scraped: dict[str, float], name: str) -> float:
    """A metric's value summed over its label sets (vLLM's carry model_name and engine)."""
    return sum(v for k, v in scraped.items() if k == name or k.startswith(name + "{"))


def step_means(before: dict, after: dict) -> dict[str, float]:
    """Mean per decode step of each host part, the GPU time and the sampling wait; the mean wall time of every step
    and of the prefill forwards of the steps that had one; between two scrapes (ms)."""
    def mean(sum_key: str, count_key: str) -> float:
        n = after.get(count_key, 0) - before.get(count_key, 0)
        return (after.get(sum_key, 0) - before.get(sum_key, 0)) / n * 1e3 if n else float("nan")

    means = {}
    for part in ("schedule", "control", "prepare", "submit", "postprocess"):
        means[f"host_{part}_ms"] = mean(f'tpgraph_step_host_seconds_sum{{part="{part}"}}',
                                        f'tpgraph_step_host_seconds_count{{part="{part}"}}')
    means["host_total_ms"] = sum(v for k, v in means.items() if v == v)
    means["gpu_decode_ms"] = mean("tpgraph_decode_gpu_seconds_sum", "tpgraph_decode_gpu_seconds_count")
    means["sample_ms"] = mean("tpgraph_step_sample_seconds_sum", "tpgraph_step_sample_seconds_count")
    steps = after.get("tpgraph_step_sample_seconds_count", 0) - before.get("tpgraph_step_sample_seconds_count", 0)
    means["decode_steps"] = steps
    means["step_wall_ms"] = mean("tpgraph_engine_step_seconds_sum", "tpgraph_engine_step_seconds_count")
    means["steps"] = (after.get("tpgraph_engine_step_seconds_count", 0)
                      - before.get("tpgraph_engine_step_seconds_count", 0))
    means["prefill_ms"] = mean("tpgraph_step_prefill_seconds_sum", "tpgraph_step_prefill_seconds_count")
    means["prefill_steps"] = (after.get("tpgraph_step_prefill_seconds_count", 0)
                              - before.get("tpgraph_step_prefill_seconds_count", 0))
    return means


def filler(tag: str, chars: int) -> str:
    """A prompt of `chars` characters that begins with its own tag (so no two are alike)."""
    return (f"{tag}: " + "lorem ipsum " * chars)[:chars]


def concurrently(clients: int, request: Callable[[int], dict]) -> tuple[list[dict], float]:
    """`request(i)` for each of `clients` at once, a thread each: their results and the wall time of them all."""
    results: list[dict] = [None] * clients  # type: ignore[list-item]

    def worker(i: int) -> None:
        results[i] = request(i)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def run(url: str, model: str, concurrency: int, max_tokens: int, prompt_len: int, shared: str = "") -> dict:
    """`shared`: a common beginning of every prompt (a system prompt), before each request's own prompt_len chars."""
    prompts = [shared + filler(f"request {i}", prompt_len) for i in range(concurrency)]
    before = scrape(url)
    results, wall = concurrently(concurrency, lambda i: stream_one(url, model, prompts[i], max_tokens))
    after = scrape(url)
    tokens = sum(r["chunks"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results]
    cached = {k: summed(after, f"vllm:prefix_cache_{k}_total") - summed(before, f"vllm:prefix_cache_{k}_total")
              for k in ("queries", "hits")}
    return {"concurrency": concurrency, "max_tokens": max_tokens, "prompt_chars": prompt_len,
            "shared_prefix_chars": len(shared), "prefix_cache_tokens": cached,
            "completed": sum(r["chunks"] == max_tokens for r in results), "wall_s": wall,
            "output_tokens_per_s": tokens / wall,
            "ttft_ms": {"p50": percentile(ttft, 0.5) * 1e3, "p99": percentile(ttft, 0.99) * 1e3},
            "tpot_ms": {"p50": percentile(tpot, 0.5) * 1e3, "p99": percentile(tpot, 0.99) * 1e3},
            "server_step": step_means(before, after)}


def run_score(url: str, model: str, concurrency: int, batch: int, prompt_len: int, tag: str) -> dict:
    """`concurrency` clients at once, each scoring `batch` prompts of prompt_len characters in one request (each
    prompt its own, `tag` making them new to the prefix cache, which scoring does not read anyway)."""
    results, wall = concurrently(concurrency, lambda i: score_one(
        url, model, [filler(f"{tag} {i}.{j}", prompt_len) for j in range(batch)]))
    latency = [r["latency_s"] for r in results]
    return {"concurrency": concurrency, "batch": batch, "prompt_chars": prompt_len, "wall_s": wall,
            "complete": sum(r["complete"] for r in results),
            "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in results) / wall,
            "latency_ms": {"p50": percentile(latency, 0.5) * 1e3, "p99": percentile(latency, 0.99) * 1e3}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--concurrency", default="64,1", help="comma-separated: a loaded run at each, in this order")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt characters (the byte tokenizer: ~tokens)")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="characters of a system prompt every request begins with, new for each loaded run (so the "
                        "warm-up does not cache it); the server's prefix caching computes it once")
    p.add_argument("--score-batch", type=int, default=0,
                   help="prompts per scoring request (echo, logprobs 1, max_tokens 0); 0: no scoring runs")
    p.add_argument("--out", type=Path, default=Path("bench_serve.json"))
    args = p.parse_args()

    def shared(tag: str) -> str:
        return (f"system prompt {tag}: " + "be brief. " * args.shared_prefix_len)[:args.shared_prefix_len]

    result = {}
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        run(args.url, args.model, concurrency, 16, args.prompt_len, shared("warm-up"))  # the same shapes, short
        r = result[f"x{concurrency}"] = run(args.url, args.model, concurrency, args.max_tokens, args.prompt_len,
                                            shared(f"x{concurrency}"))
        s = r["server_step"]
        print(f"x{r['concurrency']}: {r['completed']}/{r['concurrency']} complete, "
              f"{r['output_tokens_per_s']:.0f} tok/s, TTFT p50 {r['ttft_ms']['p50']:.1f} p99 {r['ttft_ms']['p99']:.1f} "
              f"ms, TPOT p50 {r['tpot_ms']['p50']:.2f} p99 {r['tpot_ms']['p99']:.2f} ms | per decode step: host "
              f"{s['host_total_ms']:.3f} ms (schedule {s['host_schedule_ms']:.3f}, control {s['host_control_ms']:.3f}, "
              f"prepare {s['host_prepare_ms']:.3f}, launch {s['host_submit_ms']:.3f}, post "
              f"{s['host_postprocess_ms']:.3f}), GPU {s['gpu_decode_ms']:.3f} ms, sample wait {s['sample_ms']:.3f} ms"
              f" | {s['steps']:.0f} steps of {s['step_wall_ms']:.2f} ms, {s['prefill_steps']:.0f} with prefill "
              f"({s['prefill_ms']:.1f} ms of it) | prompt tokens cached {r['prefix_cache_tokens']['hits']:.0f} of "
              f"{r['prefix_cache_tokens']['queries']:.0f}", flush=True)
        if args.score_batch:
            run_score(args.url, args.model, concurrency, args.score_batch, args.prompt_len, "warm-up")
            r = result[f"score_x{concurrency}"] = run_score(args.url, args.model, concurrency, args.score_batch,
                                                            args.prompt_len, f"x{concurrency}")
            print(f"score x{concurrency} of {args.score_batch} prompts: {r['complete']}/{concurrency} complete, "
                  f"{r['prompt_tokens_per_s']:.0f} prompt tok/s scored, latency p50 {r['latency_ms']['p50']:.1f} "
                  f"p99 {r['latency_ms']['p99']:.1f} ms", flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
