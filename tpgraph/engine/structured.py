"""Structured outputs: a request's tokens held to a JSON schema, any JSON object, a regular expression, a choice of
strings or an EBNF grammar (OpenAI's response_format, vLLM's guided_* fields), through xgrammar.

Each step, a constrained row's logits lose every token its grammar cannot take next (xgrammar fills the row's bitmask
from the sequence's matcher and applies it), and the token read back advances the matcher. The matcher must have
seen a row's last token before its next mask is made, so while a constrained sequence runs, the engine reads each
step's tokens before it launches the next (no overlap for those steps; engine/core.py). Every rank keeps its own
matchers and reaches the same states, since it samples the same tokens.

JSON is kept compact (no free whitespace between tokens): a model that may emit whitespace anywhere can spend its
whole budget on it, which is why vLLM offers to turn it off too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from tpgraph.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
INSTALL_HINT = "structured outputs need xgrammar: pip install 'tpgraph[structured]'"


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. `spec`: the JSON schema (as JSON text), the regular expression, the EBNF
    grammar, or for `choice` a JSON list of the strings allowed; empty for `json_object`."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise RequestError(f"a structured output's spec is text, got {type(self.spec).__name__}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise RequestError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise RequestError(f"a JSON schema is an object, got {type(schema).__name__}")
        if self.kind == "choice":
            choices = json.loads(self.spec) if self.spec.startswith("[") else None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise RequestError("a choice is a non-empty list of non-empty strings")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise RequestError(f"the {self.kind} is empty")

    @staticmethod
    def choice(options: list[str]) -> StructuredOutput:
        return StructuredOutput("choice", json.dumps(list(options)))

    @staticmethod
    def json_schema(schema: dict | str) -> StructuredOutput:
        return StructuredOutput("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


class GrammarCompiler:
    """xgrammar's compiler for one engine's tokenizer and vocabulary, made on first use (a server that never sees
    a constrained request never imports xgrammar); compiled grammars are cached by their spec."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._compiler: Any = None
        self._cache: dict[StructuredOutput, Any] = {}

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher (xgrammar.GrammarMatcher) for one sequence; a spec that does not compile is refused."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def compile(self, spec: StructuredOutput) -> Any:
        if spec not in self._cache:
            compiler = self._xgrammar_compiler()
            try:
                self._cache[spec] = self._compile(compiler, spec)
            except (RuntimeError, ValueError, TypeError) as exc:  # (xgrammar's refusals of a schema or grammar)
                raise RequestError(f"the {spec.kind.replace('_', ' ')} cannot be used: {exc}") from None
        return self._cache[spec]

    @staticmethod
    def _compile(compiler: Any, spec: StructuredOutput) -> Any:
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":  # one EBNF rule of the choices as string literals (JSON's escapes)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)))
        return compiler.compile_grammar(spec.spec)

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast
            except ImportError:
                raise RequestError(INSTALL_HINT) from None
            info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=self.tokenizer),
                                                      vocab_size=self.vocab_size, stop_token_ids=list(self.eos_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def apply_masks(x: Any, matchers: list[tuple[int, Any]]) -> None:
    """Leave each constrained row of x [B, vocab] (fp32, the caller's to change) only the tokens its matcher can take
    next: (row, matcher) pairs."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(x.shape[0], x.shape[1])
    for row, matcher in matchers:
        matcher.fill_next_token_bitmask(bitmask, row)
    rows = [row for row, _ in matchers]
    xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device, non_blocking=True), vocab_size=x.shape[1], indices=rows)
