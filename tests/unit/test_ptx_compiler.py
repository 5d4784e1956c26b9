"""tests/tpgtest/ptx.py's compiler process: a request it never answers fails the test instead of hanging it."""

import pytest
from tpgtest.ptx import _Compiler

# a stand-in for the compiler process, speaking its protocol (a JSON line in, one out): it never answers "hang"
_FAKE = """
import json, sys, time
for line in sys.stdin:
    op, path, args = json.loads(line)
    if op == "hang":
        time.sleep(600)
    print(json.dumps({"out": [op, args]}), flush=True)
"""


def test_a_request_past_the_timeout_fails_by_name_and_the_next_one_gets_a_new_process():
    compiler = _Compiler(server=_FAKE, timeout_s=1.0)
    assert compiler.ask("compile", ["m.k"]) == {"out": ["compile", ["m.k"]]}
    hung = compiler.proc
    with pytest.raises(TimeoutError, match=r"no reply in 1 s to compile m\.slow: killed"):
        compiler.ask("hang", ["m.slow"], what="compile m.slow")
    assert hung.wait(timeout=5) is not None  # killed, not left sleeping
    assert compiler.ask("specialize", [1]) == {"out": ["specialize", [1]]} and compiler.proc is not hung
    compiler.close()
