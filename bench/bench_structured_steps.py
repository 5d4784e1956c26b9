"""Structured outputs' decode step time: constrained steps overlapped (the step in flight read between the next
step's forwards and its draw) against every step read in turn (what constrained steps did before session 42), and
unconstrained batches beside them, at batch 1 and 8 (each batch all constrained or all free). One engine (dummy
weights of the checkpoint's shape, its tokenizer or the byte tokenizer; max_num_seqs 16, max_model_len 1024, warmed
up), the mode switched on it (engine.core.overlap) and interleaved in each trial; requests "Write: ", temperature 1,
seed = the trial, 200 tokens of a schema whose 300-400 character string they never finish (every step is
constrained). The figure is the median wall time per decode step (the interval between step() returns, 10 steps cut
at each end), then the median of the trials.

    python bench/bench_structured_steps.py MODEL_DIR --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tpgraph import SamplingParams, TPEngine
from tpgraph.engine.structured import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "minLength": 300, "maxLength": 400}},
          "required": ["a"], "additionalProperties": False}  # (a long answer: every step of it is constrained)


def step_ms(engine: TPEngine, tag: str, batch: int, spec: StructuredOutput | None, overlap: bool, seed: int,
            tokens: int) -> tuple[float, int]:
    """The median wall time of a steady decode step, `batch` requests of `tokens` tokens each; and the steps."""
    engine.core.overlap = overlap
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=tokens, structured=spec)
    for i in range(batch):
        engine.core.add_request(f"{tag}-{i}", engine.encode("Write: "), params)
    stamps = []
    while engine.core.has_work:
        engine.core.step()
        stamps.append(time.perf_counter())
    return 1e3 * statistics.median(b - a for a, b in zip(stamps[10:-10], stamps[11:-9], strict=True)), len(stamps)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--out", default=None)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    kinds = {"free": None, "json": StructuredOutput.json_schema(SCHEMA)}
    rows = []
    with TPEngine(model=args.model_dir, load_format="dummy", max_num_seqs=16, max_model_len=1024,
                  device=args.device) as engine:
        engine.warm_up()
        for trial in range(args.trials):
            for batch in map(int, args.batches.split(",")):
                for kind, spec in kinds.items():
                    for overlap in (True, False):
                        ms, steps = step_ms(engine, f"{trial}-{batch}-{kind}-{overlap}", batch, spec, overlap,
                                            trial, args.tokens)
                        rows.append({"trial": trial, "batch": batch, "kind": kind, "overlap": overlap,
                                     "median_step_ms": ms, "steps": steps})
                        print(json.dumps(rows[-1]), flush=True)
    by_mode: dict[tuple, list[float]] = {}
    for r in rows:
        by_mode.setdefault((r["batch"], r["kind"], r["overlap"]), []).append(r["median_step_ms"])
    summary = [{"batch": b, "kind": k, "overlap": o, "median_of_trials_ms": statistics.median(v)}
               for (b, k, o), v in sorted(by_mode.items())]
    for row in summary:
        print(row)
    result = {"rows": rows, "summary": summary}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
