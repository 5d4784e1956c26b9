"""TPEngine at TP=2 on GPUs (or both ranks on one, TPGRAPH_SHARED_GPU=1): ranks it starts itself and ranks torchrun
starts, each started twice in one process (every start's process group keys its rendezvous under its own prefix),
with the custom all-reduce set up (not fallen back to NCCL) and the TP=1 tokens (fp32, greedy)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tpgtest.markers import needs_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              needs_gpus(2)]
ROOT = Path(__file__).resolve().parents[2]
COMMON = """
from tpgraph import SamplingParams, TPEngine

KW = dict(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=256, gpu_memory_utilization=0.2)
PROMPTS = ["The quick brown fox", "tpgraph " * 20, "a" * 100, "Hello, world! How are you today, my friend?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def run(**kw):
    with TPEngine(**KW, **kw) as engine:
        custom = engine.comm.custom is not None
        reason = engine.comm.custom_reason
        ids = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    return ids, custom, reason
"""
STARTED = COMMON + """
if __name__ == "__main__":
    first, custom, reason = run(tp_size=2)
    second, custom2, _ = run(tp_size=2)
    one, _, _ = run()
    print("custom:", custom, custom2, reason, flush=True)
    print("tp2 == tp1:", first == one, "again:", second == one, flush=True)
"""
TORCHRUN = COMMON + """
import json, os

first, custom, reason = run(tp_size=2)
second, custom2, _ = run(tp_size=2)
with open(f"rank{os.environ['RANK']}.json", "w") as f:  # (the ranks' prints would interleave in one stdout)
    json.dump(dict(custom=[custom, custom2], reason=reason, ids=first, again=first == second), f)
"""


def script_run(tmp_path: Path, text: str, launcher: list[str], timeout_s: float) -> str:
    script = tmp_path / "script.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*launcher, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=timeout_s)
    out = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    return proc.stdout


def test_started_ranks_use_the_custom_all_reduce_and_match_one_rank_twice(tmp_path):
    out = script_run(tmp_path, STARTED, [sys.executable], timeout_s=500)
    assert "custom: True True" in out, out
    assert "tp2 == tp1: True again: True" in out, out


def test_torchrun_ranks_start_two_engines_in_one_job_with_the_custom_all_reduce(tmp_path):
    script_run(tmp_path, TORCHRUN, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"],
               timeout_s=500)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["custom"] == [True, True] and r["again"] for r in ranks), ranks
    assert ranks[0]["ids"] == ranks[1]["ids"], ranks  # (the ranks sample the same tokens)
