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
