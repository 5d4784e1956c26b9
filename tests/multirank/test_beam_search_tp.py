"""TPEngine.beam_search at TP=2 on CPU: under two gloo ranks (SPMD, each rank searching with the same arguments) and
from a plain process that starts its second rank itself, the sequences TP=1 finds. beam_search drives the engine
through generate alone, so the ranks step together as they do for generate."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tpgtest.spawn import run_ranks
from tpgtest.workers import engine_beam_search, engine_beam_search_per_rank

from tpgraph import BeamSearchParams, TPEngine

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "tpgraph", "Hello, world! How are you today?"]
FIELDS = dict(beam_width=3, max_tokens=6, length_penalty=1.5)
ENGINE = dict(max_num_seqs=4, max_model_len=64, num_kv_blocks=40, block_size=4)  # (9 beams a step, 4 at a time)


def one_rank() -> list:
    with TPEngine(device="cpu", **ENGINE) as engine:
        out = engine.beam_search(PROMPTS, BeamSearchParams(**FIELDS))
    return [[(s.tokens, s.cum_logprob, s.finish_reason, s.text) for s in o.sequences] for o in out]


def same(got: list, want: list) -> None:
    assert [[(t, r, x) for t, _, r, x in o] for o in got] == [[(t, r, x) for t, _, r, x in o] for o in want]
    assert [c for o in got for _, c, _, _ in o] == pytest.approx([c for o in want for _, c, _, _ in o], abs=1e-4)


def test_two_spmd_ranks_find_one_ranks_sequences():
    ranks = run_ranks(engine_beam_search, 2, PROMPTS, FIELDS, ENGINE, timeout_s=240)
    assert ranks[0] == ranks[1] and ranks[0]["blocks_back"]
    same(ranks[0]["sequences"], one_rank())


def test_ranks_that_search_with_other_params_are_refused_on_every_rank():
    """One rank's other length_penalty would have its beams part from the others' at a later step: every rank refuses
    the call before any step, naming the rank, and searches on with matching calls."""
    fields = [FIELDS, {**FIELDS, "length_penalty": 0.5}]
    ranks = run_ranks(engine_beam_search_per_rank, 2, PROMPTS[:1], fields, ENGINE, timeout_s=240)
    for error, _ in ranks:
        assert error is not None and error.startswith("rank(s) [1] made another call than rank 0's beam_search")
    assert ranks[0][1] == ranks[1][1] and len(ranks[0][1]) > FIELDS["max_tokens"]


SCRIPT = """
import json
from tpgraph import BeamSearchParams, TPEngine

if __name__ == "__main__":
    prompts, fields, kw = json.loads(input())
    with TPEngine(tp_size=2, device="cpu", **kw) as engine:
        out = engine.beam_search(prompts, BeamSearchParams(**fields))
        after = engine.generate(prompts[:1], engine.default_params(temperature=0.0, max_tokens=3))
    print(json.dumps([[[s.tokens, s.cum_logprob, s.finish_reason, s.text] for s in o.sequences] for o in out]))
    print(len(after[0].outputs[0].token_ids))
"""


def test_a_plain_process_at_tp_2_drives_its_started_rank_through_the_search():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], input=json.dumps([PROMPTS, FIELDS, ENGINE]),
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    found = [[tuple(s) for s in o] for o in json.loads(lines[-2])]  # (JSON: lists for tuples)
    same(found, one_rank())
    assert lines[-1] == "3"  # (the engine generates on after the search)
