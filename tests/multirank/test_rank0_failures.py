"""A failure that only rank 0 sees (host code that rank 0 alone runs: preparing a request, a front end's sink, the
step hook, its own step) never leaves the other ranks in a different request set or step: the engine serves on with
the right tokens on every rank, or every rank stops with the error, never hangs."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tpgtest.processes import followers_of, gone
from tpgtest.spawn import run_ranks
from tpgtest.workers import service_with_rank0_failure

from tpgraph import SamplingParams, TPEngine

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "tpgraph", "Hello, world! How are you today, my friend?"]
ENGINE = dict(max_num_seqs=4, max_model_len=64, num_kv_blocks=32, block_size=4)


def fresh_tokens(prompts: list[str], max_tokens: int) -> list[list[int]]:
    with TPEngine(device="cpu", **ENGINE) as engine:
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("failure", ["detokenizer", "sink", "on_step"])
def test_the_service_serves_on_after_a_rank0_only_failure(failure):
    """The server's loop at TP=2. Before: rank 0 answered a request it could not add while rank 1 added it (or rank
    0's loop died on a sink or the step hook while rank 1 went on), and the next step hung in a collective."""
    ranks = run_ranks(service_with_rank0_failure, 2, failure, PROMPTS, ENGINE, 60.0, timeout_s=180)
    zero = ranks[0]
    assert zero["told"] and zero["error"] == "None", zero
    assert all(r["requests"] == [] and not r["has_work"] for r in ranks), ranks  # nothing left behind on any rank
    updates = zero["updates"]
    good = fresh_tokens(PROMPTS[:1], 8)[0]
    assert [t for t, _ in updates["good"]] == good and updates["good"][-1][1] == "length"
    assert [[t for t, _ in updates[f"after-{i}"]] for i in range(len(PROMPTS))] == fresh_tokens(PROMPTS, 8)
    bad = {"detokenizer": [(None, "error")],
           "sink": [],  # (its sink went with its first token: the request was aborted on every rank)
           "on_step": [(t, None) for t in good[:6]] + [(good[6], "length")]}  # (greedy: 7 of good's 8 tokens)
    assert updates["bad"] == bad[failure]


SCRIPT = """
import sys
from tpgtest.workers import fail_detokenizers
from tpgraph import RequestError, SamplingParams, TPEngine

if __name__ == "__main__":
    kw = dict(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=32, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with TPEngine(tp_size=2, **kw) as engine:
        print("followers", [p.pid for p in engine._followers], flush=True)
        if sys.argv[1] == "detokenizer":  # this process is rank 0; its follower imported the module afresh
            fail_detokenizers(max_tokens=7)
            try:
                engine.generate("tpgraph", SamplingParams(temperature=0.0, max_tokens=7))
            except RequestError as exc:
                print("refused:", exc, flush=True)
            print("after:", engine.generate(["The quick brown fox"], greedy)[0].outputs[0].token_ids, flush=True)
        else:  # rank 0's step fails reading its tokens back, after its forward and the next message went out
            real_resolve, calls = engine.core._resolve, []
            def resolve():
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("rank 0's step failed")
                return real_resolve()
            engine.core._resolve = resolve
            for _ in range(2):
                try:
                    engine.generate("tpgraph", greedy)
                except RuntimeError as exc:
                    print("raised:", exc, flush=True)
    print("closed", flush=True)
"""


def run_script(mode: str, timeout_s: float = 120.0) -> tuple[str, list[int]]:
    """The script's output and its followers' pids; a hang (the ranks desynced) fails with what it printed."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        hung = False
    except subprocess.TimeoutExpired as exc:
        out, hung = exc.output or "", True
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
    pids = [p for line in out.splitlines() if line.startswith("followers") for p in followers_of(line)]
    if hung:
        for pid in [proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        pytest.fail(f"no end within {timeout_s:.0f} s (a hang):\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out, pids


def test_generate_at_tp2_answers_a_request_rank0_alone_cannot_prepare():
    """TPEngine(tp_size=2)'s own loop: refused, then the next generate is right. Before: a hang."""
    out, _ = run_script("detokenizer")
    assert "refused: rank 0 alone" in out, out[-3000:]  # (one prompt's refusal names no prompt, as everywhere)
    assert f"after: {fresh_tokens(PROMPTS[:1], 8)[0]}" in out, out[-3000:]


def test_a_failed_rank0_step_stops_every_rank():
    """Rank 0's step fails while rank 1 runs it: generate raises it, the engine takes no more turns (it would wait in
    a collective rank 1 is not in), and closing it ends rank 1. Before: generate's abort hung."""
    out, pids = run_script("step")
    lines = [line for line in out.splitlines() if line.startswith("raised:")]
    assert lines[0] == "raised: rank 0's step failed", out[-3000:]
    assert lines[1].startswith("raised: the engine loop failed earlier (RuntimeError: rank 0's step failed)")
    assert "stopping the other ranks" in out and "closed" in out, out[-3000:]
    assert pids and all(gone(p) for p in pids)
