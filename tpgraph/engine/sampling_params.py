"""What a request asks of sampling and stopping, checked once when it arrives (OpenAI / vLLM field names)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass

import numpy

# (vLLM's StructuredOutputsParams and GuidedDecodingParams too, as its scripts import them from vllm.sampling_params)
from tpgraph.engine.structured import GuidedDecodingParams as GuidedDecodingParams
from tpgraph.engine.structured import StructuredOutput, structured_outputs_params
from tpgraph.engine.structured import StructuredOutputsParams as StructuredOutputsParams
from tpgraph.errors import ConfigError, RequestError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# the most samples a request may ask (n): vLLM's VLLM_MAX_N_SEQUENCES, read as vLLM reads it (a public server lowers
# it); pass@k evaluations ask n = 200 and more
MAX_N_VARIABLE, MAX_N_DEFAULT = "VLLM_MAX_N_SEQUENCES", 16384
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit (every rank receives them, and the sampler uploads them each step)
MAX_BAD_WORDS = 100  # (each is matched against every step's output tail)
MAX_BAD_WORD_CHARS = 1000  # (each is tokenized on every rank's step thread, where a long one would hold every request)
MAX_STOP_STRINGS = 100  # (each is scanned on the step thread for every character every request writes)
# (each one's automaton is built on the engine's thread as the request is taken, where a long one held every request;
# as long as a bad word may be)
MAX_STOP_STRING_CHARS = MAX_BAD_WORD_CHARS
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (SamplingParams.greedy): after MIN_TEMPERATURE, 0 alone
# vLLM's _MAX_TEMP: a temperature in (0, this) is raised to it (logits over smaller ones risk inf and NaN)
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses a larger one (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """Temperature (at most 2, as vLLM's) 0 is greedy, which takes n 1 alone (vLLM's refuses more: the samples would
    all be the same); one in (0, 0.01) is raised to 0.01 (MIN_TEMPERATURE), as vLLM's is. top_k 0 (or -1) and top_p 1
    and min_p 0 switch those filters off. Together, on the temperature-scaled distribution and in vLLM's V1 order:
    min-p cuts what is below min_p times the largest probability, top-k what is below the k-th largest, and top-p
    keeps the smallest set of the largest whose share of what those two kept reaches top_p (SGLang's top-p takes its
    share of the whole and so may keep more). Penalties follow
    OpenAI (frequency, presence: subtracted per output occurrence / once) and HF (repetition: divides positive logits
    and multiplies negative ones, for every prompt and output token).
    `seed` -1 is no seed, as in vLLM. `detokenize` False (vLLM's): the output's token ids alone, its text "" (no stop
    strings then). `spaces_between_special_tokens` False (vLLM's; with skip_special_tokens False): no space a decoder
    would put between two special (added) tokens in a row.
    `logit_bias` = {token id: value in [-100, 100]} added to those logits before penalties and sampling (OpenAI's
    field; greedy rows too); given as a mapping or (id, value) pairs, kept as pairs in id order.
    `logprobs` = how many top alternatives to return beside the sampled token's log-probability (None: no
    log-probabilities); they are the model's own, before bias and penalties (over what `structured`'s grammar allows,
    as vLLM's). `prompt_logprobs` = the same for each prompt token after the first (vLLM's field; the server's `echo`
    with `logprobs`): such a request's prompt runs in full, never read from the prefix cache. `structured`: what the
    output must match (structured.py); with `structured_after` (a reasoning model's end of thoughts, "</think>"),
    only the output after that text's tokens (as the tokenizer encodes it: the model must write them so, which a
    one-token marker ensures). vLLM's
    `structured_outputs=StructuredOutputsParams(...)` and `guided_decoding=GuidedDecodingParams(...)` are read as
    `structured`; its `best_of` is taken only equal to n.
    vLLM's `allowed_token_ids`: the only ids the output may hold (every other logit masked; log-probabilities are the
    model's own). `bad_words`: words the output may not complete (bad_words.py reads them as vLLM does: a word's last
    token is banned where the output ends with the tokens before it). `priority` (vLLM's request priority): under the
    priority scheduling policy, lower values are served first (arrival breaks ties) and preempted last; the default
    policy, first come first served, takes only 0. `truncate_prompt_tokens` (vLLM's): keep the prompt's last k tokens
    (-1: max_model_len, as vLLM's LLM reads it: a prompt cut to that is refused, as it leaves no room to generate),
    where a longer prompt was refused. `cache_salt` (vLLM's request field, a non-empty string): the prefix cache shares
    this request's blocks only with requests of the same salt (a tenant's prompts are neither reused by, nor timed
    from, another tenant's)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    structured_after: str | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    # vLLM's names, read when made into the fields above (structured_outputs and guided_decoding read back and
    # set as `structured`: VLLM_STRUCTURED_NAMES; best_of read back is None)
    structured_outputs: InitVar[StructuredOutput | Mapping | None] = None
    guided_decoding: InitVar[StructuredOutput | Mapping | None] = None
    best_of: InitVar[int | None] = None

    def __post_init__(self, structured_outputs: StructuredOutput | Mapping | None,
                      guided_decoding: StructuredOutput | Mapping | None, best_of: int | None) -> None:
        self._read_vllm_names(structured_outputs, guided_decoding, best_of)
        for name in ("stop", "stop_token_ids", "logit_bias", "bad_words"):  # (vLLM's default for these: None)
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        for name in _NUMBER_FIELDS:  # (numpy's among them: read as Python's, then checked)
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids", tuple(map(_plain, _as_tuple("stop_token_ids", self.stop_token_ids,
                                                                               "a list of token ids"))))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if isinstance(getattr(self, name), numpy.bool_):  # (numpy's, as its numbers are read: Python's)
                object.__setattr__(self, name, bool(getattr(self, name)))
            if not isinstance(getattr(self, name), bool):  # (a truthy "no" would silently mean yes)
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if type(self.temperature) in (int, float) and 0 < self.temperature < MIN_TEMPERATURE:
            # (vLLM's SamplingParams does this before reading temperature < 1e-5 as greedy: 1e-6 samples, at 0.01)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if type(self.seed) is int and self.seed == -1:  # vLLM's "no seed" (its LLM and server alike)
            object.__setattr__(self, "seed", None)
        most = max_n()
        _check_int("n", self.n, 1, most, hint=f"{MAX_N_VARIABLE} sets the most" if type(self.n) is int
                   and self.n > most else "")
        _check_real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.greedy and self.n > 1:  # (vLLM's _verify_greedy_sampling: the samples would all be the same)
            raise RequestError(f"n must be 1 when sampling greedily (temperature 0), got n={self.n}: every sample "
                               "would be the same; a temperature above 0 samples n different ones")
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, None, hint="0 or -1 turns it off")
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)  # (vLLM's: no cap)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.seed is not None:
            # (what torch.Generator.manual_seed takes, as vLLM seeds a request's generator with it: a 64-bit seed drawn
            # unsigned, random.getrandbits(64), too)
            _check_int("seed", self.seed, -(2 ** 63), 2 ** 64 - 1)
        _check_int("priority", self.priority, -(2 ** 63), 2 ** 63 - 1)
        if self.truncate_prompt_tokens is not None and not (type(self.truncate_prompt_tokens) is int
                                                            and self.truncate_prompt_tokens == -1):  # (-1: to fit)
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None, hint="or -1, to fit")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:  # (named: max_tokens may be its default)
            raise RequestError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check_stop(self.stop)
        if self.stop and not self.detokenize:  # (they are matched in the text, which detokenize=False never makes)
            raise RequestError("stop strings need detokenize=True (they are found in the output's text)")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, 0, None)
        # (repeats dropped, as vLLM's: each step looks a token up in them, and below min_tokens bans them all)
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # (vLLM's: one alternative)
                object.__setattr__(self, name, 1)
            if (value := getattr(self, name)) is not None:  # (vLLM's -1 asks for every token's: said why not)
                every = f"vLLM's -1, every token's, is not taken: at most {MAX_LOGPROBS} alternatives, OpenAI's limit"
                _check_int(name, value, 0, MAX_LOGPROBS, hint=every if value == -1 else "")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = tuple(map(_plain, _as_tuple("allowed_token_ids", self.allowed_token_ids, "a list of token ids")))
            if not allowed:
                raise RequestError("allowed_token_ids is empty: it must allow at least one token (or be left out)")
            for t in allowed:
                _check_int("allowed_token_ids entry", t, 0, None)
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", _as_tuple("bad_words", self.bad_words, "a list of strings"))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise RequestError(f"bad_words must hold words (non-blank strings), got {list(self.bad_words)!r}")
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(self.bad_words)))  # (repeats dropped, as vLLM's)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise RequestError(f"bad_words has {len(self.bad_words)} entries; at most {MAX_BAD_WORDS} are allowed")
        if any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise RequestError(f"bad_words entries may be at most {MAX_BAD_WORD_CHARS} characters long")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise RequestError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
            if self.ignore_eos or self.min_tokens:  # (the grammar may allow nothing but the EOS they hold back)
                raise RequestError("a structured output cannot be combined with ignore_eos or min_tokens")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise RequestError(f"cache_salt must be a non-empty string if given, got {self.cache_salt!r}")
        if self.structured_after is not None and (self.structured is None or not isinstance(self.structured_after, str)
                                                  or not self.structured_after):
            raise RequestError("structured_after is the text (non-empty) after which `structured` holds the output")

    def _read_vllm_names(self, structured_outputs: StructuredOutput | Mapping | None,
                         guided_decoding: StructuredOutput | Mapping | None, best_of: int | None) -> None:
        """vLLM's structured_outputs (StructuredOutputsParams(...), here a StructuredOutput; or a mapping of its
        fields) and guided_decoding (GuidedDecodingParams, its older name) are `structured`; best_of may only be n."""
        given = {name: value for name, value in (("structured", self.structured),
                                                 ("structured_outputs", structured_outputs),
                                                 ("guided_decoding", guided_decoding)) if value is not None}
        for name, value in given.items():
            if isinstance(value, Mapping):
                try:
                    value = given[name] = structured_outputs_params(**value)
                except TypeError as exc:  # (a key that is none of its fields)
                    raise RequestError(f"{name}: {exc}") from None
            if not isinstance(value, StructuredOutput):
                raise RequestError(f"{name} must be a StructuredOutput (StructuredOutputsParams(...) makes one), got "
                                   f"{type(value).__name__}")
        if len(set(given.values())) > 1:
            raise RequestError(f"give one of {', '.join(given)}: each says what the output must match")
        if given:
            object.__setattr__(self, "structured", next(iter(given.values())))
        if best_of is not None and best_of != self.n:
            raise RequestError(f"best_of={best_of!r} is not taken (vLLM's V1 engine dropped it too): ask n={best_of!r} "
                               f"samples with logprobs=0 and keep the {self.n} with the highest cumulative_logprob")

    def clone(self) -> SamplingParams:
        """vLLM's clone: a copy to change apart (the fields are immutable values: a shallow copy is a deep one)."""
        return copy.copy(self)

    @property
    def greedy(self) -> bool:
        """Temperature 0 (below GREEDY_BELOW, as vLLM's line; a positive one below MIN_TEMPERATURE was raised to it)."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def held_before_min_tokens(params: SamplingParams, eos_ids: tuple[int, ...]) -> set[int]:
    """The ids min_tokens bans from a sample's first tokens: its stop_token_ids and every EOS id, ignore_eos or not
    (vLLM's all_stop_token_ids, which its min_tokens processor bans, hold the EOS ids whatever ignore_eos says)."""
    return set(params.stop_token_ids) | set(eos_ids)


def _checked_assignment(self: SamplingParams, name: str, value: object) -> None:
    """vLLM's SamplingParams may be changed once made (its generate example sets max_tokens on the defaults): a field
    set here is checked with all the others, as a new one would be (a value they refuse leaves the params as they
    were), and read as made (stop="x" is ("x",), top_k -1 is 0). The engine takes its own copy of a request's params,
    so a change reaches only the requests made after it."""
    if name in VLLM_STRUCTURED_NAMES:  # (read as when made, a mapping of its fields too; None takes it away)
        changes = {"structured": None, name: value}
    elif name in _FIELDS:
        changes = {name: value}
    else:
        raise AttributeError(f"SamplingParams has no field {name!r}")
    changed = dataclasses.replace(self, **changes)
    for field_name in _FIELDS:
        object.__setattr__(self, field_name, getattr(changed, field_name))


_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
# (in place of the frozen dataclass's refusal; __init__ and __post_init__ set fields past it. Unhashable as vLLM's
# are: a hash would change with the fields)
SamplingParams.__setattr__ = _checked_assignment
SamplingParams.__hash__ = None


def _structured_alias(name: str) -> property:
    return property(lambda self: self.structured, doc=f"vLLM's {name}: `structured`, what the output must match")


# vLLM's names for `structured`, read back and set as vLLM's fields are (scripts set them on params made earlier)
VLLM_STRUCTURED_NAMES = ("structured_outputs", "guided_decoding")
for _name in VLLM_STRUCTURED_NAMES:
    setattr(SamplingParams, _name, _structured_alias(_name))
    # (no longer a pseudo-field that dataclasses.replace reads back: it would hand the old output back beside a
    # replaced `structured`, and take it again)
    del SamplingParams.__dataclass_fields__[_name]


def max_n() -> int:
    """The most samples a request may ask (MAX_N_VARIABLE, else MAX_N_DEFAULT). Looked up on each call, so that a
    script may set it after the import (the lookup alone: each value is parsed once, by _max_n)."""
    return _max_n(os.environ.get(MAX_N_VARIABLE, ""))


@functools.cache
def _max_n(value: str) -> int:
    """max_n's reading of the variable's value (cached by the value: a bad one raises each time, as nothing is kept)."""
    given = value.strip()
    if not given:
        return MAX_N_DEFAULT
    if not given.isdigit() or int(given) < 1:
        raise ConfigError(f"{MAX_N_VARIABLE} must be a positive integer (the most samples a request may ask), got "
                          f"{given!r}")
    return int(given)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, value) pairs in id order, each checked, zeros left out (they change nothing, and a
    row without bias may take the plain greedy path); one id twice is refused."""
    pairs = value.items() if isinstance(value, Mapping) else _as_tuple("logit_bias", value,
                                                                       "a mapping of token ids to values")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise RequestError(f"logit_bias must map token ids to values, got the entry {pair!r}")
        token, bias = map(_plain, pair)
        _check_int("logit_bias token id", token, 0, None)
        _check_real(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if token in out:
            raise RequestError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(sorted((token, bias) for token, bias in out.items() if bias != 0.0))


# the number fields: given as numpy's (a seed drawn with rng.integers), read as Python's int and float
_NUMBER_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "priority",
                  "truncate_prompt_tokens")


def _plain(value: object) -> object:
    """An integer of another type (numpy's) as int, another real as float; anything else (a bool, a string, None)
    as it is, for the checks to take or name."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _as_tuple(name: str, value: object, what: str) -> tuple:
    """A list, tuple, set or other iterable as a tuple; a lone value (or a mapping) refused, not iterated. A set's
    order is its process's (str hashes are seeded per process): sorted, so that every rank reads the same tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise RequestError(f"{name} must be {what}, got {value!r}")
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(value, key=repr))  # (repr: a mixed set is refused by the checks after, not a TypeError)
    return tuple(value)


def check_stop(stop: Sequence[object], name: str = "stop") -> None:
    """Stop strings as a request's `name` field sent them (the Messages API's stop_sequences is the chat's stop)."""
    if any(not isinstance(s, str) or not s for s in stop):
        raise RequestError(f"{name} must hold non-empty strings, got {list(stop)!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"{name} holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are taken")
    if (longest := max(map(len, stop), default=0)) > MAX_STOP_STRING_CHARS:
        raise RequestError(f"{name} holds a string of {longest} characters; each may be at most "
                           f"{MAX_STOP_STRING_CHARS} characters long")


def _check_int(name: str, value: object, low: int, high: int | None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise RequestError(f"{name} must be {bound}, got {value}" + (f" ({hint})" if hint else ""))


def _check_real(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    # (an int is finite however large: math.isfinite would overflow on 10**400, and comparing it below is exact)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (isinstance(value, int)
                                                                               or math.isfinite(value)):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        left = "(" if low_open else "["
        raise RequestError(f"{name} must be in {left}{low}, {high}], got {value}")
