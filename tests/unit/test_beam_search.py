"""TPEngine.beam_search (vLLM's LLM.beam_search) on CPU with the built-in model: against a brute-force beam search over
the model's full next-token log-probabilities, greedy generate at beam_width 1, EOS-finished sequences kept and
ranked by length-penalized score, and bad parameters refused by name."""

import asyncio
import math
import types
from decimal import Decimal

import pytest
import torch

from tpgraph import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, RequestError, SamplingParams, TPEngine
from tpgraph.comm import TPCommunicator
from tpgraph.distributed import init_distributed
from tpgraph.engine.beam_search import _Rank, run_beam_search, run_beam_search_async
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.logprob import Logprob
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.model.loader import load_model

PROMPTS = ["The quick brown fox", "tpgraph", "Hello, world!"]
EOS = 257  # (the built-in tokenizer's)
ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=64, num_kv_blocks=160, block_size=4)


@pytest.fixture(scope="module")
def engine():
    with TPEngine(**ENGINE) as e:
        yield e


def next_logprobs_of(eos_like: int | None = None):
    """seqs -> each one's log-probabilities of every next token, from a model and runner of their own (a whole prefill
    a sequence: no prefix cache, no decode step, no top-k; a runner binds its KV cache to the model's layers, so the
    engine's model is not borrowed). eos_like: EOS's embedding row made as eos_engine makes it."""
    state = init_distributed("cpu")
    model = load_model(state, TPCommunicator(state))
    if eos_like is not None:
        make_eos_likely(model, eos_like)
    runner = ModelRunner(model, RunnerConfig(block_size=4, max_batch=8, max_model_len=64))

    def next_logprobs(seqs: list[list[int]]) -> list[torch.Tensor]:
        rows = []
        for i in range(0, len(seqs), 8):
            logits = greedy_generate(runner, seqs[i:i + 8], 1, keep_logits=True).step_logits[0]
            rows.extend(torch.log_softmax(logits.double(), -1))
        return rows
    return next_logprobs


@pytest.fixture(scope="module")
def next_logprobs():
    return next_logprobs_of()


def make_eos_likely(model, token: int) -> None:
    """EOS's (tied) embedding row twice `token`'s: wherever that token is likely, EOS is more so."""
    with torch.no_grad():
        model.embed_tokens.weight[EOS] = 2 * model.embed_tokens.weight[token]


def reference_beam_search(next_logprobs, prompt: list[int], width: int, steps: int, length_penalty: float = 1.0,
                          ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """vLLM's beam search from the full distributions: each live beam's 2 * width most likely tokens extend it, an EOS
    among them finishes, the width best of the rest live on; finished and live ranked together at the end (by
    exact_score, so a length_penalty whose power leaves the float range ranks as the math says)."""
    def score(seq):
        return exact_score(seq[0], seq[1], EOS, length_penalty)

    beams, finished = [(prompt, 0.0)], []
    for _ in range(steps):
        children = []
        for (tokens, cum), dist in zip(beams, next_logprobs([b[0] for b in beams]), strict=True):
            top = dist.topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = (tokens + [token], cum + value)
                (finished if token == EOS and not ignore_eos else children).append(child)
        beams = sorted(children, key=score, reverse=True)[:width]
    return sorted(finished + beams, key=score, reverse=True)[:width]


def exact_score(tokens: list[int], cum_logprob: float, eos: int, length_penalty: float) -> Decimal:
    """The length-penalized score, cum_logprob / length ** length_penalty (the length without a final EOS), in
    decimal: no power of a length over-or underflows there, where a float's would (8 ** 400 > 1e308)."""
    length = len(tokens) - (1 if tokens[-1] == eos else 0)
    return Decimal(cum_logprob) / Decimal(length) ** Decimal(length_penalty)


def found(output: BeamSearchOutput) -> list[tuple[list[int], float]]:
    return [(s.tokens, s.cum_logprob) for s in output.sequences]


def assert_same(got: list[tuple[list[int], float]], want: list[tuple[list[int], float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [c for _, c in got] == pytest.approx([c for _, c in want], abs=1e-4)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("steps", [1, 3, 6])
def test_the_best_sequences_are_the_brute_force_searchs(engine, next_logprobs, width, steps):
    outputs = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps))
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = engine.encode(prompt)
        assert_same(found(out), reference_beam_search(next_logprobs, ids, width, steps))
        for seq in out.sequences:
            assert seq.tokens[:len(ids)] == ids and len(seq.tokens) == len(ids) + steps
            assert seq.finish_reason == "length" and seq.stop_reason is None
            assert seq.text == engine.get_tokenizer().decode(seq.tokens)  # (the prompt's text too, as vLLM's)
            # one entry a generated token: the step's 2 * width candidates, the chosen one among them
            assert len(seq.logprobs) == steps and all(len(e) == 2 * width for e in seq.logprobs)
            chosen = [e[t].logprob for e, t in zip(seq.logprobs, seq.tokens[len(ids):], strict=True)]
            assert sum(chosen) == pytest.approx(seq.cum_logprob)
            assert all(isinstance(v, Logprob) and v.decoded_token is not None for e in seq.logprobs for v in e.values())


def test_length_penalty_ranks_as_the_brute_force_search(engine, next_logprobs):
    for penalty in (0.0, 2.0, -1.0):
        out = engine.beam_search(PROMPTS[1:2], BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=penalty))
        assert_same(found(out[0]), reference_beam_search(next_logprobs, engine.encode(PROMPTS[1]), 3, 4, penalty))


def test_an_extreme_length_penalty_ranks_as_the_brute_force_search(eos_engine):
    """A length_penalty whose power of a length leaves the float range (8 ** 400 overflows, 8 ** -400 is 0.0: the
    prompt's 8 tokens counted) ranks as the exact score does: 400 puts the longest first, -400 the shortest."""
    eos_engine, next_logprobs = eos_engine
    ids = eos_engine.encode("tpgraph")
    for penalty in (400.0, -400.0):
        (out,) = eos_engine.beam_search(["tpgraph"], BeamSearchParams(beam_width=3, max_tokens=5,
                                                                      length_penalty=penalty))
        assert_same(found(out), reference_beam_search(next_logprobs, ids, 3, 5, penalty))
        lengths = [len(s.tokens) - (s.finish_reason == "stop") for s in out.sequences]
        assert lengths == sorted(lengths, reverse=penalty > 0)
        assert any(s.finish_reason == "stop" for s in out.sequences) == (penalty < 0)


def test_beam_width_one_is_greedy_generate(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0))
    beams = engine.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=8))
    for g, b in zip(greedy, beams, strict=True):
        (seq,) = b.sequences
        assert seq.tokens == g.prompt_token_ids + g.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-5)


def test_prompts_come_as_generate_takes_them_and_steps_read_the_prefix_cache(engine):
    """Text, token ids, and vLLM's {"prompt": ...} / {"prompt_token_ids": ...}; the beams' prompts are read back from
    the prefix cache each step; concurrency_limit searches fewer prompts at a time, to the same sequences."""
    ids = engine.encode(PROMPTS[0])
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    hits = engine.core.scheduler.prefix_hit_tokens
    forms = engine.beam_search([PROMPTS[0], ids, {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], params)
    assert engine.core.scheduler.prefix_hit_tokens > hits
    for out in forms[1:] + engine.beam_search(PROMPTS[0], params):  # (one prompt alone too)
        assert_same(found(out), found(forms[0]))
    # (other batches: the same sequences, their sums within rounding)
    for one, together in zip(engine.beam_search(PROMPTS, params, concurrency_limit=1),
                             engine.beam_search(PROMPTS, params), strict=True):
        assert_same(found(one), found(together))


def test_a_prompt_dicts_cache_salt_reaches_each_of_its_steps(engine, monkeypatch):
    """vLLM's prompt dicts take a cache_salt, as generate's do: each prompt's steps are requests of its salt (its
    blocks shared with that salt's alone), to the sequences the unsalted prompts find."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    plain = engine.beam_search(PROMPTS[:2], params)
    sent, generate = [], engine.generate

    def recorded(prompts, step, **kwargs):
        steps = step if isinstance(step, list) else [step] * len(prompts)
        sent.extend((tuple(p[:3]), s.cache_salt) for p, s in zip(prompts, steps, strict=True))
        return generate(prompts, step, **kwargs)

    monkeypatch.setattr(engine, "generate", recorded)
    salted = engine.beam_search([{"prompt": PROMPTS[0], "cache_salt": "a"},
                                 {"prompt_token_ids": engine.encode(PROMPTS[1]), "cache_salt": "b"}], params)
    for one, other in zip(salted, plain, strict=True):
        assert_same(found(one), found(other))
    heads = {tuple(engine.encode(p)[:3]): salt for p, salt in zip(PROMPTS[:2], "ab", strict=True)}
    assert sent and all(heads[head] == salt for head, salt in sent)
    assert {salt for _, salt in sent} == {"a", "b"}


@pytest.fixture(scope="module")
def likely(next_logprobs, engine):
    """The token most likely after "tpgraph", which EOS is made to follow."""
    return int(next_logprobs([engine.encode("tpgraph")])[0].argmax())


@pytest.fixture(scope="module")
def eos_engine(likely):
    """The built-in model made to end (make_eos_likely), and its brute-force next_logprobs."""
    with TPEngine(**ENGINE) as e:
        make_eos_likely(e.model, likely)
        yield e, next_logprobs_of(likely)


def test_finished_sequences_are_kept_and_ranked_with_the_live_ones(eos_engine):
    """A sequence that generated the EOS finishes "stop" (stop_reason the EOS id, the EOS kept in its tokens and, as
    vLLM's, out of the score's length), stays in the ranking while the others go on, and comes out where its
    length-penalized score puts it, the brute-force search's order: by the sums alone (length_penalty 0) the early
    EOSes win; a strong penalty on length (3: the sum over the length cubed, the prompt's 8 tokens counted) ranks a
    sequence that ran to max_tokens between two that finished at the first and second steps."""
    eos_engine, next_logprobs = eos_engine
    ids = eos_engine.encode("tpgraph")
    ranked = {}
    for penalty in (0.0, 1.0, 3.0):
        params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=penalty)
        (out,) = eos_engine.beam_search(["tpgraph"], params)
        assert_same(found(out), reference_beam_search(next_logprobs, ids, 3, 5, penalty))
        for s in out.sequences:
            if s.finish_reason == "stop":
                assert s.tokens[-1] == EOS and s.stop_reason == EOS and len(s.tokens) < len(ids) + 5
            else:
                assert s.finish_reason == "length" and s.stop_reason is None and len(s.tokens) == len(ids) + 5
            assert s.text == eos_engine.get_tokenizer().decode(s.tokens)  # (the EOS's text too, as vLLM's)
        ranked[penalty] = [(len(s.tokens) - len(ids), s.finish_reason) for s in out.sequences]
    assert ranked[0.0] == [(1, "stop"), (2, "stop"), (2, "stop")]
    assert ranked[3.0] == [(1, "stop"), (5, "length"), (2, "stop")]
    kept = eos_engine.beam_search(["tpgraph"], BeamSearchParams(beam_width=3, max_tokens=5,
                                                                 include_stop_str_in_output=True))
    assert kept[0].sequences[0].tokens == ids + [EOS]
    assert kept[0].sequences[0].text == "<|begin_of_text|>tpgraph<|end_of_text|>"


def test_ignore_eos_lets_beams_go_past_it(eos_engine):
    eos_engine, next_logprobs = eos_engine
    ids = eos_engine.encode("tpgraph")
    (out,) = eos_engine.beam_search(["tpgraph"], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    assert_same(found(out), reference_beam_search(next_logprobs, ids, 2, 4, ignore_eos=True))
    assert all(s.finish_reason == "length" and len(s.tokens) == len(ids) + 4 for s in out.sequences)
    assert any(EOS in s.tokens[len(ids):] for s in out.sequences)


# ---- the search itself, over scripted log-probabilities ------------------------------------------------------------

# each token's next tokens and their log-probabilities (token 9 is the EOS)
SCRIPT = {1: {9: -0.5, 2: -0.7}, 2: {3: -0.1, 9: -3.0}, 3: {4: -0.1, 9: -3.0}, 4: {5: -0.1, 9: -3.0},
          5: {6: -0.1, 9: -3.0}}


def scripted(calls: list, script: dict):
    """A generate that answers each prompt with the script's entry for its last token, as vLLM-shaped outputs."""
    def generate(prompts: list[list[int]], params: SamplingParams):
        calls.append((prompts, params))
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(logprobs=[
            {t: Logprob(v, r) for r, (t, v) in enumerate(script[p[-1]].items(), 1)}])]) for p in prompts]
    return generate


def search(params: BeamSearchParams, max_model_len: int = 64, calls: list | None = None,
           script: dict = SCRIPT) -> list[BeamSearchSequence]:
    out = run_beam_search(scripted([] if calls is None else calls, script), [[1]], params, eos_token_id=9,
                          max_model_len=max_model_len, decode=lambda ids: " ".join(map(str, ids)))
    return out[0].sequences


def test_an_early_eos_wins_or_loses_by_its_length_penalized_score():
    """[1, 9] finished at the first step (cum -0.5, length 1: the EOS is not counted) against [1, 2, 3, 4] still live
    at the last (cum -0.9, length 4): length_penalty 0 ranks by the sums alone, 1 by the mean, where the long one
    wins; [1, 2, 9] and [1, 2, 3, 9] finish too, and rank by theirs."""
    calls = []
    by_sum = search(BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0), calls=calls)
    assert [(s.tokens, s.finish_reason, s.stop_reason) for s in by_sum] == [([1, 9], "stop", 9),
                                                                            ([1, 2, 3, 4], "length", None)]
    assert by_sum[0].cum_logprob == pytest.approx(-0.5) and by_sum[1].cum_logprob == pytest.approx(-0.9)
    by_mean = search(BeamSearchParams(beam_width=4, max_tokens=3, length_penalty=1.0))
    assert [s.tokens for s in by_mean] == [[1, 2, 3, 4], [1, 9], [1, 2, 3, 9], [1, 2, 9]]
    assert [float(exact_score(s.tokens, s.cum_logprob, 9, 1.0)) for s in by_mean] == pytest.approx(
        [-0.9 / 4, -0.5, -3.8 / 3, -3.7 / 2])
    assert by_mean[1].text == "1 9" and by_mean[1].logprobs[0][9] == Logprob(-0.5, 1)  # (the EOS's text too)
    # each step one request a live beam: a token, with 2 * beam_width log-probabilities, at the search's temperature
    assert [p for p, _ in calls] == [[[1]], [[1, 2]], [[1, 2, 3]]]
    assert all((q.max_tokens, q.logprobs, q.temperature, q.n) == (1, 4, 0.0, 1) for _, q in calls)


# a prompt of 8 tokens (the last 1) whose candidates come out of order: each step's ranking must sort them
EXTREME = {1: {2: -1.2, 3: -0.4, 8: -0.6, 9: -0.5}, 3: {4: -0.4, 9: -2.0}, 8: {5: -0.1, 9: -0.05}}
EXTREME_PROMPT = [7] * 7 + [1]


def exact_search(script: dict, prompt: list[int], width: int, steps: int, length_penalty: float) -> list:
    """vLLM's search over a script, each ranking by exact_score (stable, as sorted is: ties keep the candidates'
    order)."""
    def score(seq):
        return exact_score(seq[0], seq[1], 9, length_penalty)

    beams, finished = [(prompt, 0.0)], []
    for _ in range(steps):
        children = []
        for tokens, cum in beams:
            for token, lp in script[tokens[-1]].items():
                (finished if token == 9 else children).append((tokens + [token], cum + lp))
        beams = sorted(children, key=score, reverse=True)[:width]
    return sorted(finished + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("penalty, want", [
    # 8.0 ** 400 overflows: the longest rank first, those of one length by their sums
    (400.0, [([8, 5], "length"), ([3, 4], "length")]),
    (1e308, [([8, 5], "length"), ([3, 4], "length")]),  # (1e308 * log(length) overflows too)
    # 8.0 ** -400 is 0.0: the shortest first ([9] at length 8, then [8, 9] (-0.65) before [3, 9] (-2.4) at 9)
    (-400.0, [([9], "stop"), ([8, 9], "stop")]),
    (-1e308, [([9], "stop"), ([8, 9], "stop")]),
    (0.0, [([9], "stop"), ([8, 9], "stop")]),  # (by the sums alone)
    (1.0, [([9], "stop"), ([8, 5], "length")]),  # (by the means: -0.5 / 8, then -0.7 / 10 before -0.65 / 9)
])
def test_an_extreme_length_penalty_ranks_as_the_exact_math_says(penalty, want):
    """A length_penalty whose power of a length leaves the float range (a length of 8 or more: 8.0 ** 400 raises
    OverflowError, 8.0 ** -400 is 0.0) ranks each step's beams and the outputs as the exact score does, not raising
    and not tying them all: the first step keeps [3] and [8] of [2], [3], [8] (one length: by their sums)."""
    calls = []
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=penalty)
    out = run_beam_search(scripted(calls, EXTREME), [EXTREME_PROMPT], params, eos_token_id=9, max_model_len=64,
                          decode=None)
    got = [(s.tokens, s.cum_logprob) for s in out[0].sequences]
    assert [(s.tokens[8:], s.finish_reason) for s in out[0].sequences] == want
    assert [p for p, _ in calls] == [[EXTREME_PROMPT], [EXTREME_PROMPT + [3], EXTREME_PROMPT + [8]]]
    if abs(penalty) < 1e300:  # (no decimal holds 8 ** 1e308)
        assert got == exact_search(EXTREME, EXTREME_PROMPT, 2, 2, penalty)


@pytest.mark.parametrize("penalty", [400.0, -400.0, 1e308, 1.0])
def test_a_sum_of_zero_ranks_first_at_any_length_penalty(penalty):
    """A sum of 0 (a token certain at every step) scores 0 at any length, the best possible: such sequences rank
    first, in their candidates' order (finished before live), the negative ones after."""
    script = {1: {2: -0.3, 3: 0.0, 9: 0.0}}
    out = run_beam_search(scripted([], script), [EXTREME_PROMPT], BeamSearchParams(beam_width=3, max_tokens=1,
                                                                                    length_penalty=penalty),
                          eos_token_id=9, max_model_len=64, decode=None)
    assert [(s.tokens[8:], s.cum_logprob) for s in out[0].sequences] == [([9], 0.0), ([3], 0.0), ([2], -0.3)]
    if abs(penalty) < 1e300:
        assert [(s.tokens, s.cum_logprob) for s in out[0].sequences] == exact_search(script, EXTREME_PROMPT, 3, 1,
                                                                                      penalty)


def test_scores_in_the_float_range_rank_as_vllms_floats_ties_kept():
    """Where every score is a float, the ranking is vLLM's by those floats, a tie kept in the candidates' order:
    [1, 9] (-0.5 over 1) and [1, 2, 3] (-1.5 over 3) are both -0.5 at length_penalty 1, so the finished one, ranked
    first of the two, stays first (by logarithms, log(1.5) - log(3) is a rounding below log(0.5), and would not)."""
    script = {1: {9: -0.5, 2: -0.75}, 2: {3: -0.75}}
    assert -1.5 / 3 == -0.5 / 1 and math.log(1.5) - math.log(3) < math.log(0.5)
    seqs = run_beam_search(scripted([], script), [[1]], BeamSearchParams(beam_width=2, max_tokens=2), eos_token_id=9,
                           max_model_len=64, decode=None)[0].sequences
    assert [(s.tokens, s.cum_logprob) for s in seqs] == [([1, 9], -0.5), ([1, 2, 3], -1.5)]


def test_the_search_ranks_as_the_exact_scores_never_raising():
    """_Rank, the search's sort key, orders sequences as their exact length-penalized scores do (a final EOS not
    counted), where the power of a length leaves the float range (8.0 ** 400 overflows, 8.0 ** -400 is 0.0) or the
    quotient is subnormal (6.0 ** 400 overflows, 7.0 ** -365 is a subnormal), never raising; at +-1e308, which no
    decimal power holds, as at +-400: the longest (the shortest) first, one length by its sums."""
    shapes = [(6, -1.7, 0), (7, -1e-5, 0), (8, -1.7, 0), (8, -0.2, 1), (9, -3.0, 0), (1, -0.4, 0), (8, 0.0, 0),
              (7, -math.inf, 0)]
    seqs = [BeamSearchSequence(list(range(length)) + [9] * eos, cum_logprob=cum) for length, cum, eos in shapes]

    def ranked(penalty: float) -> list:
        return [(s.tokens, s.cum_logprob) for s in sorted(seqs, key=lambda s: _Rank(s, 9, penalty))]

    for penalty in (0.0, 0.5, 1.0, 2.0, -1.0, 300.0, 400.0, -400.0, -365.0):
        exact = sorted(seqs, key=lambda s: exact_score(s.tokens, s.cum_logprob, 9, penalty), reverse=True)
        assert ranked(penalty) == [(s.tokens, s.cum_logprob) for s in exact], penalty
    assert ranked(1e308) == ranked(400.0) and ranked(-1e308) == ranked(-400.0)


def test_a_search_ends_when_every_beam_has_finished():
    """Where a step's candidates are all the EOS, no beam is left: the search stops there, not at max_tokens."""
    calls = []
    seqs = search(BeamSearchParams(beam_width=2, max_tokens=6), calls=calls, script={1: {9: -0.25}})
    assert [(s.tokens, s.finish_reason, s.cum_logprob) for s in seqs] == [([1, 9], "stop", -0.25)]
    assert len(calls) == 1


def test_a_beam_that_fills_max_model_len_finishes_for_length():
    """generate cannot take a prompt of max_model_len tokens: such a beam finishes "length" where it is (vLLM's
    dropped it), and is ranked with the others."""
    calls = []
    seqs = search(BeamSearchParams(beam_width=1, max_tokens=6, length_penalty=1.0), max_model_len=3, calls=calls)
    assert [(s.tokens, s.finish_reason) for s in seqs] == [([1, 2, 3], "length")]
    assert [p for p, _ in calls] == [[[1]], [[1, 2]]]


def test_an_async_step_drives_the_same_search():
    """run_beam_search_async (the server's driver): its step gets each step's prompts and the step's SamplingParams
    and returns each one's candidates; the search, its requests and its outputs are run_beam_search's."""
    calls, generate = [], scripted([], SCRIPT)

    async def step(prompts, params):
        calls.append((prompts, params))
        await asyncio.sleep(0)
        return [out.outputs[0].logprobs[0] for out in generate(prompts, params)]

    for fields in (dict(beam_width=2, max_tokens=3, length_penalty=0.0), dict(beam_width=4, max_tokens=5)):
        params, want = BeamSearchParams(**fields), []
        (got,) = asyncio.run(run_beam_search_async(step, [[1]], params, eos_token_id=9, max_model_len=64,
                                                   decode=lambda ids: " ".join(map(str, ids))))
        assert [(s.tokens, s.cum_logprob, s.text, s.finish_reason) for s in got.sequences] == [
            (s.tokens, s.cum_logprob, s.text, s.finish_reason) for s in search(params, calls=want)]
        assert [(p, q) for p, q in calls] == want
        calls.clear()


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_finished_sequence_text_holds_its_eos_either_way(include_stop_str_in_output):
    """vLLM's offline LLM.beam_search decodes each returned sequence's tokens whole (the prompt's and a final EOS's),
    include_stop_str_in_output or not: that flag is its server's (use_beam_search), which leaves the EOS out."""
    (first,) = search(BeamSearchParams(beam_width=1, max_tokens=1, length_penalty=0.0,
                                       include_stop_str_in_output=include_stop_str_in_output))
    assert (first.tokens, first.text, first.finish_reason) == ([1, 9], "1 9", "stop")


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    (dict(beam_width=0), r"beam_width must be between 1 and \d+, got 0"),
    (dict(beam_width=-2), r"beam_width must be between 1 and \d+, got -2"),
    (dict(beam_width=2.0), r"beam_width must be an integer, got 2.0"),
    (dict(beam_width=True), r"beam_width must be an integer, got True"),
    (dict(max_tokens=0), r"max_tokens must be >= 1, got 0"),
    (dict(max_tokens=None), r"max_tokens must be an integer, got None"),
    (dict(temperature=-0.5), r"temperature must be in \[0.0, 2.0\], got -0.5"),
    (dict(temperature=2.5), r"temperature must be in \[0.0, 2.0\], got 2.5"),
    (dict(length_penalty=math.nan), r"length_penalty must be a finite number, got nan"),
    (dict(length_penalty="1"), r"length_penalty must be a finite number, got '1'"),
    (dict(ignore_eos="no"), r"ignore_eos must be true or false, got 'no'"),
    (dict(include_stop_str_in_output=1), r"include_stop_str_in_output must be true or false, got 1"),
    (dict(structured_outputs={"regex": "[0-9]+"}), r"structured_outputs is not supported with beam search"),
])
def test_bad_params_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message) as caught:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})
    assert isinstance(caught.value, RequestError)


def test_beam_width_past_vllms_max_n_sequences_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "3")
    with pytest.raises(RequestError, match=r"beam_width must be between 1 and 3, got 4"):
        BeamSearchParams(beam_width=4, max_tokens=2)


def test_the_engine_refuses_what_its_steps_could_not_run(engine):
    """Before any step: 2 * beam_width log-probabilities past max_logprobs, a field set since the params were made,
    other params, a bad concurrency_limit, and a LoRA adapter; the engine then searches on."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    with pytest.raises(RequestError, match=r"beam_width 11 needs 22 log-probabilities a step \(2 \* beam_width\), "
                                           r"more than this engine's max_logprobs 20: at most beam_width 10"):
        engine.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=3))
    changed = BeamSearchParams(beam_width=2, max_tokens=3)
    changed.max_tokens = 0
    with pytest.raises(RequestError, match="max_tokens must be >= 1, got 0"):
        engine.beam_search(PROMPTS, changed)
    with pytest.raises(RequestError, match="beam_search takes a BeamSearchParams, got SamplingParams"):
        engine.beam_search(PROMPTS, SamplingParams(max_tokens=3))
    for limit in (0, 1.5, True):
        with pytest.raises(RequestError, match="concurrency_limit must be a positive integer or None"):
            engine.beam_search(PROMPTS, params, concurrency_limit=limit)
    with pytest.raises(RequestError, match="lora_request: tpgraph serves no LoRA adapters"):
        engine.beam_search(PROMPTS, params, lora_request=object())
    with pytest.raises(RequestError, match="the prompt is empty"):
        engine.beam_search([[]], params)
    assert len(engine.beam_search(PROMPTS, params)[0].sequences) == 2
