from tpgtest.spawn import run_ranks
from tpgtest.workers import greedy_with_logits

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 84, 80]]


def test_builtin_model_is_the_same_model_at_every_tp():
    """Seeded random weights are generated whole and sliced, so TP 1, 2 and 4 run one model."""
    outs = {tp: run_ranks(greedy_with_logits, tp, None, PROMPTS, 8, 16, False) for tp in (1, 2, 4)}
    ref = outs[1][0]
    for tp, results in outs.items():
        for res in results:
            assert res["tokens"] == ref["tokens"], f"tp={tp}"
            rel = ((res["logits"] - ref["logits"]).norm(dim=-1) / ref["logits"].norm(dim=-1)).max()
            assert rel < 1e-5, f"tp={tp}: {rel}"


def test_breakable_graph_path_at_tp2_matches_eager():
    """The whole replay path (persistent buffers, padding to the 4 bucket, dispatcher) with real collectives between
    two ranks: the same tokens as eager, and every rank padded and dispatched the same way."""
    prompts = PROMPTS + [[256, 1, 2, 3, 4]]
    eager = run_ranks(greedy_with_logits, 2, None, prompts, 6, 16, False, "none")
    broken = run_ranks(greedy_with_logits, 2, None, prompts, 6, 16, False, "breakable")
    for e, b in zip(eager, broken, strict=True):
        assert b["tokens"] == e["tokens"]
        rel = ((b["logits"] - e["logits"]).norm(dim=-1) / e["logits"].norm(dim=-1)).nan_to_num().max()
        assert rel < 1e-5
        assert ("decode", "breakable", 3, 4, 5) in b["steps"]
    assert broken[0]["steps"] == broken[1]["steps"] and broken[0]["kv_blocks"] == broken[1]["kv_blocks"]
