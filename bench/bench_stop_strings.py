"""Host time per generated token of a sequence's detokenizer with stop strings (what the step thread spends on each
sequence), for ordinary and long stop strings, optionally beside the detokenizer of an earlier commit.

    python bench/bench_stop_strings.py [--against REV] [--out stop_strings.json]

The built-in byte-level tokenizer; each case feeds its token ids one at a time (the stop strings never match) and
reports the median of 5 passes, in microseconds per token. `--against REV` loads tpgraph/engine/detokenizer.py as it
was at REV (git show) and times it on the same cases.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpgraph import SamplingParams
from tpgraph.engine.detokenizer import Detokenizer
from tpgraph.tokenizer import builtin_tokenizer

PROSE = "The quick brown fox jumps over the lazy dog. " * 50
CASES = {  # name -> (stop strings, text fed)
    "2 short stops": (("\n\n", "User:"), PROSE),
    "4 stops of 20": (tuple(c * 19 + "!" for c in "abcd"), PROSE),
    "1 stop of 1000 (b + 999 a), text of a": (("b" + "a" * 999,), "a" * 2000),
    "100 stops of 1000 (2 chars + 998 a), text of a": (tuple(f"{i % 10}{chr(65 + i // 10)}" + "a" * 998
                                                            for i in range(100)), "a" * 2000),
}


def per_token_us(cls: type, tokenizer, stops: tuple[str, ...], ids: list[int]) -> float:
    times = []
    for _ in range(5):
        d = cls(tokenizer, [256, 72], SamplingParams(stop=stops, max_tokens=1))
        start = time.perf_counter()
        for i in ids:
            d.add(i)
        times.append((time.perf_counter() - start) / len(ids) * 1e6)
    return statistics.median(times)


def detokenizer_at(rev: str) -> type:
    source = subprocess.run(["git", "show", f"{rev}:tpgraph/engine/detokenizer.py"], check=True, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parent).stdout
    path = Path(tempfile.mkdtemp()) / "detokenizer_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("detokenizer_then", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Detokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default=None, help="a git revision whose detokenizer is timed beside this one")
    p.add_argument("--out", type=Path, default=Path("stop_strings.json"))
    args = p.parse_args()
    tokenizer = builtin_tokenizer()
    then = detokenizer_at(args.against) if args.against else None
    rows = []
    for name, (stops, text) in CASES.items():
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        row = {"case": name, "now_us": per_token_us(Detokenizer, tokenizer, stops, ids)}
        if then is not None:
            row[f"{args.against}_us"] = per_token_us(then, tokenizer, stops, ids)
        rows.append(row)
        print(f"{name:48s} " + "   ".join(f"{k[:-3]} {v:8.1f} us/token" for k, v in row.items() if k != "case"),
              flush=True)
    args.out.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
