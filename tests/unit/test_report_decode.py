"""bench/report_decode.py: issue 11's lines on synthetic benchmark JSON (each must be able to fail)."""

import pytest
from tpgtest.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def report():
    return load_bench_module("report_decode")


def tpot(entry, batch, ms, floor=1.8):
    return {"allreduce": entry, "mode": "full", "batch": batch, "tpot_ms": ms, "floor_ms": floor}


def by_name(checks):
    return {name: ok for name, ok, _ in checks}


def test_tpot_lines_hold_at_the_bound_and_fail_above_it(report):
    decode = {"tpot": [tpot("custom+gemv", 1, 1.4 * 1.8), tpot("custom+gemv", 8, 1.5 * 1.8 + 0.01),
                       tpot("custom", 32, 2.0)]}
    got = by_name(report.tpot_checks(decode, "custom+gemv"))
    assert got["custom+gemv, batch 1: TPOT <= 1.4x the floor"] is True
    assert got["custom+gemv, batch 8: TPOT <= 1.5x the floor"] is False
    assert got["custom+gemv, batch 32: TPOT <= 1.7x the floor"] is None  # that entry did not run batch 32


def test_every_fused_entry_must_beat_its_unfused_version(report):
    rows = [tpot("custom", 1, 3.0), tpot("custom+unfused", 1, 3.1), tpot("custom+gemv", 1, 2.9),
            tpot("custom+gemv+unfused", 1, 3.0), tpot("nccl", 1, 3.5)]
    (name, ok, detail), = report.fused_checks({"tpot": rows})
    assert ok is True and "2 pairs" in detail
    rows.append(tpot("custom", 8, 3.2))
    rows.append(tpot("custom+unfused", 8, 3.2))  # a tie is not faster
    (_, ok, detail), = report.fused_checks({"tpot": rows})
    assert ok is False and "custom bs 8" in detail
    assert report.fused_checks({"tpot": [tpot("custom", 1, 3.0)]})[0][1] is None


def test_an_epilogue_all_reduce_entry_is_paired_with_the_twin_the_run_names(report):
    """bench_decode.py writes each entry's unfused twin into the results: a +push entry's is +nopush...+unfused, not
    NAME+unfused."""
    rows = [tpot("custom+gemv+push+overlap", 1, 2.5), tpot("custom+gemv+nopush+overlap+unfused", 1, 2.7)]
    twins = {"custom+gemv+push+overlap": "custom+gemv+nopush+overlap+unfused"}
    (_, ok, detail), = report.fused_checks({"tpot": rows, "tp": 2, "unfused_twins": twins})
    assert ok is True and "1 pairs" in detail
    rows[1] = tpot("custom+gemv+nopush+overlap+unfused", 1, 2.4)
    assert report.fused_checks({"tpot": rows, "tp": 2, "unfused_twins": twins})[0][1] is False
    assert report.fused_checks({"tpot": rows, "tp": 2})[0][1] is None  # without the names: no pair found


def test_pairs_that_run_the_same_kernels_at_tp1_are_left_out_and_said(report):
    rows = [tpot("custom", 1, 3.0), tpot("custom+unfused", 1, 2.99), tpot("custom+gemv", 1, 2.4),
            tpot("custom+gemv+unfused", 1, 2.5)]
    (_, ok, detail), = report.fused_checks({"tpot": rows, "tp": 1})
    assert ok is True and "1 pairs" in detail and "the same kernels at TP=1: custom" in detail
    (_, ok, detail), = report.fused_checks({"tpot": rows, "tp": 2})  # at TP=2 the cuBLAS pair counts, and lost
    assert ok is False and "custom bs 1" in detail
    rows[3] = tpot("custom+gemv+unfused", 1, 2.3)  # the small-M pair still counts at TP=1
    assert report.fused_checks({"tpot": rows, "tp": 1})[0][1] is False
    assert report.fused_checks({"tpot": rows[:2], "tp": 1})[0][1] is None


def test_projection_and_lm_head_bandwidth(report):
    def row(kernel, of_floor, batch=1):
        return {"kernel": kernel, "batch": batch, "us": 10.0, "of_floor": of_floor}

    good = [row("qkv+rope_store (Triton)", 0.9), row("o_proj (Triton)", 0.88), row("gate_up+silu (Triton)", 0.95),
            row("down (Triton)", 0.91), row("lm_head (Triton)", 0.95), row("qkv (cuBLAS)", 0.1)]
    assert all(ok for _, ok, _ in report.kernel_checks({"rows": good}))
    # the qkv kernel judged is the one decode runs (it rotates and stores K and V too), not the plain projection
    plain_qkv = [row("qkv (Triton)", 0.95), row("qkv+rope_store (Triton)", 0.6), *good[1:]]
    assert [ok for _, ok, _ in report.kernel_checks({"rows": plain_qkv})] == [False, True]
    slow = good[:1] + [row("o_proj (Triton)", 0.87)] + good[2:4] + [row("lm_head (Triton)", 0.89)]
    assert [ok for _, ok, _ in report.kernel_checks({"rows": slow})] == [False, False]
    only_batch_8 = [row(r["kernel"], r["of_floor"], batch=8) for r in good]
    assert [ok for _, ok, _ in report.kernel_checks({"rows": only_batch_8})] == [None, None]
    # with the read ceiling: each projection's best waiting read beside it, the verdict unchanged
    ceiling = {"rows": [{"size": "qkv", "candidate": "read pdl 4x4096x4x3", "of_floor": 0.84},
                        {"size": "qkv", "candidate": "read pdl 1x4096x4x1", "of_floor": 0.30},
                        {"size": "qkv", "candidate": "read pdl_free 4x4096x4x3", "of_floor": 1.1},
                        {"size": "o_proj", "candidate": "o_proj (shipped small-M)", "of_floor": 0.5}]}
    (name, ok, detail), _ = report.kernel_checks({"rows": slow}, ceiling)
    assert ok is False and "qkv 90% (10.0 us; a waiting read 84%)" in detail and "o_proj 87% (10.0 us)," in detail


def test_kernels_per_step(report):
    profile = {"profile": [{"allreduce": "custom+gemv", "batch": 1, "kernels": 200},
                           {"allreduce": "custom+gemv", "batch": 8, "kernels": 400}]}
    assert report.profile_checks(profile, "custom+gemv")[0][1] is True
    profile["profile"][0]["kernels"] = 201
    assert report.profile_checks(profile, "custom+gemv")[0][1] is False
    assert report.profile_checks(profile, "custom")[0][1] is None


def test_a_profile_that_recorded_no_kernels_does_not_pass_the_kernel_count(report):
    """bench_decode.profile_step writes {"kernels": 0} when the profiler saw no kernel (CUPTI off, graph kernels not
    traced): that is no count, not a step of 0 kernels under the limit."""
    profile = {"profile": [{"allreduce": "custom+gemv", "batch": 1, "kernels": 0, "floor_ms": 1.8}]}
    (_, ok, detail), = report.profile_checks(profile, "custom+gemv")
    assert ok is None and "no kernels" in detail


def test_every_line_is_listed_when_the_kernel_or_profile_json_is_missing(report):
    """The acceptance step passes --kernels / --profile only where the file exists (a kernel bench past its time
    limit writes none): the verdict must still list those lines, as not measured, not leave them out."""
    decode = {"tpot": [tpot("custom+gemv", b, 1.0) for b in (1, 8, 32)], "tp": 2}
    got = report.checks(decode, None, None, "custom+gemv")
    assert len(got) == 3 + 1 + 2 + 1 + 1
    assert [ok for _, ok, _ in got[4:]] == [None, None, None, None]
    assert "kernels per step" in got[-2][0] and "bandwidth at M = 1" in got[4][0] and "inside the step" in got[-1][0]


def test_a_missing_results_file_gives_a_failing_verdict_not_none(report, tmp_path, monkeypatch, capsys):
    """bench_decode.py writes its JSON only at the end: a crashed or timed-out candidate leaves none. The acceptance
    step then still runs the report, which must say so (and list every line as not measured), not stop."""
    missing = tmp_path / "decode_accept.json"
    monkeypatch.setattr("sys.argv", ["report_decode.py", str(missing), "--entry", "custom+gemv",
                                     "--kernels", str(tmp_path / "kernels.json")])
    with pytest.raises(SystemExit, match="1"):
        report.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("- [ ] ") and str(missing) in lines[0] and "kernels.json" in lines[0]
    assert "custom+gemv, batch 1: TPOT <= 1.4x the floor: not measured" in lines[1]
    assert len(lines) == 1 + 3 + 1 + 2 + 1 + 1 + 1 and not any(line.startswith("- [x]") for line in lines)
    assert lines[-1] == "verdict: NOT PASSED, 1 of 9 lines fail and 8 are not measured"


def test_each_projection_inside_the_step_against_its_bytes(report):
    mb = 1_000_000
    row = {"allreduce": "e", "batch": 1, "projection_bytes": {"qkv": 88 * mb, "o_proj": 50 * mb, "gate_up": 88 * mb,
                                                              "down": 88 * mb, "lm_head": 500 * mb},
           "projections_added_us": {"qkv": 100.0, "o_proj": 40.0, "gate_up": 90.0, "down": 95.0, "lm_head": 1.0}}
    profile = {"hbm_bytes_per_s": 1e12, "profile": [row]}  # 1 MB a microsecond
    (name, ok, detail), = report.in_step_checks(profile, "e")
    assert ok is True and "inside the step" in name and "o_proj 125% (40.0 us)" in detail
    row["projections_added_us"]["qkv"] = 100.1  # 87.9%
    assert report.in_step_checks(profile, "e")[0][1] is False
    assert report.in_step_checks(profile, "other")[0][1] is None
    row["projections_added_us"] = None  # the profile could not tell the projections apart
    (_, ok, detail), = report.in_step_checks(profile, "e")
    assert ok is None and "no projection times" in detail


def test_the_verdict_passes_only_where_every_line_holds(report):
    assert report.verdict([("a", True, ""), ("b", True, "")]) == "verdict: PASS, all 2 lines hold"
    assert report.verdict([("a", True, ""), ("b", None, "")]).startswith("verdict: NOT PASSED, 0 of 2 lines fail")
    assert report.verdict([("a", False, ""), ("b", True, "")]).startswith("verdict: NOT PASSED, 1 of 2 lines fail")
