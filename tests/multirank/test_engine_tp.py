"""TPEngine under two gloo ranks (SPMD): both ranks produce the same completions, equal to one rank's, with
sampling, preemption and chunked prefill in play."""

import pytest
from tpgtest.logprobs import own_logprobs, top_ids
from tpgtest.spawn import run_ranks
from tpgtest.workers import engine_generate, engine_generate_per_rank

from tpgraph import SamplingParams, TPEngine

PROMPTS = ["The quick brown fox", "tpgraph", "a" * 30, "Hello, world! How are you today, my friend?"]
MIXED = [*PROMPTS, "ab"]  # (with PARAMS, one each)
ENGINE = dict(max_num_seqs=4, max_model_len=64, num_kv_blocks=17, block_size=4)  # tight: preemption happens
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.9, top_k=50, max_tokens=10),
          SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=10), SamplingParams(temperature=0.0, max_tokens=10,
                                                                                   repetition_penalty=1.3),
          # lower-case letters only, "a" and "b" most likely, and never "aa" (a ban that reads the last token)
          SamplingParams(temperature=0.7, seed=9, max_tokens=10, logit_bias={97: 6, 98: 5}, bad_words=("aa",),
                         allowed_token_ids=tuple(range(97, 123)))]


def test_two_ranks_agree_with_one():
    """The prompts twice, so the second call finds their prefixes cached: every rank keeps the same prefix cache
    (the same schedule, the same block names) and the same completions as TP=1."""
    ranks = run_ranks(engine_generate, 2, MIXED, [PARAMS, PARAMS], ENGINE, timeout_s=240)
    assert ranks[0] == ranks[1] and ranks[0]["blocks_back"] and ranks[0]["prefix_hits"] > 0
    with TPEngine(device="cpu", **ENGINE) as engine:
        one = engine.generate(MIXED, PARAMS) + engine.generate(MIXED, PARAMS)
    # greedy and seeded requests match TP=1 exactly (the unseeded one draws from the shared generator, whose
    # sequence of draws also matches, since both runs schedule identically)
    single = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in one]
    assert ranks[0]["completions"] == single
    constrained = single[4][0][1]  # (the last request's: lower-case letters, "aa" never)
    assert len(constrained) == 10 and constrained.isalpha() and constrained.islower() and "aa" not in constrained


@pytest.mark.parametrize("other", [["The quick brown cat"], ["a lone \ud800"],
                                   {"prompt": "The quick brown fox", "multi_modal_data": {}}],
                         ids=["other", "refused_alone", "form_refused_alone"])
def test_ranks_called_with_other_prompts_are_refused_on_every_rank(other):
    """Under torchrun every rank must make the same generate calls: one given other prompts (the same lengths) had
    every rank produce the same tokens, wrong for one of them, with no word. Every rank refuses the call, naming the
    rank that differs, and the engine serves the next matching call. A prompt only one rank's encoding refuses (not
    valid Unicode), or whose form only one rank's generate refuses (vLLM's {"prompt": ...} with multi-modal data), is
    found so too, not left to strand the other in the comparison."""
    prompts = [["The quick brown fox"], other]
    ranks = run_ranks(engine_generate_per_rank, 2, prompts, ENGINE, timeout_s=240)
    for error, _ in ranks:
        assert error is not None and error.startswith("rank(s) [1] made another call than rank 0's generate")
    assert ("this rank's call was refused" in ranks[1][0]) == isinstance(other, dict)
    assert ranks[0][1] == ranks[1][1] and len(ranks[0][1]) == 4


def test_four_ranks_agree_with_one():
    """TP=4 on CPU (issue 12's path where no four GPUs are lent): every rank the same completions, equal to TP=1's
    for the greedy and seeded requests."""
    ranks = run_ranks(engine_generate, 4, MIXED, PARAMS, ENGINE, timeout_s=300)
    assert all(r == ranks[0] for r in ranks[1:]) and ranks[0]["blocks_back"]
    with TPEngine(device="cpu", **ENGINE) as engine:
        one = engine.generate(MIXED, PARAMS)
    single = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in one]
    assert ranks[0]["completions"] == single


def test_greedy_in_step_at_four_ranks_agrees_with_one(monkeypatch):
    """TPGRAPH_GREEDY_IN_STEP=1 at TP=4: plain-greedy steps take the ids the step made from the ranks' all-reduced
    shard slots (258 tokens over 4 ranks: the last shard has 63 real columns and 2 of padding, cut), and steps that
    sample gather the logits after the step; every rank's completions equal TP=1's, where the setting is off."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.0, max_tokens=6)] * 3
    with TPEngine(device="cpu", **ENGINE) as engine:
        one = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
               for o in engine.generate(MIXED, greedy[:5]) + engine.generate(MIXED, PARAMS)]
    monkeypatch.setenv("TPGRAPH_GREEDY_IN_STEP", "1")
    ranks = run_ranks(engine_generate, 4, MIXED, [greedy[:5], PARAMS], ENGINE, timeout_s=300)
    assert all(r == ranks[0] for r in ranks[1:]) and ranks[0]["blocks_back"] and ranks[0]["greedy_in_step"]
    assert ranks[0]["completions"] == one


def test_two_ranks_give_every_rank_the_prompt_logprobs_of_one():
    """Prompt log-probabilities gather the vocabulary across ranks a pass at a time, in chunks (max 16 tokens a step)
    and under preemption: both ranks hold the same entries, within fp32 rounding of TP=1's, and the same tokens."""
    params = [SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2 if i % 2 else 0) for i in range(4)]
    engine = {**ENGINE, "max_num_batched_tokens": 16}
    ranks = run_ranks(engine_generate, 2, PROMPTS, params, engine, timeout_s=240)
    assert ranks[0] == ranks[1] and ranks[0]["blocks_back"] and ranks[0]["preemptions"] > 0
    with TPEngine(device="cpu", **engine) as one:
        single = one.generate(PROMPTS, params)
    assert ranks[0]["completions"] == [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in single]
    for entries, o, q in zip(ranks[0]["prompt_logprobs"], single, params, strict=True):
        ids = o.prompt_token_ids
        assert entries[0] is None and len(entries) == len(ids)
        assert own_logprobs(entries, ids)[1:] == pytest.approx(own_logprobs(o.prompt_logprobs, ids)[1:], abs=1e-4)
        assert top_ids(entries, q.prompt_logprobs) == top_ids(o.prompt_logprobs, q.prompt_logprobs)


def test_two_ranks_keep_their_grammars_in_step():
    """Structured outputs at TP=2: each rank keeps its own matchers and masks its own gathered logits; both reach
    the tokens TP=1 reaches, under preemption, each sample a match."""
    pytest.importorskip("xgrammar")
    from tpgraph.engine.structured import StructuredOutput

    specs = [StructuredOutput.choice(["alpha", "beta"]), StructuredOutput("regex", "[0-9]{2}[a-f]{3}"),
             StructuredOutput.json_schema({"type": "object", "properties": {"b": {"type": "boolean"}},
                                           "required": ["b"], "additionalProperties": False}),
             StructuredOutput("regex", "(ab|cd)+!")]
    # (sample j of seed s draws as seed s + j, as vLLM seeds them: seeds 2 apart give every sample its own stream)
    params = [SamplingParams(temperature=0.9, seed=2 * i, n=2, max_tokens=20, structured=spec)
              for i, spec in enumerate(specs)]
    ranks = run_ranks(engine_generate, 2, PROMPTS, params, ENGINE, timeout_s=240)
    assert ranks[0] == ranks[1] and ranks[0]["blocks_back"] and ranks[0]["preemptions"] > 0
    with TPEngine(device="cpu", **ENGINE) as one:
        single = one.generate(PROMPTS, params)
    assert ranks[0]["completions"] == [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in single]
    assert all(reason == "stop" for samples in ranks[0]["completions"] for _, _, reason in samples)


def test_every_rank_compiles_a_new_grammar_off_its_step_loop():
    """At TP=2 rank 0 tells the other rank of a grammar it compiles ahead of the request: that rank compiles it on
    its background thread, not inside the step that adds the request."""
    pytest.importorskip("xgrammar")
    from tpgtest.workers import service_precompile

    from tpgraph.engine.structured import StructuredOutput

    params = SamplingParams(temperature=0.9, seed=1, max_tokens=20, structured=StructuredOutput("regex", "[a-f]{5}"))
    ranks = run_ranks(service_precompile, 2, "Code:", params, ENGINE, 60, timeout_s=180)
    assert ranks[0]["finished"] and len(ranks[0]["text"]) == 5 and set(ranks[0]["text"]) <= set("abcdef")
    assert ranks[0]["threads"] == ["MainThread"]  # (rank 0: the caller of precompile)
    assert len(ranks[1]["threads"]) == 1 and ranks[1]["threads"][0].startswith("tpgraph-grammar")
