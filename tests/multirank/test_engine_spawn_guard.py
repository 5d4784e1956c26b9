"""TPEngine(tp_size=2) in a script with no `if __name__ == "__main__":` guard: the started rank re-imports the script
(multiprocessing's spawn) and dies before it starts. Rank 0 then waited in the process group's rendezvous for it,
600 s, and said nothing; it now refuses at once, naming the rank and the guard."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNGUARDED = """
from tpgraph import SamplingParams, TPEngine

with TPEngine(tp_size=2, device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=17, block_size=4) as engine:
    print("generated", engine.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids, flush=True)
"""


def run_script(tmp_path: Path, text: str, timeout_s: float, threads: str | None = "1") -> subprocess.CompletedProcess:
    """`text` run as a script file (spawn re-runs a script's module, not a `python -c` string), OMP_NUM_THREADS set
    to `threads` (None: unset)."""
    script = tmp_path / "script.py"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env = {**env, "PYTHONPATH": str(ROOT), **({} if threads is None else {"OMP_NUM_THREADS": threads})}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=timeout_s)


def test_a_started_rank_that_dies_before_it_starts_is_named_at_once(tmp_path):
    proc = run_script(tmp_path, UNGUARDED, timeout_s=180)  # (the hang this guards against was the rendezvous's 600 s)
    assert proc.returncode != 0 and "generated" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "rank 1" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]


GUARDED = """
import torch
from tpgraph import SamplingParams, TPEngine

if __name__ == "__main__":
    before = torch.get_num_threads()
    with TPEngine(tp_size=2, device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=17, block_size=4) as e:
        e.generate(["Hi"], SamplingParams(max_tokens=2))
        print("threads", torch.get_num_threads(), flush=True)
    print("after close, as before:", torch.get_num_threads() == before, flush=True)
"""


def test_cpu_ranks_started_in_a_plain_process_share_the_cores(tmp_path, monkeypatch):
    """torchrun gives each rank OMP_NUM_THREADS=1; ranks TPEngine(tp_size=N) started for itself each took every core,
    and TP=2 on two cores ran 10x slower than under torchrun. Each rank takes its share now (the user's own
    OMP_NUM_THREADS, where set, is left to rule)."""
    from tpgraph.engine.followers import cpu_threads_per_rank

    proc = run_script(tmp_path, GUARDED, timeout_s=180, threads=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    assert f"threads {max(1, cores // 2)}" in proc.stdout, proc.stdout
    assert "after close, as before: True" in proc.stdout, proc.stdout  # (the user's process gets its cores back)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_rank(2) is None


DIES_BEFORE_JOINING = """
import tpgraph.engine.tp_engine as tp_engine
from tpgraph import SamplingParams, TPEngine
from tpgraph.errors import ConfigError

if __name__ == "__mp_main__":  # (the started rank: it fails where a rank with no GPU of its own fails, past its start)
    def no_gpu(*args, **kwargs):
        raise ConfigError("local rank 1 has no GPU: only 1 visible (injected)")

    tp_engine.init_distributed = no_gpu

if __name__ == "__main__":
    with TPEngine(tp_size=2, device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=17, block_size=4) as e:
        print("generated", e.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids, flush=True)
"""


def test_a_started_rank_that_dies_after_it_starts_and_before_it_joins_is_named_at_once(tmp_path):
    """A started rank that fails past its start and before the process group's rendezvous (TPEngine(tp_size=2) on a
    host with one GPU: rank 1 finds no GPU of its own) left rank 0 silent in the rendezvous for 600 s: its readiness
    was sent as it started. Rank 0 now waits for each rank to reach the rendezvous, and names one that dies first."""
    proc = run_script(tmp_path, DIES_BEFORE_JOINING, timeout_s=120)  # (the hang: the rendezvous's 600 s)
    assert proc.returncode != 0 and "generated" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "rank 1" in proc.stderr and "before it joined" in proc.stderr, proc.stderr[-3000:]
