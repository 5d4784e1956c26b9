"""bench/trace_overlap.py's analysis off the GPU: steps are cut at the ids' read-backs, busy time is the union of
what ran inside a step, and idle stretches are charged to the events on either side of them."""

import pytest
from tpgtest.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def trace():
    return load_bench_module("trace_overlap")


# two steps of a graph (two kernels, the second resident early), then the read-back; gaps of 3 µs and 5 µs
EVENTS = [
    ("Memcpy DtoH (Device -> Pinned)", 0.0, 1.0),
    ("void qkv_kernel<1>(float*)", 4.0, 10.0),
    ("lm_head_kernel", 8.0, 20.0),
    ("Memcpy DtoH (Device -> Pinned)", 21.0, 22.0),
    ("void qkv_kernel<1>(float*)", 27.0, 33.0),
    ("lm_head_kernel", 31.0, 43.0),
    ("Memcpy DtoH (Device -> Pinned)", 44.0, 45.0),
]


def test_steps_run_from_one_read_back_to_the_next(trace):
    assert trace.step_spans(EVENTS) == [(1.0, 22.0), (22.0, 45.0)]


def test_gaps_name_the_event_before_and_after(trace):
    found = trace.gaps(EVENTS, 2.0)
    assert [(b[:6], a[:6], at, length) for b, a, at, length in found] == [
        ("Memcpy", "void q", 1.0, 3.0), ("Memcpy", "void q", 22.0, 5.0)]
    assert trace.gaps(EVENTS, 5.5) == []  # nothing idles that long; 1 µs between lm_head and its read-back is short


def test_summary_takes_the_union_and_groups_gaps(trace):
    out = trace.summarise(EVENTS, 2.0)
    assert out["steps"] == 2
    assert out["span_us"] == pytest.approx(22.0)  # the median of 21 and 23
    assert out["busy_us"] == pytest.approx(17.0)  # the kernels 16 (the union) and the read-back 1
    [row] = out["gaps"]
    assert (row["before"], row["after"], row["count"]) == ("Memcpy DtoH", "qkv_kernel", 2)
    assert row["us_per_step"] == pytest.approx(4.0)


def test_each_kernel_is_charged_what_it_adds(trace):
    out = trace.summarise(EVENTS, 2.0)
    # in each step: qkv 6 from the step's first start, lm_head 10 past it, the read-back 2 past lm_head
    assert out["added_us"] == pytest.approx({"lm_head_kernel": 10.0, "qkv_kernel": 6.0, "Memcpy DtoH": 2.0})
    assert [(p["name"], p["us"]) for p in out["by_place"]] == [("qkv_kernel", 6.0), ("lm_head_kernel", 10.0),
                                                                 ("Memcpy DtoH", 2.0)]
