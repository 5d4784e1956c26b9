"""Function calling on /v1/chat/completions: a request's `tools` and `tool_choice`, and its reply read as tool calls.

- tool_choice "none": the model answers in text (the tools still go to the chat template, as vLLM does, unless the
  server runs with --exclude-tools-when-tool-choice-none).
- a named function ({"type": "function", "function": {"name": ...}}): the reply is held to that function's
  parameters schema (structured outputs) and returned as one call; its arguments stream as they are generated.
- "required": the reply is held to a JSON array of one or more {"name", "parameters"} objects, one of the tools each
  (vLLM's schema). With tools [] it is "none", the tools dropped, as vLLM (and OpenAI) read it.
- "auto" (the default when tools are given): the model chooses; the server's --tool-call-parser finds the calls in
  its own format (tool_parsers.py). A server started without one refuses "auto", as vLLM does.

Streamed, "required" and "auto" calls are sent as they are written (tool_streams.py); a whole reply is read as calls
once it is whole, by the same reader.

Replies carry OpenAI's `message.tool_calls` (ids "chatcmpl-tool-<hex>", arguments as JSON text), beside content ""
for a named or "required" choice's calls and null for "auto" ones where there is no text, as vLLM's. finish_reason is
"tool_calls" where calls were made by "required" or "auto", each whole, and generation stopped by itself (a call cut
off keeps the engine's "length" or "stop"), or, a whole "auto" reply, whatever ended it (vLLM's auto_tools_called); a
named call finishes "stop", as OpenAI's does. A reply with no call comes back as content, so nothing is lost. A
stream whose call broke off after it began (cut by max_tokens, say, or on bad JSON) keeps that call as far as it
went, its arguments as written, and the rest as content, as a stream cannot take back a call it sent; a whole
"required" reply does so too, but a whole "auto" reply that ended inside a call, or whose call broke off on bad JSON,
or with a call object after its calls that is no JSON or no call, is its text, no call, as vLLM's tool parsers read
it.
parallel_tool_calls false keeps one call ("required" asks the grammar for exactly one).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tpgraph.engine.structured import MAX_SCHEMA_BRANCHES, StructuredOutput
from tpgraph.errors import RequestError
from tpgraph.server.tool_parsers import PARSERS, ToolParser

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


def template_tools(tools: list[dict]) -> list[dict]:
    """Checked tools as vLLM hands them to the chat template (its pydantic models dumped): "type" first, then the
    function's name, description and parameters (null where left out), then any other keys as written. A template
    that writes the tools out (tojson) so renders vLLM's prompt."""
    fixed = ("name", "description", "parameters")
    out = []
    for tool in tools:
        fn = tool["function"]
        function = {**{k: fn.get(k) for k in fixed}, **{k: v for k, v in fn.items() if k not in fixed}}
        out.append({"type": "function", "function": function,
                    **{k: v for k, v in tool.items() if k not in ("type", "function")}})
    return out


def required_schema(functions: list[dict], one_call: bool) -> dict:
    """vLLM's "required" schema: an array of calls, each {"name": one tool's name, "parameters": its arguments}. Each
    tool's $defs are lifted to the top, where the array's references find them."""
    defs: dict[str, Any] = {}
    options = []
    for fn in functions:
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        defs_here = params.pop("$defs", {})
        if not isinstance(defs_here, dict):  # (a request's mistake: read as a mapping below, it was a 500)
            raise RequestError(f"tool {fn['name']!r}: parameters.$defs must be an object of named schemas")
        for name, schema in defs_here.items():
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


# the chat API's tool choices that force a call, as a refusal of "auto" names them
FORCED_CHOICES = 'tool_choice "required", or a named function'


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
    names: frozenset[str] = frozenset()  # the tools' names (calls to these alone are taken)

    @staticmethod
    def of(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, options: ToolOptions,
           forced_choices: str = FORCED_CHOICES) -> ToolPlan:
        """forced_choices: the request's API's words for the choices that force a call (which need no parser)."""
        if tools is None:
            if tool_choice not in (None, "none"):
                raise RequestError("tool_choice needs tools")
            return ToolPlan()
        by_name = check_tools(tools)
        one_call = parallel_tool_calls is False
        shown = template_tools(tools)
        if not tools and tool_choice in (None, "required"):
            # (vLLM's reading of tools []: "required" is "none", the tools dropped, as OpenAI's; no tool_choice is no
            # "auto", and the template still gets the empty list)
            return ToolPlan(template_tools=None if tool_choice else shown)
        choice = "auto" if tool_choice is None else tool_choice
        if choice == "none":
            return ToolPlan(template_tools=None if options.exclude_tools_when_none else shown)
        if choice == "auto":
            if options.parser is None:
                raise RequestError('"auto" tool choice (the default when tools are given) needs a server started with '
                                   f"--enable-auto-tool-choice and --tool-call-parser; or ask for {forced_choices}, "
                                   "which need neither")
            if not tools:  # (no tool to call: vLLM runs no parser, the reply is plain)
                return ToolPlan(template_tools=shown)
            return ToolPlan("auto", shown, parser=PARSERS[options.parser](), one_call=one_call,
                            names=frozenset(by_name))
        if choice == "required":
            # (each tool a branch of the grammar that holds the reply; said in no one API's words: the Messages
            # API's {"type": "any"} comes here as the chat's "required")
            if len(by_name) > MAX_SCHEMA_BRANCHES:
                raise RequestError(f"a tool_choice that forces a call holds the reply to one of the tools' schemas: "
                                   f"at most {MAX_SCHEMA_BRANCHES} tools are taken with it, got {len(by_name)}")
            return ToolPlan("required", shown, one_call=one_call, names=frozenset(by_name),
                            structured=StructuredOutput.json_schema(required_schema(list(by_name.values()), one_call)))
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
                raise RequestError(f"tool_choice {json.dumps(choice)} is not understood: {NAMED_USAGE}")
            if name not in by_name:
                raise RequestError(f"tool_choice names {name!r}, which is not among the tools "
                                   f"({', '.join(map(repr, by_name))})")
            params = by_name[name].get("parameters") or {"type": "object"}
            return ToolPlan("named", shown, function=name, structured=StructuredOutput.json_schema(params))
        raise RequestError(f'tool_choice {choice!r} is not one of "none", "auto", "required" or a named function '
                           f"({NAMED_USAGE})")
