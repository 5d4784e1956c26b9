"""Function calling on /v1/chat/completions: a request's `tools` and `tool_choice`, and its reply read as tool calls.

- tool_choice "none": the model answers in text (the tools still go to the chat template, as vLLM does, unless the
  server runs with --exclude-tools-when-tool-choice-none).
- a named function ({"type": "function", "function": {"name": ...}}): the reply is held to that function's
  parameters schema (structured outputs) and returned as one call; its arguments stream as they are generated.
- "required": the reply is held to a JSON array of one or more {"name", "parameters"} objects, one of the tools each
  (vLLM's schema), and each call is sent as soon as it is complete.
- "auto" (the default when tools are given): the model chooses; the server's --tool-call-parser finds the calls in
  its own format (tool_parsers.py). A server started without one refuses "auto", as vLLM does.

Replies carry OpenAI's `message.tool_calls` (ids "chatcmpl-tool-<hex>", arguments as JSON text). finish_reason is
"tool_calls" where calls were made by "required" or "auto" and generation stopped by itself; a named call finishes
"stop", as OpenAI's does. A reply that does not parse as calls (cut by max_tokens, say) comes back as content, so
nothing is lost. parallel_tool_calls false keeps one call ("required" asks the grammar for exactly one).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tpgraph.engine.structured import StructuredOutput
from tpgraph.errors import RequestError
from tpgraph.server.tool_parsers import JSON_ERRORS, PARSERS, ParsedCall, ToolParser, arguments_text, loads

NAMED_USAGE = 'a named tool_choice is {"type": "function", "function": {"name": "my_function"}}'


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def check_tools(tools: list[Any]) -> dict[str, dict]:
    """The tools by name, each checked: {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    by_name: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f'{where} must be {{"type": "function", "function": {{...}}}} (function tools only)')
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{where}.function needs a name (a non-empty string)")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object")
        if fn["name"] in by_name:
            raise RequestError(f"{where}: two tools are named {fn['name']!r}")
        by_name[fn["name"]] = fn
    return by_name


def required_schema(functions: list[dict], one_call: bool) -> dict:
    """vLLM's "required" schema: an array of calls, each {"name": one tool's name, "parameters": its arguments}. Each
    tool's $defs are lifted to the top, where the array's references find them."""
    defs: dict[str, Any] = {}
    options = []
    for fn in functions:
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise RequestError(f"two tools define $defs.{name} differently; give the definitions one name each")
        options.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if one_call:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolOptions:
    """The server's function-calling settings (vLLM's flags)."""

    parser: str | None = None  # --tool-call-parser, given with --enable-auto-tool-choice: "auto" is served
    exclude_tools_when_none: bool = False  # --exclude-tools-when-tool-choice-none


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the server. mode: "none", "named", "required" or "auto"."""

    mode: str = "none"
    template_tools: list[dict] | None = None  # what the chat template sees as `tools`
    function: str | None = None  # (named) the function called
    structured: StructuredOutput | None = None  # the constraint that makes the reply calls
    parser: ToolParser | None = None  # ("auto")
    one_call: bool = False
    names: frozenset[str] = frozenset()  # the tools' names ("auto" takes calls to these alone)

    @staticmethod
    def of(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, options: ToolOptions
           ) -> ToolPlan:
        if not tools:
            if tool_choice not in (None, "none"):
                raise RequestError("tool_choice needs tools")
            return ToolPlan()
        by_name = check_tools(tools)
        choice = "auto" if tool_choice is None else tool_choice
        one_call = parallel_tool_calls is False
        if choice == "none":
            return ToolPlan(template_tools=None if options.exclude_tools_when_none else list(tools))
        if choice == "auto":
            if options.parser is None:
                raise RequestError('"auto" tool choice (the default when tools are given) needs a server started with '
                                   "--enable-auto-tool-choice and --tool-call-parser; or ask for tool_choice "
                                   '"required", or a named function, which need neither')
            return ToolPlan("auto", list(tools), parser=PARSERS[options.parser](), one_call=one_call,
                            names=frozenset(by_name))
        if choice == "required":
            return ToolPlan("required", list(tools), one_call=one_call, structured=StructuredOutput.json_schema(
                required_schema(list(by_name.values()), one_call)))
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
                raise RequestError(f"tool_choice {json.dumps(choice)} is not understood: {NAMED_USAGE}")
            if name not in by_name:
                raise RequestError(f"tool_choice names {name!r}, which is not among the tools "
                                   f"({', '.join(map(repr, by_name))})")
            params = by_name[name].get("parameters") or {"type": "object"}
            return ToolPlan("named", list(tools), function=name, structured=StructuredOutput.json_schema(params))
        raise RequestError(f'tool_choice {choice!r} is not one of "none", "auto", "required" or a named function '
                           f"({NAMED_USAGE})")

    def reader(self) -> ToolCallReader:
        return ToolCallReader(self)


@dataclass
class Delta:
    """What a stretch of generated text adds to a reply: content, and tool-call deltas (OpenAI's streaming form:
    the first delta of a call carries its index, id, type and name; later ones more of its arguments)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)


@dataclass
class ToolCallReader:
    """One choice's reply, read as it streams: content and tool calls (see the module's docstring)."""

    plan: ToolPlan
    text: str = ""
    content: str = ""  # what has been sent, all told: content, and tool-call deltas
    call_deltas: list[dict] = field(default_factory=list)
    sent_content: int = 0  # characters of text sent as content
    sent_calls: int = 0
    json: JsonScanner = field(default_factory=lambda: JsonScanner())  # ("required") where the array stands
    element_at: int = -1  # ("required") where the array's element being generated begins
    finish_reason: str | None = None

    def feed(self, text: str) -> Delta:
        """The reply's next text: what it adds to send now."""
        return self._sent(self._feed(text))

    def finish(self, finish_reason: str | None) -> tuple[Delta, str | None]:
        """What is left to send when generation ends, and the finish reason the reply reports."""
        delta, self.finish_reason = self._finish(finish_reason)
        return self._sent(delta), self.finish_reason

    def message(self) -> dict:
        """The whole reply as a non-streamed message: content is null beside tool calls where there is none."""
        calls = merge_calls(self.call_deltas)
        message: dict[str, Any] = {"role": "assistant", "content": self.content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message

    def _sent(self, delta: Delta) -> Delta:
        self.content += delta.content
        self.call_deltas += delta.calls
        return delta

    def _feed(self, text: str) -> Delta:
        self.text += text
        mode = self.plan.mode
        if mode == "none":
            self.sent_content = len(self.text)
            return Delta(text)
        if mode == "named":
            if self.sent_calls == 0:
                self.sent_calls = 1
                return Delta(calls=[{"index": 0, "id": tool_call_id(), "type": "function",
                                     "function": {"name": self.plan.function, "arguments": text}}])
            return Delta(calls=[{"index": 0, "function": {"arguments": text}}]) if text else Delta()
        if mode == "required":
            return Delta(calls=self._complete_elements())
        until = self.plan.parser.content_until(self.text)
        return Delta(self._content_to(until))

    def _finish(self, finish_reason: str | None) -> tuple[Delta, str | None]:
        mode = self.plan.mode
        if mode == "none":
            return Delta(), finish_reason
        if mode == "named":  # (a reply of no text still makes its call, with empty arguments)
            return self._feed("") if self.sent_calls == 0 else Delta(), finish_reason
        if mode == "required":
            calls = self._complete_elements()
            if self.sent_calls == 0:  # no whole call (cut by max_tokens): the text comes back as it is
                return Delta(self._content_to(len(self.text))), finish_reason
            # an array cut after some calls: the part call that was cut comes back as text
            rest = self.text[self.element_at:] if self.element_at >= 0 else ""
            return Delta(rest, calls), "tool_calls" if finish_reason == "stop" else finish_reason
        content, parsed = self.plan.parser.parse(self.text, self.plan.names)
        if not parsed:
            return Delta(self._content_to(len(self.text))), finish_reason
        if self.plan.one_call:
            parsed = parsed[:1]
        # (what was streamed as content is content's beginning: a parser sends nothing that could begin a call)
        tail = (content or "")[self.sent_content:]
        return Delta(tail, [self._call(c) for c in parsed]), "tool_calls" if finish_reason == "stop" else finish_reason

    def _content_to(self, until: int) -> str:
        out = self.text[self.sent_content:until]
        self.sent_content = max(self.sent_content, until)
        return out

    def _call(self, call: ParsedCall) -> dict:
        index, self.sent_calls = self.sent_calls, self.sent_calls + 1
        return {"index": index, "id": tool_call_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _complete_elements(self) -> list[dict]:
        """("required") The calls whose objects closed since the last look (each object at depth 1 of the array)."""
        calls = []
        scan = self.json
        for i in range(scan.seen, len(self.text)):
            ch = self.text[i]
            scan.step(ch)
            if scan.in_string:
                continue
            if ch == "{" and scan.depth == 2:
                self.element_at = i
            elif ch == "}" and scan.depth == 1 and self.element_at >= 0:
                # (the grammar makes each element {"name", "parameters"}; anything else is left as text)
                call = _array_call(self.text[self.element_at:i + 1])
                if call is not None:
                    self.element_at = -1
                    if not (self.plan.one_call and self.sent_calls):
                        calls.append(self._call(call))
        return calls


class JsonScanner:
    """Follows JSON text a character at a time: its depth, and whether it is inside a string."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.seen = 0, False, False, 0

    def step(self, ch: str) -> None:
        self.seen += 1
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1


def _array_call(element: str) -> ParsedCall | None:
    try:
        obj = loads(element)
    except JSON_ERRORS:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("parameters"), dict):
        return None
    arguments = arguments_text(obj["parameters"])
    return None if arguments is None else ParsedCall(obj["name"], arguments)


def merge_calls(deltas: list[dict]) -> list[dict]:
    """Streaming tool-call deltas folded into whole calls (a non-streamed reply's message.tool_calls)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                             "function": {"name": None, "arguments": ""}})
        fn = d.get("function", {})
        call["function"]["name"] = fn.get("name") or call["function"]["name"]
        call["function"]["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def history_call(call: Any, where: str) -> dict:
    """An assistant message's earlier tool call as a chat template takes it: arguments as an object (Transformers'
    convention: templates write them out with tojson)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except JSON_ERRORS as exc:
            raise RequestError(f"{where}.function.arguments is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
