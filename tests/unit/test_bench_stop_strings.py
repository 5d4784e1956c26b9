"""bench/bench_stop_strings.py: each case is timed, the detokenizer of a git revision beside this one's."""

import shutil
import subprocess
from pathlib import Path

import pytest
from tpgtest.bench_modules import load_bench_module

from tpgraph.tokenizer import builtin_tokenizer


def test_a_case_is_timed_now_and_at_a_revision():
    bench = load_bench_module("bench_stop_strings")
    tokenizer = builtin_tokenizer()
    stops, text = bench.CASES["2 short stops"]
    ids = tokenizer.encode(text[:200], add_special_tokens=False).ids
    assert bench.per_token_us(bench.Detokenizer, tokenizer, stops, ids) > 0
    repo = Path(bench.__file__).resolve().parents[1]
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode:
        pytest.skip("not a git checkout")
    then = bench.detokenizer_at("HEAD")
    assert then.__module__ == "detokenizer_then"
    assert bench.per_token_us(then, tokenizer, stops, ids) > 0
