"""Structured outputs: a request's tokens held to a JSON schema, any JSON object, a regular expression, a choice of
strings or a grammar, EBNF or Lark's (OpenAI's response_format, vLLM's guided_* fields), through xgrammar.

Each step, a constrained row's logits lose every token its grammar cannot take next (xgrammar fills the row's bitmask
from the sequence's matcher and applies it), and the token read back advances the matcher. A grammar may be held off
until the output has some text (SamplingParams.structured_after: a reasoning model's end of thoughts, after which
the answer is held to it). The matcher must have seen a row's last token before its next mask is made, so a step
with a constrained row reads the step in flight between its own forwards and its draw: the grammar's work runs
while the forwards do, and steps stay overlapped (engine/core.py). Every rank keeps its own matchers and reaches the
same states, since it samples the same tokens.

Compiling a grammar for a vocabulary takes a while the first time: the server compiles a request's on a thread of
its bridge before queueing it (EngineService.precompile; the pipe's other requests pass it meanwhile, and a few
grammars compile at once, COMPILE_THREADS), and keeps the last 64. At TP > 1 rank 0 tells the other ranks of the
grammar first, and they compile it on threads of their own while it does (compile_soon), so that none stalls a step
on it when the request arrives. Every rank compiles the grammars of the requests it adds, in whatever order the
compiles end: a request joins the steps on every rank alike, once its add comes in a step's message.

JSON has no free whitespace by default (xgrammar writes ", " and ": " between items): a model that may emit
whitespace anywhere can spend its whole budget on it, which is why vLLM offers to turn it off too. A request that
asks for it (vLLM's disable_any_whitespace=False, StructuredOutput.any_whitespace) gets JSON as vLLM's xgrammar
backend compiles it, whitespace free between tokens. vLLM's per-request options are read in one place for the
server and the offline API alike (with_structured_options). Strings with minLength or
maxLength are mended where xgrammar writes them wrong (json_schema_grammar); a schema with a keyword xgrammar
would compile without (uniqueItems, not, if, ...: unenforced_keyword) is refused, naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import reprlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from tpgraph.errors import RequestError

logger = logging.getLogger(__name__)
# how many grammars compile at once (the server bridge's compile threads, a follower rank's compile_soon): vLLM's
# pool, half the cores and at most 8, so that one large grammar holds up no other request's
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_KINDS = ("json_schema", "json_object")  # (the kinds whose whitespace any_whitespace frees)
# the deepest a JSON schema's text may nest (objects and arrays, the schema itself level 1): xgrammar's time to convert
# and compile one grows with about the cube of its depth (some 500 levels took 20 s, 1000 minutes, on the thread that
# compiles every request's grammar, so that each constrained request after it waited); OpenAI's structured outputs
# take 10 levels of objects, some 20 of this count
MAX_SCHEMA_DEPTH = 64
# the most strings a choice, or a JSON schema's enum, may offer: xgrammar's compile time grows faster than their
# square (10,000 took 0.15 s, 100,000 48 s)
MAX_CHOICES = 10_000
# the most schemas one anyOf or oneOf of a JSON schema may offer: each is a branch of the grammar, whose compile time
# grows faster than their square (500 objects took 0.3 s, 1000 5 s, 3000 32 s)
MAX_SCHEMA_BRANCHES = 500
BACKENDS = ("xgrammar", "auto")  # (vLLM's backend names that mean what runs here)
INSTALL_HINT = "structured outputs need xgrammar: pip install 'tpgraph[structured]'"
_XGRAMMAR_SOURCE = re.compile(r"\[[0-9:]+\] \S+:\d+: ")  # "[01:01:03] /project/cpp/x.cc:94: " before its messages
_COMMENT = re.compile(r"(#|//).*$")  # (EBNF's and Lark's)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. `spec`: the JSON schema (as JSON text), the regular expression, the
    grammar (EBNF; or Lark's syntax, read as vLLM reads it: one where no rule is written with EBNF's ::=), or for
    `choice` a JSON list of the strings allowed; empty for `json_object`. `any_whitespace`: JSON with free
    whitespace between tokens (vLLM's disable_any_whitespace=False); off, none but ", " and ": "."""

    kind: str
    spec: str = ""
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise RequestError(f"a structured output's spec is text, got {type(self.spec).__name__}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except (json.JSONDecodeError, RecursionError) as exc:  # (RecursionError: nesting past the stack)
                raise RequestError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise RequestError(f"a JSON schema is an object, got {type(schema).__name__}")
            if _deeper_than(schema, MAX_SCHEMA_DEPTH):
                raise RequestError(f"the JSON schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels "
                                   f"deep: at most {MAX_SCHEMA_DEPTH} are taken (a grammar's compile time grows with "
                                   f"its depth)")
            if (longest := _longest_list(schema, ("enum",))) > MAX_CHOICES:
                raise RequestError(f"the JSON schema has an enum of {longest} values; at most {MAX_CHOICES} are taken "
                                   f"(a grammar's compile time grows faster than their square)")
            if (widest := _longest_list(schema, ("anyOf", "oneOf"))) > MAX_SCHEMA_BRANCHES:
                raise RequestError(f"the JSON schema has an anyOf or oneOf of {widest} schemas; at most "
                                   f"{MAX_SCHEMA_BRANCHES} are taken (a grammar's compile time grows faster than their "
                                   f"square)")
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except (json.JSONDecodeError, RecursionError):
                choices = None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise RequestError("a choice is a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES:
                raise RequestError(f"the choice offers {len(choices)} strings; at most {MAX_CHOICES} are taken (a "
                                   f"grammar's compile time grows faster than their square)")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise RequestError(f"the {self.kind} is empty")
        if not isinstance(self.any_whitespace, bool):
            raise RequestError(f"any_whitespace is True or False, got {self.any_whitespace!r}")
        if self.any_whitespace and self.kind not in JSON_KINDS:
            raise RequestError(f"any_whitespace holds JSON only (json_schema, json_object), not a {self.kind}")

    @staticmethod
    def choice(options: list[str]) -> StructuredOutput:
        # (a set's order is its process's, str hashes being seeded per process: sorted, so that every rank under
        # torchrun makes the same spec; repr, so that a mixed set is refused by the check, not a TypeError)
        # (a lone string or a mapping is refused, not iterated: choice="yes" was the choice of "y", "e" and "s")
        if isinstance(options, (str, bytes, Mapping)) or not isinstance(options, Iterable):
            raise RequestError(f"a choice is a list of strings, got {reprlib.repr(options)}")
        listed = sorted(options, key=repr) if isinstance(options, (set, frozenset)) else list(options)
        return StructuredOutput("choice", json.dumps(listed))

    @staticmethod
    def json_schema(schema: dict | str) -> StructuredOutput:
        return StructuredOutput("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def _deeper_than(value: Any, most: int) -> bool:
    """Whether a decoded JSON value nests objects and arrays more than `most` levels deep (itself level 1)."""
    level = [value]
    for _ in range(most):
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def _longest_list(schema: dict, keys: tuple[str, ...]) -> int:
    """The most items any list under one of `keys` holds in a decoded JSON schema (0 where it has none)."""
    longest, stack = 0, [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            longest = max(longest, *(len(item[k]) for k in keys if isinstance(item.get(k), list)), 0)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return longest


def structured_outputs_params(json: dict | str | Any = None, regex: str | None = None, choice: list[str] | None = None,
                              grammar: str | None = None, json_object: bool | None = None, *,
                              disable_fallback: bool | None = None, disable_any_whitespace: bool | None = None,
                              disable_additional_properties: bool | None = None, whitespace_pattern: str | None = None,
                              structural_tag: str | None = None, backend: str | None = None) -> StructuredOutput:
    """vLLM's StructuredOutputsParams (and GuidedDecodingParams before it), made as the StructuredOutput it asks for:
    one of `json` (a JSON schema: a dict, its text, or a pydantic model class), `regex`, `choice`, `grammar` (EBNF or
    Lark's, StructuredOutput says how they are told apart) and `json_object=True`. Its options are read as the server
    reads them (with_structured_options); structural_tag is refused."""
    if hasattr(json, "model_json_schema"):  # (a pydantic model class, as vLLM's examples define one)
        json = json.model_json_schema()
    asked = [kind for kind, value in (("json", json), ("regex", regex), ("choice", choice), ("grammar", grammar),
                                      ("json_object", json_object or None)) if value is not None]
    if len(asked) != 1:
        raise RequestError(f"give one of json, regex, choice, grammar and json_object=True, got "
                           f"{', '.join(asked) or 'none'}")
    if structural_tag is not None:
        raise RequestError("structural_tag is not taken: give one of json, regex, choice, grammar and json_object")
    if json is not None:
        asked = StructuredOutput.json_schema(json)
    elif choice is not None:
        asked = StructuredOutput.choice(choice)
    elif json_object:
        asked = StructuredOutput("json_object")
    else:
        asked = StructuredOutput("regex", regex) if regex is not None else StructuredOutput("grammar", grammar)
    return with_structured_options(asked, disable_fallback=disable_fallback,
                                   disable_any_whitespace=disable_any_whitespace,
                                   disable_additional_properties=disable_additional_properties,
                                   whitespace_pattern=whitespace_pattern, backend=backend)


# vLLM's per-request options (StructuredOutputsParams' fields beside what to match, the server's structured_outputs
# keys): with_structured_options reads each
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "backend")


def with_structured_options(asked: StructuredOutput | None, *, disable_fallback: Any = None,
                            disable_any_whitespace: Any = None, disable_additional_properties: Any = None,
                            whitespace_pattern: Any = None, backend: Any = None) -> StructuredOutput | None:
    """What a request asks to match (None: nothing) with vLLM's per-request options applied, for the server and
    the offline API alike; an option that cannot be honoured here is refused by name, whether or not a kind is asked.
    - disable_any_whitespace: None or True, JSON without free whitespace (the default); False, JSON with whitespace
      free between tokens as vLLM's xgrammar backend compiles it (nothing to change on a regex, choice or grammar).
    - disable_fallback: taken (there is no other backend to fall back to).
    - backend: None, "xgrammar" or "auto"; any other is refused.
    - whitespace_pattern and disable_additional_properties=True: refused (xgrammar has no such options)."""
    for name, value in (("disable_fallback", disable_fallback), ("disable_any_whitespace", disable_any_whitespace),
                        ("disable_additional_properties", disable_additional_properties)):
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"{name} is true or false, got {reprlib.repr(value)}")
    if whitespace_pattern is not None:
        raise RequestError("whitespace_pattern is not taken: structured outputs here are xgrammar's, which cannot "
                           "hold JSON's whitespace to a pattern; leave it out (JSON is written without free "
                           "whitespace), or give disable_any_whitespace=False for whitespace free between tokens")
    if disable_additional_properties:
        raise RequestError("disable_additional_properties=True is not taken (vLLM's option for its guidance "
                           "backend): structured outputs here are xgrammar's, which holds an object to the "
                           "properties its schema lists unless its additionalProperties allows more; leave it out")
    check_backend(backend)
    if asked is None or disable_any_whitespace is not False or asked.kind not in JSON_KINDS:
        return asked
    return dataclasses.replace(asked, any_whitespace=True)


def check_backend(backend: Any) -> None:
    """vLLM's per-request structured-output backend: None, "xgrammar" or "auto" (what runs here), else a RequestError.
    A check alone: xgrammar runs whichever is taken, so a StructuredOutput holds no backend."""
    if backend is not None and backend not in BACKENDS:
        raise RequestError(f"backend={reprlib.repr(backend)} is not taken: structured outputs here are xgrammar's; "
                           f"leave backend out or give 'xgrammar' or 'auto'")


# vLLM's names, as its scripts import them (vllm.sampling_params; SamplingParams(structured_outputs=...) takes them)
StructuredOutputsParams = GuidedDecodingParams = structured_outputs_params


class GrammarCompiler:
    """xgrammar's compiler for one engine's tokenizer and vocabulary, made on first use (a server that never sees
    a constrained request never imports xgrammar); the last CACHED compiled grammars are kept by their spec (each
    holds tables the size of the vocabulary)."""

    CACHED = 64

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        # a thread of the server's bridge compiles a request's grammar ahead (EngineService.precompile), the engine
        # thread reads it back: the cache is shared, and a compile runs outside the lock
        self._lock = threading.Lock()
        self._compiling: dict[StructuredOutput, Future] = {}  # specs a thread is compiling now
        # the last CACHED refusals, by spec: the add after the bridge's precompile raises it at once rather than
        # compile it again on the engine thread, in a step (a grammar that matches nothing compiles whole first)
        self._refused: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._background: ThreadPoolExecutor | None = None  # (compile_soon's)

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher (xgrammar.GrammarMatcher) for one sequence; a spec that does not compile is refused."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def compiled(self, spec: StructuredOutput) -> bool:
        """Whether the spec's grammar is compiled already (compile returns it at once)."""
        with self._lock:
            return spec in self._cache or spec in self._refused

    def can_begin_with(self, spec: StructuredOutput, ids: set[int]) -> bool:
        """Can the spec's grammar take one of `ids` first (its mask before any output)?"""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher(spec).fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        return any((words[i >> 5] >> (i & 31)) & 1 for i in ids if i < self.vocab_size)

    def compile(self, spec: StructuredOutput) -> Any:
        """The spec's compiled grammar; a thread that asks while another compiles it waits for that compile."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            if spec in self._refused:
                refusal = self._refused[spec]
                raise RequestError(refusal)
            running = self._compiling.get(spec)
            if running is None:
                compiler = self._xgrammar_compiler()
                running = self._compiling[spec] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return running.result()  # (its refusal, a RequestError, is raised here too)
        try:
            compiled = self._compile(compiler, spec)
            if not self._takes_a_token(compiled):  # (each sample's first draw would find every token masked)
                raise ValueError("it matches nothing: no token, not even the output's end, can begin it")
        except BaseException as exc:  # (whatever it is, the threads waiting for this compile hear it)
            failure: BaseException = exc
            if isinstance(exc, (RuntimeError, ValueError, TypeError)):  # (xgrammar's refusals of a schema or grammar)
                reason = _XGRAMMAR_SOURCE.sub("", str(exc)).strip()  # (without its log stamp and source path)
                failure = RequestError(f"the {spec.kind.replace('_', ' ')} cannot be used: {reason}")
            with self._lock:
                del self._compiling[spec]
                if isinstance(failure, RequestError):  # (xgrammar's answer for this spec, as it will be again)
                    self._refused[spec] = str(failure)
                    if len(self._refused) > self.CACHED:
                        self._refused.popitem(last=False)
            running.set_exception(failure)
            raise failure from None
        with self._lock:
            del self._compiling[spec]
            self._cache[spec] = compiled
            if len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
        running.set_result(compiled)
        return compiled

    def _takes_a_token(self, compiled: Any) -> bool:
        """Whether a compiled grammar's first mask allows any token (a grammar of no string, root ::= root, allows
        none)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def compile_soon(self, spec: StructuredOutput) -> None:
        """Start compiling on a background thread, one of COMPILE_THREADS (a follower rank, told of a grammar rank 0
        is compiling ahead of its request): the add that follows finds it compiled, or waits only for the rest.
        Failures are left for the add to report."""
        with self._lock:
            if spec in self._cache or spec in self._compiling or spec in self._refused:
                return
        if self._background is None:
            self._background = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="tpgraph-grammar")
        self._background.submit(self._compile_quietly, spec)

    def close(self) -> None:
        """Drop the compiles not begun (the engine is closing)."""
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)

    def _compile_quietly(self, spec: StructuredOutput) -> None:
        try:
            self.compile(spec)
        except Exception as exc:  # noqa: BLE001 - the add compiles it again and reports the failure where it belongs
            logger.debug("the background compile of a %s failed: %s", spec.kind, exc)

    @staticmethod
    def _compile(compiler: Any, spec: StructuredOutput) -> Any:
        if spec.kind == "json_schema":
            return compiler.compile_grammar(json_schema_grammar(spec.spec, spec.any_whitespace))
        if spec.kind == "json_object":  # (an object, as OpenAI's json_object means; xgrammar's builtin takes any JSON)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":  # one EBNF rule of the choices as string literals (JSON's escapes)
            # (ensure_ascii off: an escaped surrogate pair would be read as two lone surrogates)
            literals = (json.dumps(c, ensure_ascii=False) for c in json.loads(spec.spec))
            return compiler.compile_grammar("root ::= " + " | ".join(literals))
        return compiler.compile_grammar(lark_grammar(spec.spec) if is_lark(spec.spec) else spec.spec)

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast
            except Exception as exc:  # noqa: BLE001 - missing, or installed without what it needs: the same answer
                raise RequestError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from None
            if not self.eos_ids:  # (a grammar ends on an EOS token: with none, no constrained sample could end)
                raise RequestError("structured outputs need an EOS token id, and this model's config names none")
            info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=self.tokenizer),
                                                      vocab_size=self.vocab_size, stop_token_ids=list(self.eos_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # (ours is bounded)
        return self._compiler


def is_lark(grammar: str) -> bool:
    """Whether a grammar is in Lark's syntax, by vLLM's test: none of its lines, comments left out, holds EBNF's ::=
    (vLLM's grammar field takes either: clients send Lark, the syntax of OpenAI's and llguidance's grammars)."""
    return not any("::=" in _COMMENT.sub("", line) for line in grammar.splitlines())


def lark_grammar(text: str) -> Any:
    """A Lark grammar (its `start` rule the root) as xgrammar's Grammar, which xgrammar's own converter makes."""
    import xgrammar as xgr

    from_lark = getattr(xgr.Grammar, "from_lark", None)
    if from_lark is None:  # (an older xgrammar)
        raise RequestError("this grammar is in Lark's syntax (no rule is written with ::=), which the installed "
                           "xgrammar cannot read: write it in EBNF (root ::= ...), or upgrade xgrammar")
    return from_lark(text)


def structured_outputs_available() -> bool:
    """Whether xgrammar (and the transformers tokenizer wrapper it reads the vocabulary through) imports here: a
    wheel installed without its dependencies can be found but not imported."""
    try:
        import transformers  # noqa: F401
        import xgrammar  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the same: requests will be refused
        logger.info("structured outputs are off (%s: %s); %s", type(exc).__name__, exc, INSTALL_HINT)
        return False
    return True


class GrammarState:
    """A sequence's structured output as its tokens are read: xgrammar's matcher, held off until the output has the
    token ids `after` (a reasoning model's end of thoughts), from when every token is the grammar's."""

    def __init__(self, matcher: Any, after: tuple[int, ...] = ()) -> None:
        self.matcher, self.after = matcher, after
        self.active = not after
        self._recent: tuple[int, ...] = ()  # (while held off) the last len(after) tokens

    @property
    def masks(self) -> bool:
        """Does the next token take a mask? (Not before `after`; not once the grammar took its EOS: it is done.)"""
        return self.active and not self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """The token read back; False if the grammar refuses it."""
        if self.active:
            return self.matcher.accept_token(token)
        self._recent = (*self._recent, token)[-len(self.after):]
        self.active = self._recent == self.after
        return True


def apply_masks(x: Any, grammars: list[tuple[int, GrammarState]]) -> None:
    """Leave each constrained row of x [B, vocab] (fp32, the caller's to change) only the tokens its grammar can take
    next: (row, grammar) pairs, each masking now (GrammarState.masks). On the GPU the masks and their rows are
    copied from pinned memory, queued: from pageable memory (xgrammar's own bitmask, its list of rows) each copy made
    the host wait for the stream's queued work, the step's forward, so the overlapped loop could not schedule the next
    step meanwhile. The caching host allocator keeps each buffer until its copy has read it, then hands it to a later
    step's masks. Only the constrained rows' masks are filled and copied (a whole batch's bitmask, for one structured
    request among many, made every step's host work grow with the batch); the rest of the device's bitmask is set on
    the device, to every token allowed."""
    import torch
    import xgrammar as xgr

    from tpgraph.uploads import to_device

    pinned = x.device.type == "cuda"
    masks = torch.empty(xgr.get_bitmask_shape(len(grammars), x.shape[1]), dtype=xgr.bitmask_dtype,
                        pin_memory=pinned)  # (each row is written whole by its grammar's fill)
    for i, (_, grammar) in enumerate(grammars):
        grammar.matcher.fill_next_token_bitmask(masks, i)
    rows = [row for row, _ in grammars]
    at = to_device(rows, torch.int64, x.device)
    bitmask = torch.full((x.shape[0], masks.shape[1]), -1, dtype=masks.dtype, device=x.device)  # (-1: all allowed)
    bitmask.index_copy_(0, at, masks.to(x.device, non_blocking=True))
    xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=x.shape[1], indices=at.int() if pinned else rows)


# xgrammar (0.2.9, its issue 800) writes a string with minLength or maxLength as a run of this class: it admits raw
# control characters, which JSON forbids (the reply does not parse), and no escapes (a quote or a newline cannot be
# written). Each such character becomes a JSON string's character: unescaped and not a control, or an escape.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'  # (the unbounded strings' class is [^\0-\x1f\"\\\r\n])
_JSON_STRING_CHAR = r'(([^\0-\x1f\"\\]) | ("\\" basic_escape))'


def json_schema_grammar(schema: str, any_whitespace: bool = False) -> Any:
    """A JSON schema's xgrammar Grammar (free whitespace between tokens only with `any_whitespace`), its
    length-bounded strings mended (see above); a grammar whose mended text does not read back is used as xgrammar
    wrote it."""
    import xgrammar as xgr

    ignored = unenforced_keyword(json.loads(schema))
    if ignored is not None:  # (xgrammar compiles it without the keyword: replies would not match their schema)
        raise ValueError(f"{ignored} is not supported (xgrammar would leave it unenforced)")
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text or "basic_escape ::=" not in text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
    except (RuntimeError, ValueError) as exc:
        logger.warning("a JSON schema's length-bounded strings could not be mended (%s); used as xgrammar wrote it",
                       exc)
        return grammar


# What xgrammar (0.2.9) compiles a JSON schema without, leaving the reply free of it: the keywords it reads past, and
# the ones it drops beside others (a $ref's siblings, an anyOf's, oneOf's or allOf's, the second schema of allOf on, a
# pattern's or format's length bounds, multipleOf but an integral one on integers, a required name the same schema's
# properties do not list: {"required": ["b"]} alone, or an anyOf branch {"required": ["a"]} under its parent's
# properties, lets "{}" through).
# vLLM refuses most such schemas for xgrammar too (it has a fallback; this has none).
_UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
               "dependentSchemas", "dependencies")
_ANNOTATIONS = {"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title", "description",
                "default", "examples", "deprecated", "readOnly", "writeOnly"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
            "propertyNames")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# the formats xgrammar writes its own grammar for, dropping minLength/maxLength beside them; any other format
# (pydantic's "binary" for bytes, "password", ...) is read past and the string keeps its length bounds
_FORMATS = {"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
            "uuid", "uri-template", "json-pointer", "relative-json-pointer"}


# anyOf, oneOf and allOf in the order xgrammar reads a schema by the first it has (after $ref, const and enum, which
# it reads first), dropping the keywords beside it: those that would hold a reply are refused (_dropped_beside)
_COMBINERS = ("anyOf", "oneOf", "allOf")
_VALIDATION = {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
               "maxLength", "minLength", "pattern", "format", "items", "prefixItems", "additionalItems",
               "unevaluatedItems", "contains", "maxItems", "minItems", "uniqueItems", "maxProperties", "minProperties",
               "required", "properties", "patternProperties", "additionalProperties", "unevaluatedProperties",
               "propertyNames", "dependentRequired", "dependentSchemas", "dependencies", "not", "if", "then", "else",
               *_COMBINERS}
# the keywords by which xgrammar takes a schema without a type as an object's or an array's
_TYPED_BY = {"properties": "object", "additionalProperties": "object", "unevaluatedProperties": "object",
             "items": "array", "prefixItems": "array", "unevaluatedItems": "array"}
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"),
               (list, "array"), (dict, "object"))


def _types(value: Any) -> set[str]:
    """A schema's "type" as a set ("integer" beside "number", which holds it)."""
    types = set(value) if isinstance(value, list) else {value}
    return types | {"integer"} if "number" in types else types


def _held_to(branch: Any, types: set[str]) -> bool:
    """Whether every value a combiner's branch takes is of `types` (a $ref's target is not looked up: taken as so)."""
    if not isinstance(branch, dict):
        return False
    if "$ref" in branch:
        return True
    values = [branch["const"]] if "const" in branch else branch.get("enum")
    if isinstance(values, list):
        return all(next(t for py, t in _JSON_TYPES if isinstance(v, py)) in types for v in values)
    if "type" in branch:
        return _types(branch["type"]) <= types
    inferred = {t for k, t in _TYPED_BY.items() if k in branch}
    if inferred:
        return len(inferred) == 1 and inferred <= types
    combiner = next((k for k in _COMBINERS if isinstance(branch.get(k), list)), None)
    return combiner is not None and all(_held_to(b, types) for b in branch[combiner])


def _dropped_beside(schema: dict) -> str | None:
    """What xgrammar drops beside the combiner it reads a schema by, that would hold a reply ("anyOf beside
    required, type"; a type each branch is of already is no loss); None if nothing."""
    combiner = next((k for k in _COMBINERS if isinstance(schema.get(k), list)), None)
    if combiner is None or any(k in schema for k in ("$ref", "const", "enum")):  # (read before it: see above)
        return None
    dropped = set(schema) & _VALIDATION - {combiner}
    if "type" in dropped and all(_held_to(b, _types(schema["type"])) for b in schema[combiner]):
        dropped.discard("type")
    return f"{combiner} beside {', '.join(sorted(dropped))}" if dropped else None


# the bounds xgrammar holds a value to only under a type (given, or one _TYPED_BY reads): without, any JSON is taken
_TYPED_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern",
                 "minItems", "maxItems", "minProperties", "maxProperties", "patternProperties", "propertyNames")


def _untyped_bound(schema: dict) -> str | None:
    """The first of a schema's _TYPED_BOUNDS that xgrammar drops for want of a type; None if it has a type, or is
    read by a keyword that comes first ($ref, const, enum, a combiner: _dropped_beside's)."""
    if "type" in schema or any(k in schema for k in (*_TYPED_BY, "$ref", "const", "enum", *_COMBINERS)):
        return None
    return next((k for k in _TYPED_BOUNDS if k in schema), None)


# what in a pattern may stand for a character JSON writes only escaped: a quote, an escaped backslash, a control
# character or its escape (\t, \x01, ...); xgrammar lowers such a pattern to a grammar of its own, not its JSON-string
# regex, and writes them there as they are
_RAW_IN_JSON = re.compile(r'"|\\\\|[\x00-\x1f]|\\[tnrfvae0cxu]')


@functools.lru_cache(maxsize=256)
def _written_unescaped(pattern: str) -> bool:
    """Whether xgrammar writes a string pattern's quotes, backslashes or control characters into the JSON as they are
    (a reply such as "a"b", which is no JSON): it does where it lowers the pattern to a grammar of its own."""
    if not _RAW_IN_JSON.search(pattern):
        return False
    import xgrammar as xgr

    try:
        grammar = str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern})))
    except (RuntimeError, ValueError):  # (refused when the schema compiles, with xgrammar's reason)
        return False
    return "json_string=true" not in grammar


def _integers_only(schema: dict) -> bool:
    """Whether xgrammar holds this schema's multipleOf: an integral one on integers (a type list with "integer" and
    no "number", such as Optional[int]'s ["integer", "null"], too)."""
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    step = schema["multipleOf"]
    return ("integer" in types and "number" not in types and not isinstance(step, bool)
            and isinstance(step, (int, float)) and float(step).is_integer())


def unenforced_keyword(schema: Any, at: str = "#") -> str | None:
    """The first keyword of a JSON schema (its subschemas too) that xgrammar would not hold a reply to, named with
    where it is ("uniqueItems at #/properties/tags"); None if there is none."""
    if not isinstance(schema, dict):
        return None
    found = [k for k in _UNENFORCED if k in schema]
    if schema.get("uniqueItems") is True:
        found.append("uniqueItems")
    if "multipleOf" in schema and not _integers_only(schema):
        found.append("multipleOf on a non-integer")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.append("allOf with more than one schema")
    if ("pattern" in schema or schema.get("format") in _FORMATS) and ("minLength" in schema or "maxLength" in schema):
        found.append(f"{'pattern' if 'pattern' in schema else 'format'} with minLength or maxLength")
    required, props = schema.get("required"), schema.get("properties")
    if isinstance(required, list):  # (xgrammar writes only the listed properties it is told to: others it drops)
        unlisted = [n for n in required if isinstance(n, str) and not (isinstance(props, dict) and n in props)]
        if unlisted:
            found.append(f"required {unlisted[0]!r} without a properties entry beside it")
    if "$ref" in schema and set(schema) - _ANNOTATIONS:
        found.append(f"$ref beside {', '.join(sorted(set(schema) - _ANNOTATIONS))}")
    found += [f"an empty {k}" for k in ("anyOf", "oneOf", "allOf") if schema.get(k) == []]  # (the reply was "")
    if (beside := _dropped_beside(schema)) is not None:
        found.append(beside)
    if (bound := _untyped_bound(schema)) is not None:
        found.append(f"{bound} without a type")
    if isinstance(schema.get("pattern"), str) and _written_unescaped(schema["pattern"]):
        found.append("pattern with a quote, a backslash or a control character (which xgrammar writes unescaped)")
    if found:
        return f"{found[0]} at {at}"
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if (hit := unenforced_keyword(sub, f"{at}/{key}/{name}")) is not None:
                    return hit
    for key in _SCHEMAS:
        if (hit := unenforced_keyword(schema.get(key), f"{at}/{key}")) is not None:
            return hit
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if (hit := unenforced_keyword(sub, f"{at}/{key}/{i}")) is not None:
                    return hit
    return None
