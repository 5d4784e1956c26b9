"""Tool-call parsers for tool_choice "auto": they find the calls a model wrote in its own format in the text it
generated (vLLM's --tool-call-parser names):

- llama3_json: Llama 3.1-3.3's JSON calls. The reply is one or more `{"name": ..., "parameters": {...}}` objects
  (`"arguments"` is taken too), `;`-separated, maybe after `<|python_tag|>`; a reply that begins otherwise is text.
- hermes: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among text (a last block
  left open is read too); the text around them is content, but for whitespace between and after them.
- pythonic: Llama 3.2's and 4's calls as a Python list, `[get_weather(city="Oslo"), get_time()]` (Llama 4's between
  `<|python_start|>` and `<|python_end|>`): keyword arguments of literal values, parsed with `ast`, never run.

A reply that does not parse as calls, or calls a function the request did not offer, is returned whole as content:
nothing the model wrote is lost. (Where a call in it broke off after it began, reply.py reads the reply as a stream
does instead: the stream sent that call as far as it went.) Raw control characters in strings (a tab, as models
write) are taken, and the arguments re-encoded as JSON (arguments written as a JSON string are taken too). These
parsers read a whole reply; a streamed reply's calls (llama3_json, hermes and pythonic) are read as they are written
(tool_streams.py).
"""

from __future__ import annotations

import ast
import json
import math
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


class ToolParser:
    name = ""
    keeps_special_tokens = False  # must the text keep special tokens (the parser's markers may be ones)?

    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls): the text around the calls (None where there is none) and the calls, in order. A call
        to a function not among `names` (the request's tools) is no call: the reply is then content."""
        raise NotImplementedError


LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# a call's values nested deeper are refused, streamed or whole (Python's json.loads, a client's too, stops near 1000)
MAX_DEPTH = 512
# what json raises on text it will not take: bad JSON, an integer past Python's 4300 digits, nesting past the stack
JSON_ERRORS = (ValueError, RecursionError)


class JsonObject(dict):
    """A JSON object as it was written: json.dumps writes its pairs in order, a key given twice twice, as a stream
    writes it (it sends the first before it reads the second); the dict holds the last, as json.loads reads it, and
    a client's JSON parser reads the text (Python's and JavaScript's keep the last)."""

    def __init__(self, pairs: list[tuple[str, object]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs

    def items(self) -> list[tuple[str, object]]:  # (what json.dumps writes a dict subclass from)
        return self.pairs


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a float's range")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is no JSON")


def json_decoder() -> json.JSONDecoder:
    """JSON as models write it, as a stream reads it: a raw tab in a string is taken (strict JSON forbids it);
    objects are JsonObjects; NaN, Infinity and a number past a float's range are refused anywhere (json.loads takes
    them, but they have no JSON form, and a stream refuses them where it reads them)."""
    return json.JSONDecoder(strict=False, object_pairs_hook=JsonObject, parse_float=_finite,
                            parse_constant=_no_constant)


def loads(text: str) -> object:
    """JSON text read whole by json_decoder()."""
    return json_decoder().decode(text)


def arguments_text(args: object) -> str | None:
    """A call's arguments as JSON text: an object (or JSON text of one), re-encoded; None if it is no object or
    holds what JSON cannot (NaN, Infinity)."""
    try:
        if isinstance(args, str):  # (some models write the arguments as a JSON string)
            args = loads(args)
        if not isinstance(args, dict):
            return None
        # (a lone surrogate, written as an escape, stays one: UTF-8 cannot encode it raw)
        return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}",
                                  json.dumps(args, ensure_ascii=False, allow_nan=False))
    except (*JSON_ERRORS, TypeError):  # (TypeError: a value JSON has no form for, a set say)
        return None


def tag_begun(text: str, tag: str) -> int:
    """How many characters at text's end could begin `tag` (held back while streaming, until it is told)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def nesting(value: object) -> int:
    """How deep containers nest in a value (a scalar 0, `[]` 1, `{"a": [1]}` 2), keys given twice counted."""
    depth, level = 0, [value]
    while True:
        level = [v for v in level if isinstance(v, dict | list | tuple)]
        if not level:
            return depth
        depth += 1
        level = [x for v in level for x in ((x for _, x in v.items()) if isinstance(v, dict) else v)]


def first(obj: dict, keys: tuple[str, ...]) -> object:
    """The value of obj's first key among `keys`, in the order written (None if none)."""
    return next((v for k, v in obj.items() if k in keys), None)


def _call(obj: object, args_keys: tuple[str, ...], names: frozenset[str]) -> ParsedCall | None:
    # (a name or arguments given twice, or arguments under both keys: the first written is taken, as a stream, which
    # sends a call before it could read a later one, takes it)
    if not isinstance(obj, dict) or nesting(obj) > MAX_DEPTH + 1:  # (each value read as a stream reads it)
        return None
    name = first(obj, ("name",))
    if not isinstance(name, str) or name not in names:
        return None
    arguments = arguments_text(first(obj, args_keys))
    return None if arguments is None else ParsedCall(name, arguments)


def required_calls(text: str, names: frozenset[str]) -> tuple[list[ParsedCall], int]:
    """tool_choice "required", read whole: the calls of the grammar's array `[{"name": ..., "parameters": {...}},
    ...]`, in order, and where the text stops being calls (at a part call cut by max_tokens; len(text) when the
    array closed)."""
    decoder, calls = json_decoder(), []
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return [], 0
    at = _skip_space(text, at + 1)
    while text.startswith("{", at):
        try:
            obj, end = decoder.raw_decode(text, at)
        except JSON_ERRORS:
            break
        call = _call(obj, ("parameters",), names)
        if call is None:
            break
        calls.append(call)
        at = _skip_space(text, end)
        if text.startswith("]", at):
            return calls, len(text)
        if not text.startswith(",", at):
            break
        at = _skip_space(text, at + 1)
    return calls, at


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        body = body.removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json_decoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except JSON_ERRORS:
                return text, []
            call = _call(obj, ("parameters", "arguments"), names)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":  # (calls are `; `-separated)
                at += 1
        return None, calls


class HermesParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True  # (Hermes checkpoints make <tool_call> a special token)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.OPEN)
        if at < 0:
            return text, []
        decoder, calls, content = json_decoder(), [], [text[:at]]
        while at >= 0:
            # a block: its object read whole (a closing tag inside a string is the string's), then the tag
            begin = _skip_space(text, at + len(self.OPEN))
            try:
                obj, end = decoder.raw_decode(text, begin)
            except JSON_ERRORS:
                return text, []
            call = _call(obj, ("arguments", "parameters"), names)
            end = _skip_space(text, end)
            if call is None or not (text.startswith(self.CLOSE, end) or end == len(text)):
                return text, []
            calls.append(call)
            end += len(self.CLOSE) if end < len(text) else 0
            at = text.find(self.OPEN, end)
            content.append(text[end:at if at >= 0 else len(text)])
        # (the text around the blocks; whitespace between and after them is none)
        return content[0] + "".join(c for c in content[1:] if c.strip()) or None, calls


def parse_expression(text: str) -> ast.expr:
    """A Python expression's tree, parsed and never run, without the warnings some literals raise (a model's odd
    escapes would print them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(text, mode="eval").body


class PythonicParser(ToolParser):
    name = "pythonic"
    TAG, END = "<|python_start|>", "<|python_end|>"  # (Llama 4's)

    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self.TAG).removesuffix(self.END).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:  # (parsed, never run: each argument must be a literal)
            tree = parse_expression(body)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in names
                    or node.args or any(k.arg is None for k in node.keywords)
                    or len({k.arg for k in node.keywords}) < len(node.keywords)):  # (repeated: Python refuses it)
                return text, []
            try:
                arguments = arguments_text({k.arg: ast.literal_eval(k.value) for k in node.keywords})
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, ArithmeticError):
                arguments = None
            if arguments is None:
                return text, []
            calls.append(ParsedCall(node.func.id, arguments))
        return None, calls


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Llama3JsonParser, HermesParser, PythonicParser)}
