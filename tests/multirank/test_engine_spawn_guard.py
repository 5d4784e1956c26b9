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


def test_a_started_rank_that_dies_before_it_starts_is_named_at_once(tmp_path):
    script = tmp_path / "unguarded.py"  # (a file: spawn re-runs a script's module, not a `python -c` string)
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=180)  # (the hang this guards against was the rendezvous's 600 s)
    assert proc.returncode != 0 and "generated" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "rank 1" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]
