"""TPEngine(tp_size=2) from a plain Python process starts its second rank itself, matches TP=1, survives a refused
request, and takes the rank down on exit and on Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tpgtest.processes import followers_of, gone

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, time
from tpgraph import RequestError, SamplingParams, TPEngine

if __name__ == "__main__":
    kw = dict(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=17, block_size=4)
    prompts = ["The quick brown fox", "tpgraph", "a" * 30, "Hello, world! How are you today, my friend?"]
    params = [SamplingParams(temperature=0.0, max_tokens=10),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=10)] * 2
    ids = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]
    with TPEngine(tp_size=2, **kw) as engine:
        print("followers", [p.pid for p in engine._followers], flush=True)
        if sys.argv[1] == "hang":
            print("ready", flush=True)
            while True:
                engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=None))  # to max_model_len
        two = engine.generate(prompts, params)
        try:
            engine.generate([[]], params[0])
        except RequestError as exc:
            print("refused:", exc, flush=True)
        again = engine.generate(prompts, params)
        # the started rank forgets its cached prefixes with rank 0 (else the next schedules differ, and hang)
        hot = engine.generate(prompts[3:] * 2, params[0])[1]  # (the second reads the first's blocks)
        print("reset:", engine.reset_prefix_cache(), flush=True)
        cold = engine.generate(prompts[3:], params[0])[0]
        print("cached:", hot.num_cached_tokens, cold.num_cached_tokens, ids([hot]) == ids([cold]), flush=True)
    with TPEngine(**kw) as engine:
        one = engine.generate(prompts, params)
    print("tp2 == tp1:", ids(two) == ids(one), "after a refusal:", ids(again) == ids(one), flush=True)
"""


def run(mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)


def test_spawned_ranks_match_one_rank_and_go_away():
    proc = run("check")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "refused: the prompt is empty" in out
    assert "tp2 == tp1: True after a refusal: True" in out, out
    assert "reset: True" in out and re.search(r"cached: [1-9]\d* 0 True", out), out
    pids = followers_of(next(line for line in out.splitlines() if line.startswith("followers")))
    assert len(pids) == 1 and all(gone(p) for p in pids)


def followers_until_ready(proc: subprocess.Popen) -> list[int]:
    """The started ranks' pids the script prints, read from its output up to its "ready" line."""
    pids = []
    for line in proc.stdout:
        if line.startswith("followers"):
            pids = followers_of(line)
        if line.startswith("ready"):
            break
    return pids


def all_gone_within(pids: list[int], seconds: float) -> bool:
    """Whether every one of these processes is gone within `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return all(gone(p) for p in pids)


def test_ctrl_c_stops_the_spawned_ranks():
    proc = run("hang")
    pids = followers_until_ready(proc)
    time.sleep(2)  # inside generate
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    rest = proc.stdout.read()
    assert proc.returncode != 0 and "KeyboardInterrupt" in rest, rest[-2000:]  # stopped inside generate
    assert pids and all_gone_within(pids, 30)


IDLE_SCRIPT = """
import inspect, sys, time
import tpgraph.distributed as d

# the process group's timeout cut to 3 s (600 s by default), in every rank: the spawned ones import this file too
names = list(inspect.signature(d.init_distributed).parameters)
defaults = list(d.init_distributed.__defaults__)
defaults[names.index("timeout_s") - (len(names) - len(defaults))] = 3.0
d.init_distributed.__defaults__ = tuple(defaults)
from tpgraph import SamplingParams, TPEngine

if __name__ == "__main__":
    with TPEngine(tp_size=2, device="cpu", max_num_seqs=2, max_model_len=32, num_kv_blocks=17, block_size=4) as engine:
        first = engine.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids
        time.sleep(float(sys.argv[1]))
        again = engine.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids
    print("after idling:", first == again, flush=True)
"""


def test_an_idle_engine_outlives_the_process_groups_timeout(tmp_path):
    # a user idling between generate calls (a notebook) longer than the process group's timeout: the started rank
    # waited for rank 0's next message in a collective that timed out, died, and rank 0's peer watch then ended the
    # user's whole process
    script = tmp_path / "idle.py"  # (a file, not -c: the spawned rank re-imports it, and the shorter timeout with it)
    script.write_text(IDLE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), "8"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)
    assert proc.returncode == 0 and "after idling: True" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


DROPPED_SCRIPT = """
import gc
from tpgraph import SamplingParams, TPEngine

def use():
    engine = TPEngine(tp_size=2, device="cpu", max_num_seqs=2, max_model_len=32, num_kv_blocks=17, block_size=4)
    print("followers", [p.pid for p in engine._followers], flush=True)
    return engine.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids

if __name__ == "__main__":
    first = use()  # never closed: dropped when use() returns
    gc.collect()
    print("again:", use() == first, flush=True)
"""


def test_an_engine_dropped_unclosed_takes_its_ranks_and_lets_the_next_start():
    # its started rank and the process group outlived it, and the next TPEngine(tp_size=2) joined that stale group
    # and hung
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", DROPPED_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and "again: True" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    pids = [p for line in proc.stdout.splitlines() if line.startswith("followers") for p in followers_of(line)]
    assert len(pids) == 2 and all(gone(p) for p in pids)


INIT_FAILS_SCRIPT = """
import multiprocessing, sys, time
import tpgraph.engine.tp_engine as tp_engine
from tpgraph import SamplingParams, TPEngine

if __name__ == "__main__":  # (rank 0's alone: the started rank imports the module afresh)
    real = tp_engine.init_distributed

    def interrupted(*args, **kwargs):
        print("followers", [p.pid for p in multiprocessing.active_children()], flush=True)
        if sys.argv[1] == "after":  # the process group is made, and then the Ctrl-C lands
            real(*args, **kwargs)
        raise KeyboardInterrupt

    tp_engine.init_distributed = interrupted
    kw = dict(device="cpu", max_num_seqs=2, max_model_len=32, num_kv_blocks=17, block_size=4)
    try:
        TPEngine(tp_size=2, **kw)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    print("left running:", [p.pid for p in multiprocessing.active_children()], flush=True)
    tp_engine.init_distributed = real
    with TPEngine(tp_size=2, **kw) as engine:
        print("again:", engine.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids,
              flush=True)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_failure_while_joining_the_process_group_takes_the_started_ranks(when):
    """A Ctrl-C (or any failure) on rank 0 while its started ranks join the process group, before or after the group
    is made. Before: the started rank was left waiting for a rank 0 that never came (the process group's 600 s), and
    where the group had been made it stayed, so the next TPEngine(tp_size=2) refused to start ("this process already
    holds a process group")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", INIT_FAILS_SCRIPT, when], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    out = proc.stdout + proc.stderr
    pids = [p for line in proc.stdout.splitlines() if line.startswith("followers") for p in followers_of(line)]
    assert "interrupted" in out and "left running: []" in out, out[-3000:]
    assert proc.returncode == 0 and "again:" in out, out[-3000:]
    assert len(pids) == 1 and all(gone(p) for p in pids)


LOAD_INTERRUPTED_SCRIPT = """
import multiprocessing, time
import tpgraph.engine.tp_engine as tp_engine
from tpgraph import TPEngine

if __name__ == "__main__":  # (rank 0's alone: the started rank imports the module afresh, and loads)
    def interrupted(*args, **kwargs):
        print("followers", [p.pid for p in multiprocessing.active_children()], flush=True)
        raise KeyboardInterrupt

    tp_engine.load_model = interrupted
    start = time.monotonic()
    try:
        TPEngine(tp_size=2, device="cpu", max_num_seqs=2, max_model_len=32, num_kv_blocks=17, block_size=4)
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - start:.1f} s", flush=True)
"""


def test_ctrl_c_while_the_model_loads_ends_the_started_rank_at_once():
    """Ctrl-C reaches rank 0 alone (its started ranks ignore SIGINT), so the started rank waits in a collective of the
    load that rank 0 left, and never ends by itself. Before: rank 0 waited 30 s for it to end (the grace given a rank
    failing alike), and a second Ctrl-C in that wait left it running."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LOAD_INTERRUPTED_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    out = proc.stdout + proc.stderr
    pids = [p for line in proc.stdout.splitlines() if line.startswith("followers") for p in followers_of(line)]
    took = [float(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("interrupted after")]
    assert took and took[0] < 10.0, out[-3000:]
    assert len(pids) == 1 and all(gone(p) for p in pids)


GROUP_TERM_SCRIPT = """
import signal, threading
from tpgraph import SamplingParams, TPEngine

if __name__ == "__main__":
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # (as the server's rank 0 takes it: stop between calls)
    with TPEngine(tp_size=2, device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=17, block_size=4) as e:
        print("followers", [p.pid for p in e._followers], flush=True)
        print("ready", flush=True)
        calls = 0
        while not stop.is_set() or calls < 2:  # (two more calls after the signal: the started rank must serve them)
            e.generate(["hello", "tpgraph"], SamplingParams(temperature=0.0, max_tokens=8))
            calls = calls + 1 if stop.is_set() else 0
    print("stopped cleanly", flush=True)
"""


def test_a_sigterm_to_the_whole_process_group_lets_the_started_rank_finish_with_rank_0():
    """systemd's stop (KillMode=control-group) or `kill -TERM -PGID` sends SIGTERM to every process at once. A rank
    TPEngine started died of it at once, in the middle of rank 0's step: rank 0's engine loop failed on the lost
    connection (`python -m tpgraph.serve -tp 2`: a traceback, its requests 500s) instead of stopping as a SIGTERM to
    rank 0 alone stops it. As torchrun's ranks under the server, the started rank now follows until rank 0 says stop
    (leaving by itself if that is late)."""
    proc = run_script(GROUP_TERM_SCRIPT)
    pids = followers_until_ready(proc)
    time.sleep(1.0)  # (generating)
    for pid in [proc.pid, *pids]:  # (the group's signal, to each process of it)
        os.kill(pid, signal.SIGTERM)
    try:
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "stopped cleanly" in rest, rest[-3000:]
    assert pids and all_gone_within(pids, 15)


def run_script(script: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)


LOGGING_SCRIPT = """
import logging, multiprocessing
import tpgraph.engine.tp_engine as tp_engine

# the started rank (it imports this file too) logs a line of its own as it builds its engine
if multiprocessing.current_process().name == "tpgraph-rank-1":
    build = tp_engine.TPEngine.__init__

    def says_a_line(self, *args, **kwargs):
        logging.getLogger("tpgraph.engine").warning("rank 1 builds its engine")
        build(self, *args, **kwargs)

    tp_engine.TPEngine.__init__ = says_a_line

if __name__ == "__main__":
    from functools import partial

    from tpgraph.server.logs import configure_logging, logging_config

    configure_logging(logging_config())  # (as the server's rank 0 does: serve.main, which hands its ranks the same)
    with tp_engine.TPEngine(tp_size=2, device="cpu", max_num_seqs=2, max_model_len=32, num_kv_blocks=17,
                            block_size=4, rank_setup=partial(configure_logging, logging_config())):
        print("built", flush=True)
"""


@pytest.mark.parametrize("from_file", [False, True])
def test_the_started_ranks_log_as_rank_0_does(from_file, tmp_path):
    """`serve -tp 2` without torchrun: rank 0 configured its logging from vLLM's variables (VLLM_LOGGING_STREAM,
    VLLM_LOGGING_PREFIX, VLLM_LOGGING_LEVEL, VLLM_LOGGING_CONFIG_PATH's file), and the ranks it started configured
    none: their warnings and errors went bare to stderr, and never to the configured file. They take rank 0's."""
    script = tmp_path / "logs.py"  # (a file, not -c: the spawned rank re-imports it, and its line with it)
    script.write_text(LOGGING_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_LOGGING_STREAM": "ext://sys.stdout",
           "VLLM_LOGGING_PREFIX": "[%(processName)s] "}
    expected = "[tpgraph-rank-1] WARNING tpgraph.engine: rank 1 builds its engine"
    if from_file:
        config = tmp_path / "logging.json"
        config.write_text(json.dumps({
            "version": 1, "disable_existing_loggers": False,
            "formatters": {"f": {"format": "CFG %(processName)s %(message)s"}},
            "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "f", "stream": "ext://sys.stdout"}},
            "loggers": {"tpgraph": {"handlers": ["h"], "level": "INFO", "propagate": False}}}))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(config)
        expected = "CFG tpgraph-rank-1 rank 1 builds its engine"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)
    assert proc.returncode == 0 and "built" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    assert expected in proc.stdout.splitlines(), (proc.stdout + proc.stderr)[-3000:]
    assert "rank 1 builds its engine" not in proc.stderr
