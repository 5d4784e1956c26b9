"""OpenAI request bodies (pydantic) and their translation into prompts and SamplingParams.

Field names and defaults follow OpenAI's API; vLLM's extras (top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, ...) are accepted too. Unknown fields are ignored, as vLLM does. A field of the wrong type
is a 400 from pydantic; a value out of range is a 400 from SamplingParams. An explicit null means the field's default
(clients such as LangChain send `"n": null`), except where null has its own meaning (a chat's `max_tokens`: no limit
of its own; a completion's null `max_tokens` is its default, 16, as vLLM's normalize_null_max_tokens reads it).
"""

from __future__ import annotations

import functools
import math
import reprlib
import types
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from tpgraph.chat import ChatTemplate, developer_tools, set_history_calls, template_content
from tpgraph.engine.beam_search import BeamSearchParams
from tpgraph.engine.limits import kept_prompt_tokens
from tpgraph.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, _check_int, max_n
from tpgraph.engine.structured import STRUCTURED_OPTIONS, StructuredOutput, check_backend, with_structured_options
from tpgraph.errors import CheckpointError, RequestError
from tpgraph.server.tools import FORCED_CHOICES, ToolOptions, ToolPlan

# the roles OpenAI's API names; any other is a custom role (Llama 3.1's "ipython", say), handed to the template as it
# is, as vLLM's CustomChatCompletionMessageParam takes it
ROLES = ("system", "developer", "user", "assistant", "tool")


class NullMeansDefault(BaseModel):
    """A null given for an optional field that cannot hold None is taken as the field left out."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or _takes_none(fields[k].annotation)}


def invalid(exc: ValidationError) -> RequestError:
    """A body's validation errors as one refusal that names each field (where the route validates it itself)."""
    return RequestError("; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()))


def _takes_none(annotation: Any) -> bool:
    return annotation is None or (get_origin(annotation) in (Union, types.UnionType)
                                  and type(None) in get_args(annotation))


def _ids_are_integers(cls: type, value: Any) -> Any:
    """Token ids, or lists of them, as integers only: pydantic would take true/false and 1.0 as the ids 1, 0 and 1."""
    if isinstance(value, list):
        items = [t for x in value for t in (x if isinstance(x, list) else [x])]
        if any(isinstance(t, (bool, float)) for t in items):
            raise ValueError("token ids must be integers (not true/false or floats)")
    return value


def _not_a_bool(cls: type, value: Any) -> Any:
    """A number as a number only: pydantic would take true and false as 1 and 0 (a completion's `"logprobs": true`,
    the chat API's form, asked for one alternative without a word)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not true or false (got {value!r})")
    return value


def _an_integer(cls: type, value: Any) -> Any:
    """An integer field as an integer only: pydantic would take true, 2.0 and "3" as 1, 2 and 3."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"must be an integer, got {value!r}")
    return value


class StreamOptions(NullMeansDefault):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: with include_usage, every chunk carries the usage so far)
    # whether the object named any key (a null or one not known here too): vLLM's test of whether it asks for
    # something, which needs a stream
    _named_keys: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _note_keys(cls, data: Any, handler: Any) -> StreamOptions:
        options = handler(data)
        options._named_keys = bool(data) if isinstance(data, dict) else bool(options.model_fields_set)
        return options

    def asks(self) -> bool:
        """Whether the object asks for something (vLLM's: it is not empty)."""
        return self._named_keys


# the fields a beam search leaves unused, each with the values that ask nothing of it (null too): vLLM's beam search
# takes n, max_tokens, temperature, length_penalty, ignore_eos and include_stop_str_in_output alone, and ignores these;
# here they are refused, as the server refuses what it would not honour (top_k -1 turns it off as 0 does: vLLM's
# other neutral value, which SamplingParams takes too). Served otherwise: not UNSERVED's.
BEAM_SEARCH_UNUSED: dict[str, tuple] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "stop": ("", []), "stop_token_ids": ([],), "min_tokens": (0,), "logit_bias": ({},),
    "allowed_token_ids": (), "bad_words": ([],), "prompt_logprobs": (), "spaces_between_special_tokens": (True,)}


class Unserved(NamedTuple):
    neutral: tuple  # the values that ask nothing of the field (null too)
    hint: str  # what to do instead


# vLLM's request fields this server does not honour, sampled or searched: each with the values that ask nothing of it
# (null too), and what serves instead. Refused where they ask something, as a reply run without them would not say so
# (logprob_token_ids' entries missing, a thinking budget or repetition check not kept, a grammar not held)
UNSERVED: dict[str, Unserved] = {
    "logprob_token_ids": Unserved(([],), "leave it out; top_logprobs gives the likeliest tokens' instead"),
    "thinking_token_budget": Unserved((-1,), "leave it out (or -1, unlimited); max_tokens bounds the whole reply"),
    "repetition_detection": Unserved((), "leave it out; repetition_penalty, presence_penalty and frequency_penalty "
                                         "discourage repeats"),
    "prompt_embeds": Unserved((), "give the prompt as text or token ids"),  # (a completion's: its prompt as embeddings)
    # (vLLM's, beside the guided_* fields, as structured_outputs' structural_tag and whitespace_pattern, refused too)
    "structural_tag": Unserved((), "give one of response_format (json), guided_json, guided_regex, guided_choice, "
                                   "guided_grammar and structured_outputs"),
    "guided_whitespace_pattern": Unserved((), "structured outputs here are xgrammar's, which cannot hold JSON's "
                                              "whitespace to a pattern; leave it out (JSON is written without free "
                                              "whitespace), or give structured_outputs "
                                              "{\"disable_any_whitespace\": false} for whitespace free between tokens")}


def first_asking(fields: Any, neutrals: Iterable[tuple[str, tuple]]) -> str | None:
    """The first field named in neutrals (its name, and the values that ask nothing of it) that fields (a request)
    sets to something else than those and null: the one check of UNSERVED and BEAM_SEARCH_UNUSED."""
    for name, neutral in neutrals:
        value = getattr(fields, name, None)
        if value is not None and value not in neutral:
            return name
    return None


# vLLM's sampling fields that the Responses and Messages APIs take beside their own, handed to the chat request they
# run as (checked there), with UNSERVED's (refused there): forwarded_extras
SAMPLING_EXTRAS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                   "spaces_between_special_tokens", "logit_bias", "structured_outputs", "bad_words",
                   "allowed_token_ids", "priority", "request_id", "return_tokens_as_token_ids", "cache_salt")


def forwarded_extras(extras: dict[str, Any]) -> dict[str, Any]:
    """What a Responses or Messages request hands, beside its own fields, to the chat request it runs as: vLLM's
    sampling fields (SAMPLING_EXTRAS), and the chat's fields not served (UNSERVED), which the chat's check refuses by
    name (left behind, they were dropped unsaid)."""
    names = (*SAMPLING_EXTRAS, *(name for name in UNSERVED if name in ChatRequest.model_fields))
    return {name: extras[name] for name in names if name in extras}


class SamplingFields(NullMeansDefault):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # (as vLLM's: left out, the model served)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # (vLLM's server takes a signed 64-bit seed alone, as its request models bound it; offline SamplingParams takes an
    # unsigned one too, as vLLM's LLM does)
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # (vLLM's: False, none between special tokens kept in the text)
    # vLLM's: log-probability entries name tokens as "token_id:N"; null or left out: the server's setting
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: each choice's token ids (a stream's, each chunk's new ones) and the prompt's, beside the text
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None  # (values checked by SamplingParams: pydantic would take true as 1.0)
    user: str | None = None
    request_id: str | None = None  # (vLLM's: names the reply, cmpl-<it>, where no X-Request-Id header does)
    # structured outputs: OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None  # (vLLM's newer form: {"json" | "regex" | "choice" | "grammar": ...})
    # (vLLM's, beside the guided_* fields: the grammar's backend, read as structured_outputs' backend; sampling_params)
    guided_decoding_backend: str | None = None
    # (vLLM's too, beside them: refused (UNSERVED), as structured_outputs' whitespace_pattern and structural_tag are;
    # left out of the model, they were dropped unsaid and the reply ran unconstrained)
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    # (vLLM's: keep the prompt's last k tokens, at most what max_tokens leaves of max_model_len; -1: all that,
    # limits.kept_prompt_tokens)
    truncate_prompt_tokens: int | None = None
    # (vLLM's: which end truncate_prompt_tokens cuts; left, the default, keeps the last tokens, right the first)
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: str | None = None  # (vLLM's: the prefix cache shares this request's blocks only with its salt's)
    prompt_logprobs: int | None = None  # (vLLM's: each prompt token's log-probability, rank and top k, unstreamed)
    allowed_token_ids: list[int] | None = None  # (vLLM's: the only ids the output may hold)
    bad_words: list[str] | None = None  # (vLLM's: words the output may not complete)
    priority: int = 0  # (vLLM's: lower first, where the server schedules by priority)
    # vLLM's beam search (beam_search_params): n beams ranked by length_penalty (taken and unused without it, as vLLM's)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # (vLLM's, not served: see UNSERVED)
    logprob_token_ids: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None

    _stop_ids_are_integers = field_validator("stop_token_ids", "allowed_token_ids", mode="before")(_ids_are_integers)
    _counts_are_integers = field_validator("truncate_prompt_tokens", "prompt_logprobs", "priority",
                                           mode="before")(_an_integer)
    _numbers_are_no_bools = field_validator("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty", "seed", "min_tokens",
                                            "length_penalty", mode="before")(_not_a_bool)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, float] | None = None, prompt_logprobs: int | None = None,
                        tools: ToolPlan | None = None) -> SamplingParams:
        """defaults: the checkpoint's generation_config values, used where the request leaves a field unset. tools:
        a chat request's function calling, which may hold the reply to a schema and keep special tokens."""
        if self.use_beam_search:  # (the server's handlers ask beam_search_params instead)
            raise RequestError("a beam search's request takes beam_search_params, not sampling_params")
        self.check_served()
        # (as vLLM's: an empty object asks for nothing, and is taken)
        if self.stream_options is not None and self.stream_options.asks() and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true")
        own = self.prompt_logprobs
        if own is not None and not 0 <= own <= MAX_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS} (-1, the whole vocabulary, "
                               f"is not served), got {own}")
        if own is not None and self.stream:  # (as vLLM: they come with the whole reply; 0 asks for no alternatives)
            if own > 0:
                raise RequestError("prompt_logprobs are not available with stream: true")
            own = None  # (nothing of them is streamed: not computed)
        if own is not None:  # (the engine's field, and the echo's, are one)
            prompt_logprobs = max(prompt_logprobs or 0, own)
        structured = self.structured_output()
        skip_special_tokens = self.skip_special_tokens
        if tools is not None and tools.structured is not None:
            if structured is not None:
                raise RequestError(f"tool_choice {tools.mode!r} holds the reply to the tools' schema: it cannot also "
                                   "take response_format or a guided_* field")
            structured = tools.structured
        if structured is not None:
            # (vLLM's engine refuses a request's backend other than its own; without a grammar it asks nothing)
            check_backend(self.guided_decoding_backend)
        if tools is not None and tools.parser is not None and tools.parser.keeps_special_tokens:
            skip_special_tokens = False  # (the parser's markers are special tokens)
        d = defaults or {}

        def pick(name: str, fallback: float) -> float:
            value = getattr(self, name)
            return value if value is not None else d.get(name, fallback)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=int(pick("top_k", 0)),
            min_p=pick("min_p", 0.0), presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=() if self.stop is None else self.stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, logit_bias=self.token_bias(),
            prompt_logprobs=prompt_logprobs, structured=structured,
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()), priority=self.priority, cache_salt=self.cache_salt)

    def beam_search_params(self, max_tokens: int, logprobs: int | None, defaults: dict[str, float] | None = None,
                           tools: ToolPlan | None = None, logprobs_name: str = "logprobs") -> BeamSearchParams:
        """use_beam_search's search, as vLLM's to_beam_search_params reads the request: n beams (the beam width), each
        of at most max_tokens, at the request's temperature (else generation_config's, else 1.0), ranked by
        length_penalty, with ignore_eos and include_stop_str_in_output. Each step's candidates are a beam's 2 * n
        most likely tokens, so a reply's tokens have at most that many alternatives (logprobs, named logprobs_name).
        What a search would leave unused, which vLLM's takes and ignores, is refused (see BEAM_SEARCH_UNUSED);
        seed, priority and cache_salt reach each step's requests."""
        self.check_served()
        unused = first_asking(self, BEAM_SEARCH_UNUSED.items())
        if unused is not None:
            raise RequestError(f"{unused} is not used by a beam search, which takes n, max_tokens, temperature, "
                               f"length_penalty, ignore_eos and include_stop_str_in_output: leave it out with "
                               f"use_beam_search")
        if self.structured_output() is not None or (tools is not None and tools.structured is not None):
            raise RequestError("structured outputs (response_format, guided_*, structured_outputs, or a named or "
                               "required tool_choice) are not supported with use_beam_search: a beam search keeps "
                               "the likeliest sequences, which no grammar holds")
        if self.stream_options is not None and self.stream_options.asks() and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true")
        _check_int("n", self.n, 1, max_n(), "the beam width, with use_beam_search")
        if logprobs is not None and logprobs > 2 * self.n:
            raise RequestError(f"{logprobs_name} {logprobs} is more than use_beam_search returns: each token's "
                               f"alternatives are its step's candidates, 2 * n = {2 * self.n}")
        temperature = self.temperature if self.temperature is not None else (defaults or {}).get("temperature", 1.0)
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=temperature, length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)

    def check_served(self) -> None:
        """A RequestError naming the first of vLLM's fields this server does not honour (UNSERVED) that asks
        something, with what serves instead."""
        name = first_asking(self, ((name, u.neutral) for name, u in UNSERVED.items()))
        if name is not None:
            raise RequestError(f"{name} is not supported by this server (vLLM's field): {UNSERVED[name].hint}")

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether log-probability entries name tokens "token_id:N": the request's choice, else the server's
        (--return-tokens-as-token-ids)."""
        asked = self.return_tokens_as_token_ids
        return server_default if asked is None else asked

    def structured_output(self) -> StructuredOutput | None:
        """What response_format or a guided_* field asks the output to match (at most one of them), with
        structured_outputs' options (disable_any_whitespace, backend, ...) read as the offline API reads them."""
        asked = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None  # (type is required, as vLLM's and OpenAI's)
            if kind == "json_object":
                asked.append(StructuredOutput("json_object"))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise RequestError("response_format json_schema needs json_schema.schema, a JSON schema object")
                if not isinstance(spec.get("name"), str):  # (required, as OpenAI's and vLLM's)
                    raise RequestError("response_format json_schema needs json_schema.name, a string")
                asked.append(StructuredOutput.json_schema(schema))
            elif kind != "text":
                raise RequestError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
        if self.guided_json is not None:
            asked.append(StructuredOutput.json_schema(self.guided_json))
        if self.guided_regex is not None:
            asked.append(StructuredOutput("regex", self.guided_regex))
        if self.guided_choice is not None:
            asked.append(StructuredOutput.choice(self.guided_choice))
        if self.guided_grammar is not None:
            asked.append(StructuredOutput("grammar", self.guided_grammar))
        for key, value in (self.structured_outputs or {}).items():
            if value is None or value is False or key in STRUCTURED_OPTIONS:  # (not asked; options, read below)
                continue
            if key == "json":
                asked.append(StructuredOutput.json_schema(value))
            elif key == "json_object" and value:
                asked.append(StructuredOutput("json_object"))
            elif key in ("regex", "grammar") and isinstance(value, str):
                asked.append(StructuredOutput(key, value))
            elif key == "choice" and isinstance(value, list):
                asked.append(StructuredOutput.choice(value))
            else:
                raise RequestError(f"structured_outputs.{key} is not one of json (a schema), json_object, regex, "
                                   "choice (a list of strings) and grammar")
        if len(asked) > 1:
            raise RequestError("give one of response_format (json), guided_json, guided_regex, guided_choice, "
                               "guided_grammar and structured_outputs")
        options = {k: v for k, v in (self.structured_outputs or {}).items() if k in STRUCTURED_OPTIONS}
        return with_structured_options(asked[0] if asked else None, **options)

    def shown_prompt_logprobs(self, echo_count: int | None) -> int | None:
        """The alternatives a whole reply's prompt_logprobs field shows for each prompt token: the request's own
        prompt_logprobs, else an echo's count (vLLM's: its echo runs with prompt logprobs), None for no field."""
        return self.prompt_logprobs if self.prompt_logprobs is not None else echo_count

    def truncation(self, max_model_len: int, max_tokens: int | None) -> int | None:
        """How many of the prompt's last tokens to keep (limits.kept_prompt_tokens)."""
        return kept_prompt_tokens(self.truncate_prompt_tokens, max_model_len, max_tokens)

    def truncated(self, ids: list[int], keep: int) -> list[int]:
        """ids cut to `keep` tokens (truncation's count): the last, or with truncation_side "right" the first."""
        return ids[:keep] if self.truncation_side == "right" else ids[-keep:]

    def token_bias(self) -> list[tuple[int, Any]]:
        """logit_bias as (token id, value) pairs: its keys are strings (JSON object keys), and two that name one id
        ("7" and "07") are refused by SamplingParams, not merged. Numbers past +-100 are clamped to it, as vLLM's
        server clamps them (SamplingParams checks the rest: NaN, true, a string)."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            try:  # (int() refuses more than 4300 digits: a ValueError, which reached the client as a 500)
                token = int(key) if key.isascii() and key.strip().isdigit() else None
            except ValueError:
                token = None
            if token is None:
                raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got "
                                   f"{reprlib.repr(key)}")
            # (an int is no NaN, and may be past a float's range: isnan overflowed on 1e400 written as an integer)
            if type(value) is int or type(value) is float and not math.isnan(value):
                value = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
            pairs.append((token, value))
        return pairs


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16  # (null: this default, as vLLM's; OpenAI's SDK sends null for a value left unset)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # (vLLM's: false, a text prompt gets no BOS from the tokenizer)
    best_of: int | None = None
    prompt_embeds: Any = None  # (vLLM's, not served: see UNSERVED)

    _prompt_ids_are_integers = field_validator("prompt", mode="before")(_ids_are_integers)
    _counts_are_no_bools = field_validator("max_tokens", "logprobs", "best_of", mode="before")(_not_a_bool)

    def beam_search_params(self, max_tokens: int, logprobs: int | None, defaults: dict[str, float] | None = None,
                           tools: ToolPlan | None = None, logprobs_name: str = "logprobs") -> BeamSearchParams:
        """SamplingFields.beam_search_params, with what a completion's search cannot give refused: an echo's
        log-probabilities (a search computes none of the prompt's). (A stream is taken: the server sends the whole
        reply as its one event, as vLLM's, the beams being ranked only once the search ends.)"""
        if self.echo and logprobs is not None:
            raise RequestError("echo with logprobs is not supported with use_beam_search (a beam search computes no "
                               "log-probabilities of the prompt's tokens)")
        return super().beam_search_params(max_tokens, logprobs, defaults, tools, logprobs_name)

    def prompts(self) -> list[str | list[int]]:
        if self.suffix:
            raise RequestError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported")
        p = self.prompt
        if isinstance(p, str):
            p = [p]
        # (an empty text is left to the tokenizer, as vLLM leaves it: "" is the BOS alone where the tokenizer adds
        # one, a prompt to generate from; encoded_prompts refuses one that comes to no tokens)
        if not p or any(len(x) == 0 for x in p if isinstance(x, list)):
            raise RequestError("the prompt is empty")
        if isinstance(p[0], str):
            return list(p)
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


# vLLM's reasoning_effort values (OpenAI's, and DeepSeek's "max")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatMessage(NullMeansDefault):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict | str] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (vLLM's; refused, as vLLM refuses it, unless trusted: request_template)
    documents: list[dict[str, str]] | None = None  # (vLLM's: a RAG template's sources, given to it as `documents`)
    tools: list[Any] | None = None  # (each checked by tools.check_tools, with a message that names it)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # (the API's deprecated form of tools)
    include_reasoning: bool = True  # (vLLM's: false leaves a reasoning model's thoughts out of the reply)
    reasoning_effort: str | None = None  # (given to the chat template: template_kwargs)
    echo: bool = False  # (vLLM's: a reply in the last message's role begins with that message's text)
    add_special_tokens: bool = False  # (vLLM's: true adds the tokenizer's special tokens to the template's)
    # (no field: set by the Messages API, whose prefill, a final assistant message with text, is answer the reply
    # goes on with, past any thoughts; a chat's continued message is read as vLLM reads it, ReasoningParser.closed_in)
    _continues_answer: bool = PrivateAttr(default=False)
    # (no field: the words of the request's own API for the tool choices that force a call, where a refusal names
    # them; the Messages API's differ from the chat's)
    _forced_choices: str = PrivateAttr(default=FORCED_CHOICES)

    _counts_are_no_bools = field_validator("max_tokens", "max_completion_tokens", "top_logprobs",
                                           mode="before")(_not_a_bool)

    def checked_messages(self, content_format: str = "string", trusted: bool = False) -> list[dict[str, Any]]:
        """The messages as the chat template takes them, their content in content_format ("string" or "openai"); what
        this server cannot honour is refused, not ignored. trusted: the server takes a request's own chat template
        (request_template)."""
        if self.functions:
            raise RequestError("functions (the API's deprecated form of tools) is not supported; send tools")
        no_request_template(self.chat_template, self.chat_template_kwargs, trusted)
        return template_messages(self.messages, content_format)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The request's chat template variables: its chat_template_kwargs, and reasoning_effort as vLLM's
        build_chat_params gives it to the template: as `reasoning_effort` (over the kwargs' own), and as
        enable_thinking (false for "none"; unless the kwargs set it), which templates that think on request read."""
        effort = self.reasoning_effort
        if effort is None:
            return self.chat_template_kwargs
        if effort not in REASONING_EFFORTS:  # (a typo would reach the template as an effort it does not know)
            raise RequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}")
        return {"enable_thinking": effort != "none", **(self.chat_template_kwargs or {}), "reasoning_effort": effort}

    def tool_plan(self, options: ToolOptions) -> ToolPlan:
        """What tools and tool_choice ask for (tools.py), under the server's settings."""
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, options, self._forced_choices)

    def logprobs_count(self) -> int | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:  # (checked here: the sampling params name logprobs)
            raise RequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}")
        if top and not self.logprobs:  # (0 asks for no alternatives: taken without logprobs, as vLLM's check)
            raise RequestError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


def no_request_template(template: str | None, variables: dict[str, Any] | None, trusted: bool = False) -> None:
    """A chat template sent with a request is refused, as vLLM refuses it, unless the server was started with
    --trust-request-chat-template (taken and ignored, the server's own template rendered the prompt unsaid);
    chat_template_kwargs' chat_template is refused whatever the flag, as vLLM refuses that variable."""
    if (variables or {}).get("chat_template") is not None:
        raise RequestError("a chat template sent with the request as chat_template_kwargs.chat_template is not "
                           "taken: " + ("send it as the request's chat_template" if trusted else
                                        "the server renders chats with its own (--chat-template)"))
    if template is not None and not trusted:
        raise RequestError("a chat template sent with the request (chat_template) is not taken: the server renders "
                           "chats with its own (--chat-template), unless started with --trust-request-chat-template")


def request_template(template: str | None, variables: dict[str, Any] | None, trusted: bool,
                     special_tokens: dict[str, str]) -> ChatTemplate | None:
    """The request's own chat template (vLLM's chat_template field: the template's text), where the server trusts
    requests' templates (--trust-request-chat-template), rendered with the checkpoint's special tokens in the
    sandbox as the server's own is; None where the request sends none (or ""). Refused as no_request_template refuses
    it."""
    no_request_template(template, variables, trusted)
    if not template:  # ("" too: vLLM's `request.chat_template or` the server's)
        return None
    try:
        return _compiled_template(template, tuple(sorted(special_tokens.items())))
    except CheckpointError as exc:  # (the request's template, not the checkpoint's: a 400)
        raise RequestError(f"chat_template: {exc}") from None


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str, special_tokens: tuple[tuple[str, str], ...]) -> ChatTemplate:
    """A request's chat template compiled once (tens of milliseconds, on the event loop), not per request: clients
    send the same one with every request, as transformers' compile cache takes it under vLLM."""
    return ChatTemplate(template, dict(special_tokens))


def template_messages(messages: list[ChatMessage], content_format: str = "string") -> list[dict[str, Any]]:
    """Chat messages as a chat template takes them: role (any, as vLLM takes custom roles; the template refuses
    those it does not know) and text (content_format: a string, or
    vLLM's "openai" list of text parts), a name (any role's, as vLLM gives it), an assistant's earlier tool_calls
    (arguments as objects) and reasoning (vLLM's interleaved thinking: `reasoning` or `reasoning_content`, given as
    both), a tool message's tool_call_id, and a developer message's tools (no role is renamed: "developer" reaches the
    template as it is, as vLLM's does)."""
    out = []
    for i, m in enumerate(messages):
        if not m.role:  # (a template renders it as nothing: a turn with no header)
            raise RequestError(f"messages[{i}].role is empty: give one of {', '.join(ROLES)} or the template's own")
        msg: dict[str, Any] = {"role": m.role, "content": template_content(m.content, f"messages[{i}]", content_format,
                                                                           m.role)}
        extra = m.model_extra or {}
        calls = extra.get("tool_calls")
        if m.role == "assistant" and calls is not None and not isinstance(calls, list):
            raise RequestError(f"messages[{i}].tool_calls must be a list")
        if m.role == "assistant" and calls is not None:
            set_history_calls(msg, calls, i)
        # (the first that is text: a null reasoning beside reasoning_content is none given)
        reasoning = next((extra[k] for k in ("reasoning", "reasoning_content") if isinstance(extra.get(k), str)), None)
        if m.role == "assistant" and isinstance(reasoning, str):
            msg.update(reasoning=reasoning, reasoning_content=reasoning)
        if m.role == "tool" and isinstance(extra.get("tool_call_id"), str):
            msg["tool_call_id"] = extra["tool_call_id"]
        if isinstance(extra.get("name"), str):
            msg["name"] = extra["name"]
        if m.role == "developer":  # (its own tools, None where it has none, as vLLM's parser gives them)
            msg["tools"] = developer_tools(extra.get("tools"), f"messages[{i}]")
        out.append(msg)
    return out


class TokenizeRequest(NullMeansDefault):
    """vLLM's /tokenize body: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (refused, as a chat request's)
    tools: list[Any] | None = None  # (rendered as a chat request's are, so the counts agree)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(NullMeansDefault):
    model: str | None = None
    tokens: list[int]

    _tokens_are_integers = field_validator("tokens", mode="before")(_ids_are_integers)
