"""vLLM's offline beam search (LLM.beam_search), built as vLLM builds it: on the engine's own generate.

Each step, every live beam of every prompt is one request for a single token with logprobs = 2 * beam_width; its
candidates (the sampled token and the 2 * beam_width most likely) extend the beam, a candidate that is the EOS ends
as a finished sequence, and the beam_width best of the rest by length-penalized score live on. The prefix cache
reads each beam's prompt back (its blocks were computed the step before), so a step computes little more than
each beam's newest tokens. Only generate drives the engine, so this runs wherever generate does: under torchrun
every rank makes the same calls in step, and rank 0 of started ranks drives them through its own generate.

The search itself (beam_search_steps) does not run its steps: run_beam_search drives it through generate, and the
server (vLLM's `use_beam_search`) through its own async requests (run_beam_search_async), each step's beams ordinary
one-token requests that reach every rank as any other request does.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from tpgraph.engine.logprob import Logprob
from tpgraph.engine.sampling_params import MAX_TEMPERATURE, SamplingParams, _check_int, _check_real, max_n
from tpgraph.errors import RequestError


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` sequences kept and returned per prompt, each of at most `max_tokens`
    new tokens. `temperature` is the step's (0: each step's candidates are the most likely tokens; above 0 the sampled
    token joins them where it is not among them). `length_penalty`: a sequence's score is its cumulative log-probability
    over its length (the prompt's tokens counted, an EOS that ends it not) to this power, as vLLM's. A finished
    sequence's offline text holds its EOS's either way, as vLLM's; `include_stop_str_in_output` is the server's (its
    use_beam_search replies). `structured_outputs` (vLLM's) is taken only as None. Checked when made, and again by
    beam_search (a field set afterwards is checked there)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise RequestError (a ValueError) naming the first field that cannot run."""
        most = max_n()  # (vLLM checks beam_width against VLLM_MAX_N_SEQUENCES, as it checks n)
        _check_int("beam_width", self.beam_width, 1, most)
        _check_int("max_tokens", self.max_tokens, 1, None)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # (a truthy "no" would silently mean yes)
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        # (SamplingParams' range: each step takes it)
        _check_real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_real("length_penalty", self.length_penalty, -math.inf, math.inf)
        if self.structured_outputs is not None:
            raise RequestError("structured_outputs is not supported with beam search here: leave it None (generate's "
                               "SamplingParams(structured_outputs=...) holds sampled outputs to a grammar)")


@dataclass
class BeamSearchSequence:
    """vLLM's BeamSearchSequence: `tokens` are the prompt's then the generated ones (an EOS that ended it kept),
    `logprobs` one {token id: Logprob} entry per generated token (the step's candidates, the chosen one among them),
    `cum_logprob` the generated tokens' sum, `text` all of `tokens` decoded (the prompt's and a final EOS's too, as
    vLLM's offline LLM.beam_search). `finish_reason` "stop" with `stop_reason` the EOS id, or "length" (at
    max_tokens or max_model_len)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: None = None  # (vLLM's; no adapters here)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's BeamSearchOutput: a prompt's best sequences (at most beam_width), best first."""

    sequences: list[BeamSearchSequence]


def _scored_length(tokens: Sequence[int], eos_token_id: int | None) -> int:
    """The length a score divides by: the prompt's tokens counted, a final EOS not."""
    return len(tokens) - (1 if eos_token_id is not None and tokens[-1] == eos_token_id else 0)


class _Rank:
    """A sequence's place in a ranking (the sort key: ascending is best first), the search's one: ordered as vLLM's
    (after transformers') length-penalized scores, cum_logprob / length ** length_penalty (the length counting the
    prompt's tokens but not a final EOS), taken exactly, descending, never raising. Where both sequences' scores are
    normal floats (the power of the length in the float range, the quotient neither 0 nor subnormal), by those, as
    vLLM's ranks (its ties kept: sorted keeps their order). Elsewhere with no power at all: for cum_logprob < 0 the
    score is -exp(z), z = log(-cum_logprob) - length_penalty * log(length), so a higher score is a lower z, and two
    sequences compare by the difference of their z's, log(-cum_a) - log(-cum_b) - length_penalty * (log(length_a) -
    log(length_b)) (+-inf where the penalty's term overflows), or, where their lengths are one (or the penalty is 0), by
    their sums, exactly: a length_penalty of any size (8.0 ** 400 overflows, 8.0 ** -400 is 0.0) leaves them ordered as
    the exact scores are, none tied that those order. A sum of 0 scores 0 at any length, the best possible (a positive
    sum, which no log-probability makes, ranks above it, by a higher z); -inf (or nan) the worst."""

    __slots__ = ("kind", "cum", "score", "length", "size", "log_length", "penalty")

    def __init__(self, seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> None:
        cum = self.cum = seq.cum_logprob
        # 0: +inf, 1: a positive sum, 2: 0, 3: a negative sum, 4: -inf or nan
        self.kind = 2 if cum == 0.0 else (0 if cum == math.inf else 1) if cum > 0 else 3 if cum > -math.inf else 4
        self.length = _scored_length(seq.tokens, eos_token_id)
        self.size = math.log(abs(cum)) if self.kind in (1, 3) else 0.0
        self.log_length, self.penalty = math.log(self.length), length_penalty
        self.score = None  # (vLLM's float score, where it is a normal float)
        if self.kind in (1, 3):
            try:
                score = cum / float(self.length) ** length_penalty
            except (OverflowError, ZeroDivisionError):
                score = 0.0
            if sys.float_info.min <= abs(score) < math.inf:
                self.score = score

    def __lt__(self, other: _Rank) -> bool:
        """Whether this sequence's score is above the other's."""
        if self.kind != other.kind:
            return self.kind < other.kind
        if self.score is not None and other.score is not None:
            return self.score > other.score
        if self.kind not in (1, 3) or self.length == other.length or self.penalty == 0.0:
            return self.cum > other.cum  # (one divisor, the higher sum the higher score; +infs, 0s, -infs tie)
        z = (self.size - other.size) - self.penalty * (self.log_length - other.log_length)  # (z_self - z_other)
        return z < 0 if self.kind == 3 else z > 0


@dataclass
class _Search:
    """One prompt's search: its live beams, and the sequences finished so far (every one kept to the final ranking)."""

    prompt_len: int
    beams: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)


# generate as run_beam_search calls it: token-id prompts and one SamplingParams -> vLLM-shaped outputs
Generate = Callable[[list[list[int]], SamplingParams], list[Any]]
# a step's candidates for one live beam: the logprobs entry of its one generated token ({token id: Logprob}: the
# token generated and the 2 * beam_width most likely)
Candidates = dict[int, Logprob]
# the search as its drivers run it (beam_search_steps): it yields each step's live beams' token ids, is sent back each
# one's Candidates, and returns the outputs
Steps = Generator[list[list[int]], list[Candidates], list[BeamSearchOutput]]


def check_width(beam_width: int, max_logprobs: int, width: str = "beam_width", asked_as: str = "",
                holder: str = "engine") -> None:
    """A RequestError where a search of `beam_width` cannot run under `max_logprobs`: each step asks 2 * beam_width
    candidates. width, asked_as, holder: how the caller's users name the width, the request and the limit's owner."""
    if 2 * beam_width > max_logprobs:
        raise RequestError(f"{width} {beam_width} needs {2 * beam_width} log-probabilities a step{asked_as} "
                           f"(2 * {width}), more than this {holder}'s max_logprobs {max_logprobs}: at most {width} "
                           f"{max_logprobs // 2}")


def step_params(params: BeamSearchParams) -> SamplingParams:
    """The request each live beam makes a step, as vLLM's: one token, at the search's temperature, with logprobs =
    2 * beam_width."""
    return SamplingParams(n=1, temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width)


def beam_search_steps(prompts: list[list[int]], params: BeamSearchParams, *, eos_token_id: int | None,
                      max_model_len: int, decode: Callable[[list[int]], str] | None,
                      concurrency_limit: int | None = None, progress: bool = False) -> Steps:
    """Beam search over `prompts` (token ids), one token a step, apart from how a step runs: each step it yields the
    live beams' token ids, each to run as one request of step_params(params), and takes back (send) each one's
    Candidates in that order; it returns each prompt's BeamSearchOutput (each sequence's text by `decode`; None: no
    text). run_beam_search drives it through generate,
    the server through its own requests (the same search either way). `concurrency_limit`: at most that many prompts
    searched together (vLLM's; None: all). `progress`: a bar over the steps (vLLM's use_tqdm)."""
    searches = [_Search(len(ids), [BeamSearchSequence(list(ids))]) for ids in prompts]
    limit = concurrency_limit or max(len(searches), 1)
    for start in range(0, len(searches), limit):
        batch = searches[start:start + limit]
        for _ in tqdm(range(params.max_tokens), desc="beam search", unit="token", disable=not progress):
            live = _live_beams(batch, max_model_len)
            if not live:
                break
            entries = yield [beam.tokens for _, beam in live]
            _extend(batch, live, entries, params, eos_token_id)
    return [_output(s, params, eos_token_id, decode) for s in searches]


def run_beam_search(generate: Generate, prompts: list[list[int]], params: BeamSearchParams,
                    **options: Any) -> list[BeamSearchOutput]:
    """beam_search_steps (its keyword options) driven by `generate`, one call a step for every live beam."""
    step, steps = step_params(params), beam_search_steps(prompts, params, **options)
    try:
        batch = next(steps)
        while True:
            outputs = generate(batch, step)
            batch = steps.send([out.outputs[0].logprobs[0] for out in outputs])  # (one entry: the one token's)
    except StopIteration as done:
        return done.value


async def run_beam_search_async(step: Callable[[list[list[int]], SamplingParams], Awaitable[list[Candidates]]],
                                prompts: list[list[int]], params: BeamSearchParams,
                                **options: Any) -> list[BeamSearchOutput]:
    """beam_search_steps (its keyword options) driven by an async `step`, which runs each of a step's prompts as a
    request of the SamplingParams it is given and returns each one's Candidates (the server's requests)."""
    sampling, steps = step_params(params), beam_search_steps(prompts, params, **options)
    try:
        batch = next(steps)
        while True:
            batch = steps.send(await step(batch, sampling))
    except StopIteration as done:
        return done.value


def _extend(batch: list[_Search], live: list[tuple[_Search, BeamSearchSequence]], entries: list[Candidates],
            params: BeamSearchParams, eos_token_id: int | None) -> None:
    """A step's candidates extend their beams: one that is the EOS finishes its sequence, and the beam_width best of
    the rest of each search live on."""
    candidates: dict[int, list[BeamSearchSequence]] = {id(s): [] for s in batch}
    for (search, beam), entry in zip(live, entries, strict=True):
        for token, lp in entry.items():
            child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry],
                                       cum_logprob=beam.cum_logprob + lp.logprob)
            if token == eos_token_id and not params.ignore_eos:
                child.finish_reason, child.stop_reason = "stop", eos_token_id
                search.finished.append(child)
            else:
                candidates[id(search)].append(child)
    for search in batch:
        search.beams = _best(candidates[id(search)], params.beam_width, eos_token_id, params.length_penalty)


def _live_beams(batch: list[_Search], max_model_len: int) -> list[tuple[_Search, BeamSearchSequence]]:
    """The beams that take another step, each with its search. A beam that fills max_model_len takes no more tokens:
    it finishes "length", as generate ends a sample there (vLLM's drops it). (A prompt that fills it is generate's
    to refuse.)"""
    live = []
    for search in batch:
        for beam in search.beams:
            if len(beam.tokens) >= max_model_len and len(beam.tokens) > search.prompt_len:
                beam.finish_reason = "length"
                search.finished.append(beam)
        search.beams = [beam for beam in search.beams if beam.finish_reason is None]
        live.extend((search, beam) for beam in search.beams)
    return live


def _best(sequences: list[BeamSearchSequence], k: int, eos_token_id: int | None,
          length_penalty: float) -> list[BeamSearchSequence]:
    """The k best by score, best first (sorted is stable: equal scores keep the candidates' order, as vLLM's), ranked
    by _Rank: the length-penalized scores' order, with no power of a length to overflow."""
    return sorted(sequences, key=lambda s: _Rank(s, eos_token_id, length_penalty))[:k]


def _output(search: _Search, params: BeamSearchParams, eos_token_id: int | None,
            decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
    """The finished sequences and the beams still live at the end (finished "length"), ranked together."""
    for beam in search.beams:
        beam.finish_reason = "length"
    best = _best(search.finished + search.beams, params.beam_width, eos_token_id, params.length_penalty)
    for seq in best if decode is not None else ():
        seq.text = decode(seq.tokens)  # (whole, a final EOS too: vLLM's offline text; the flag is its server's)
    return BeamSearchOutput(best)
