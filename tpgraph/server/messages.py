"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as vLLM's server serves it beside OpenAI's: the
request read as a chat turn (the system prompt and messages as chat messages, tools, tool_choice, stop_sequences,
output_config's JSON schema), which runs through the chat route's own set-up (ChatTurn); the reply's thoughts, text
and tool calls come back as thinking, text and tool_use content blocks, whole or as Anthropic's stream of events.
Errors take Anthropic's shape ({"type": "error", "error": {"type", "message"}}).

Beyond vLLM's: a stop sequence that ended the reply is named (stop_reason "stop_sequence"), usage splits off the prompt
tokens read from the prefix cache (cache_read_input_tokens), a final assistant message is continued (Anthropic's
prefill), consecutive turns of a role are one turn (as Anthropic's API combines them), and images, documents, server
tools, MCP servers and a tool_result's images are refused by name instead of reaching a text model (or being
dropped)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field, ValidationError, field_validator

from tpgraph.engine.sampling_params import check_stop
from tpgraph.errors import RequestError
from tpgraph.server.errors import anthropic_error_body
from tpgraph.server.protocol import ChatRequest, NullMeansDefault, _an_integer, _not_a_bool, forwarded_extras, invalid
from tpgraph.server.reply import Delta
from tpgraph.server.request_ids import request_id
from tpgraph.server.sse import EventStream, stream_failure, typed_sse
from tpgraph.server.turn import ChatTurn, RenderedChat

# Claude Code's first system block: a per-request hash that would defeat the prefix cache (vLLM drops it too)
BILLING_HEADER = "x-anthropic-billing-header"
# the roles Claude Code (2.1.154 on) gives some user turns, read as the user's (as vLLM's AnthropicMessage reads them)
ROLE_ALIASES = {"ctx": "user", "msg": "user"}
# Anthropic's output_config.effort values (as vLLM's AnthropicOutputConfig takes them): REASONING_EFFORTS less none and
# minimal, by design (Anthropic turns thinking off with thinking.type, not an effort); each is the chat request's
# reasoning_effort, which gives it to the template
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# the tool choices that force a call (as the chat's "required" and named choice), as a refusal names them
FORCED_CHOICES = 'tool_choice {"type": "any"}, or {"type": "tool", "name": ...}'


class MessagesRequest(NullMeansDefault):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    max_tokens: int
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict | None = None
    # {"type": "enabled" | "disabled"}: the template's enable_thinking (or "adaptive"); display "omitted": the thinking
    # blocks come back signed but empty
    thinking: dict | None = None
    output_config: dict | None = None  # format (a JSON schema), effort (the template's reasoning_effort)
    metadata: dict | None = None  # (user_id: taken, as Anthropic's, for its own records)
    chat_template_kwargs: dict[str, Any] | None = None  # (vLLM's)

    # (as the chat request's own: pydantic would take true as 1 token, or as temperature 1.0, unsaid)
    _counts_are_integers = field_validator("max_tokens", "top_k", mode="before")(_an_integer)
    _numbers_are_no_bools = field_validator("temperature", "top_p", mode="before")(_not_a_bool)

    def chat_request(self, stream: bool) -> ChatRequest:
        """The chat request these messages run as."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        check_stop(self.stop_sequences or [], "stop_sequences")  # (named as sent: the chat's check names its stop)
        messages = chat_messages(self.system, self.messages)
        self.shows_thoughts()  # (checked as the request is read: a bad display is refused before it runs)
        extras = self.model_extra or {}
        if extras.get("stop") is not None:  # (Anthropic's own field sets the stop strings: one, not two that race)
            raise RequestError("stop is the chat API's field: send the stop strings as stop_sequences")
        if extras.get("mcp_servers"):  # (the server's tools, as server tools are: refused, not dropped unsaid)
            raise RequestError("mcp_servers (Anthropic's MCP connector) is not served: this server calls no MCP "
                               "server; give its tools as custom tools and run their calls in the client")
        body: dict[str, Any] = forwarded_extras(extras)
        # (a final assistant message is Anthropic's prefill: the reply continues it)
        prefill = messages[-1]["role"] == "assistant"
        body.update(model=self.model, messages=messages, max_tokens=self.max_tokens, stop=self.stop_sequences,
                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stream=stream,
                    add_generation_prompt=not prefill, continue_final_message=prefill,
                    chat_template_kwargs=self.template_variables(), reasoning_effort=self.effort(),
                    **self.tool_fields())
        schema = self.output_schema()
        forced = (self.tool_choice or {}).get("type") in ("any", "tool")
        if schema is not None and forced:  # (named as sent: the chat's check names its response_format)
            fmt = "output_format" if (self.model_extra or {}).get("output_format") is not None else \
                "output_config.format"
            raise RequestError(f"tool_choice {json.dumps(self.tool_choice)} forces a tool call, whose input the "
                               f"tool's schema holds: it cannot also take {fmt}")
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        try:
            chat = ChatRequest.model_validate(body)
        except ValidationError as exc:
            raise invalid(exc) from None
        # (a prefill of text is the answer begun: the reply goes on with it, not read as thoughts on a reasoning
        # server, which left the reply without a text block; Anthropic takes no prefill with thinking either)
        chat._continues_answer = prefill and _has_text(messages[-1]["content"])
        chat._forced_choices = FORCED_CHOICES
        return chat

    def output_schema(self) -> Any:
        """output_config.format's JSON schema (None where none is given, as vLLM reads it): the one format Anthropic
        has, {"type": "json_schema", "schema"}; another is refused, not left unenforced. Its beta name, a top-level
        output_format (which Anthropic still takes, and its SDK's beta sent), is read alike: left in the extras,
        it was dropped unsaid and the reply ran unconstrained."""
        fmt = (self.output_config or {}).get("format")
        beta = (self.model_extra or {}).get("output_format")
        if fmt is not None and beta is not None:
            raise RequestError("give one of output_config.format and output_format (its beta name), not both")
        name = "output_config.format" if beta is None else "output_format"
        fmt = fmt if beta is None else beta
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type", "json_schema") != "json_schema":
            raise RequestError(f'{name} must be {{"type": "json_schema", "schema": {{...}}}}, got {fmt!r}')
        schema = fmt.get("schema")
        if not isinstance(schema, dict):  # (left out, the reply ran unconstrained unsaid: Anthropic requires it)
            raise RequestError(f"{name}.schema must be the reply's JSON schema (an object), got {schema!r}")
        return schema

    def template_variables(self) -> dict[str, Any] | None:
        """The chat template's variables: the request's own, with thinking's enable_thinking (adaptive and
        between_tools, where the model decides: the template's default, or the effort's, ChatRequest.template_kwargs).
        """
        variables = dict(self.chat_template_kwargs or {})
        kind = (self.thinking or {}).get("type")
        if kind not in (None, "enabled", "disabled", "adaptive", "between_tools"):
            raise RequestError(f"thinking.type must be enabled, disabled, adaptive or between_tools, got {kind!r}")
        if kind in ("enabled", "disabled"):
            variables["enable_thinking"] = kind == "enabled"
        return variables or None

    def shows_thoughts(self) -> bool:
        """Whether the reply's thinking blocks carry the thoughts: thinking.display "omitted" asks for them empty (a
        signature alone, as Anthropic's), "summarized" (or none) for the thoughts; they were sent whatever it said."""
        display = (self.thinking or {}).get("display")
        if display not in (None, "summarized", "omitted"):
            raise RequestError(f"thinking.display must be summarized or omitted, got {display!r}")
        return display != "omitted"

    def effort(self) -> str | None:
        """output_config.effort, the chat request's reasoning_effort (as vLLM's: the template gets it, and
        enable_thinking where thinking.type does not set it), checked here to be named as sent."""
        effort = (self.output_config or {}).get("effort")
        if effort not in (None, *EFFORTS):  # (a typo would reach the template as an effort it does not know)
            raise RequestError(f"output_config.effort must be one of {', '.join(EFFORTS)}; got {effort!r}")
        return effort

    def tool_fields(self) -> dict[str, Any]:
        """tools and tool_choice as the chat's: custom tools as functions; auto, any ("required"), tool (named) and
        none; disable_parallel_tool_use as parallel_tool_calls false. A tool_choice without tools goes to the chat's
        check (vLLM's: refused, but for none), not dropped. No tool_choice leaves the chat's unset too (auto where
        there are tools): set to auto, it refused tools [] on a server with no tool parser, where none can be called."""
        if self.tools is None and self.tool_choice is None:
            return {}
        tools: list[dict] = []
        for i, tool in enumerate(self.tools or ()):
            # (a custom tool's type is "custom", null or left out: Anthropic's SDKs type it nullable, and a Tool model
            # dumped with its nulls sends "type": null)
            if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "name" not in tool:
                raise RequestError(f"tools[{i}] must be a custom tool ({{name, description, input_schema}}); server "
                                   "tools (web search, bash, text editor, ...) are not run by this server")
            if not isinstance(tool["name"], str) or not tool["name"]:  # (named as sent, not as the chat's function)
                raise RequestError(f"tools[{i}].name must be a non-empty string, got {tool['name']!r}")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):  # (required: Anthropic's and vLLM's)
                raise RequestError(f"tools[{i}].input_schema must be the tool input's JSON schema (an object), got "
                                   f"{schema!r}")
            # (a tool's input is an object: a schema that leaves out its type is an object's, as vLLM reads it; one of
            # another type is refused, as Anthropic's API refuses it, not run as a call whose input is no object)
            if schema.get("type", "object") != "object":
                raise RequestError(f'tools[{i}].input_schema.type must be "object" (a tool\'s input is an object), '
                                   f"got {schema['type']!r}")
            tools.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description"),
                "parameters": {"type": "object", **schema}}})
        choice = self.tool_choice or {}
        kind = choice.get("type")
        if self.tool_choice is None:
            mode: str | dict | None = None
        elif kind == "tool":
            if not isinstance(choice.get("name"), str) or not choice["name"]:  # ("": not as the chat's named choice)
                raise RequestError("tool_choice {\"type\": \"tool\"} needs the tool's name")
            mode = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in ("auto", "any", "none"):
            mode = {"any": "required"}.get(kind, kind)
        else:
            raise RequestError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}")
        return {"tools": None if self.tools is None else tools, "tool_choice": mode,
                "parallel_tool_calls": False if choice.get("disable_parallel_tool_use") else None}


def chat_messages(system: str | list[Any] | None, messages: list[Any]) -> list[dict]:
    """Anthropic's system prompt and messages as chat messages: text blocks as text, a thinking block as the
    assistant's reasoning, tool_use blocks as its tool calls, a user's tool_result blocks as tool messages (before the
    rest of that user's text, as they answer the calls just made); a system message inside the messages joins the
    system prompt, as vLLM reads it. Consecutive turns of one role are one turn, as Anthropic's API combines them (a
    template that asks for alternating roles refused them)."""
    system_texts = _system_texts(system, "system")
    # each turn's role and its blocks, each with where the user wrote it (a refusal names it so)
    turns: list[tuple[str, list[tuple[Any, str]]]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role == "system":
            system_texts += _system_texts(m.get("content"), f"{where}.content")
            continue
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}.role must be user or assistant, got {role!r}")
        content = m.get("content")
        if not isinstance(content, str | list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks")
        # (Anthropic's rule, an empty string's as an empty list's: bar a prefill)
        if not content and not (role == "assistant" and i == len(messages) - 1):
            raise RequestError(f"{where}.content is empty: each message but a final assistant one needs content")
        if isinstance(content, str):  # (a text block's; "" none: a final assistant message's, the prefill's)
            blocks = [({"type": "text", "text": content}, f"{where}.content")] if content else []
        else:
            blocks = [(block, f"{where}.content[{j}]") for j, block in enumerate(content)]
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    out = [message for role, blocks in turns for message in _blocks(role, blocks)]
    system_prompt = "".join(system_texts)
    if system_prompt:  # (system "" is none, as vLLM reads it: no empty system turn in the prompt)
        out.insert(0, {"role": "system", "content": system_prompt})
    if not any(m["role"] != "system" for m in out):
        raise RequestError("messages holds no user or assistant content")
    return out


def _system_texts(system: Any, where: str) -> list[str]:
    """The system prompt's texts (Claude Code's billing header left out)."""
    return [t for t in _texts(system, where) if not t.startswith(BILLING_HEADER)]


def _texts(content: Any, where: str) -> list[str]:
    """A content's texts: a string's, or each text block's of a list (a block of any other kind refused)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise RequestError(f"{where}[{j}] must be a text block; this server serves a text model")
        texts.append(_text(block, f"{where}[{j}]"))
    return texts


def _text(block: dict, where: str) -> str:
    """A text block's text; one with none is refused, as Anthropic's API refuses it (not taken in, nor dropped), and
    one whose text is no string by name (not as a kind of block the server does not take)."""
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{where}.text must be a string (the block's text), got {block.get('text')!r}")
    if not block["text"]:
        raise RequestError(f"{where}: text content blocks must be non-empty")
    return block["text"]


def _blocks(role: str, blocks: list[tuple[Any, str]]) -> list[dict]:
    """One turn's content blocks (each with where it was written) as chat messages: a user's tool results each a tool
    message, then the rest."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for block, at in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking" and role == "assistant":
            if not isinstance(block.get("thinking"), str):
                raise RequestError(f"{at}.thinking must be a string (the thoughts), got {block.get('thinking')!r}")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # (opaque: nothing to render)
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise RequestError(f"{at} (tool_use) needs its id and name")
            if not isinstance(block.get("input") or {}, dict):  # (the template would get {} in its place, unsaid)
                raise RequestError(f"{at}.input must be an object (the tool's arguments), got {block['input']!r}")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestError(f"{at} (tool_result) needs its tool_use_id")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                             "content": _result_text(block.get("content"), f"{at}.content")})
        else:
            raise RequestError(f"{at}: a {kind!r} block is not taken in a {role} message; this server serves a text "
                               "model (text, thinking, tool_use and tool_result blocks)")
    # (several text blocks as the chat's text parts, as vLLM hands them over: the template gets them joined by
    # newlines, or as parts where it loops over them; not glued into one another)
    content: str | list[dict] | None = texts[0] if len(texts) == 1 else \
        [{"type": "text", "text": t} for t in texts] if texts else None if calls else ""
    message: dict[str, Any] = {"role": role, "content": content}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return results + ([message] if texts or calls or reasoning or not results else [])


def _has_text(content: str | list[dict] | None) -> bool:
    """Does a chat message's content (a string, or text parts) hold any text?"""
    return bool(content) if not isinstance(content, list) else any(part.get("text") for part in content)


def _result_text(content: Any, where: str) -> str:
    return "\n".join(_texts(content, where))


class ContentBlocks:
    """A reply's content blocks as its deltas come (thinking, text, tool_use), and the stream's events that build
    them: each block starts, grows and stops before the next begins. The same fold makes a whole reply's content, so
    a reply is the same streamed or not."""

    def __init__(self, shows_thoughts: bool = True) -> None:
        self.shows_thoughts = shows_thoughts  # (false: each thinking block starts, is signed and stops, empty)
        self.blocks: list[dict] = []
        # each block's text (a tool_use block's: its input as written, JSON text) in pieces, joined once it is whole:
        # += on the block's field copied all of it every token
        self.texts: list[list[str]] = []
        self.open: str | None = None  # the open block's type
        self.call_blocks: dict[int, int] = {}  # each tool call's (by its index) block

    def add(self, delta: Delta) -> list[dict]:
        """The events a delta adds: its thoughts (written before its answer), then its texts and calls in the order
        they were written (a call's last arguments, then the text after it, each in its own block)."""
        events: list[dict] = []
        if delta.reasoning:
            shown = {"type": "thinking_delta", "thinking": delta.reasoning} if self.shows_thoughts else None
            events += self._grow("thinking", {"type": "thinking", "thinking": "", "signature": ""}, shown)
            if self.shows_thoughts:
                self.texts[-1].append(delta.reasoning)
        for part in delta.in_order():
            if isinstance(part, str):
                events += self._grow("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": part})
                self.texts[-1].append(part)
            else:
                events += self._calls([part])
        return events

    def _calls(self, calls: list[dict]) -> list[dict]:
        """Tool-call deltas as tool_use blocks: a call's first starts its block; its arguments go to its own block."""
        events: list[dict] = []
        for call in calls:
            function = call.get("function", {})
            if "id" in call:
                events += self._close()
                events += self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": function["name"],
                                                   "input": {}})
                self.call_blocks[call.get("index", len(self.call_blocks))] = len(self.blocks) - 1
            arguments = function.get("arguments") or ""
            if arguments:
                at = self.call_blocks.get(call.get("index"), len(self.blocks) - 1)
                self.texts[at].append(arguments)
                events.append({"type": "content_block_delta", "index": at,
                               "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def finish(self) -> list[dict]:
        """The last block's stop; each block's text, and each tool_use block's input, its arguments read as JSON (the
        text as written where they are not a JSON object: a call cut short)."""
        for block, pieces in zip(self.blocks, self.texts, strict=True):
            if block["type"] != "tool_use":
                block[block["type"]] = "".join(pieces)  # (a text block's "text", a thinking block's "thinking")
            else:
                arguments = "".join(pieces)
                try:
                    value = json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    value = None
                block["input"] = value if isinstance(value, dict) else {"arguments": arguments}
        return self._close()

    def _grow(self, kind: str, empty: dict, delta: dict | None) -> list[dict]:
        """The events that open a block of this kind (unless it is open) and add the delta to it (None: nothing)."""
        events = []
        if self.open != kind:
            events += self._close()
            events += self._start(kind, empty)
        if delta is None:
            return events
        return [*events, {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _start(self, kind: str, block: dict) -> list[dict]:
        self.blocks.append(block)
        self.texts.append([])
        self.open = kind
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        at, events = len(self.blocks) - 1, []
        if self.open == "thinking":  # (signed as it ends, as Anthropic's: the SDK folds the signature_delta in)
            self.blocks[at]["signature"] = uuid.uuid4().hex  # (vLLM's too: a client sends it back, none checks it)
            events.append({"type": "content_block_delta", "index": at,
                           "delta": {"type": "signature_delta", "signature": self.blocks[at]["signature"]}})
        self.open = None
        return [*events, {"type": "content_block_stop", "index": at}]


def stop_fields(engine_finish: str | None, reply_finish: str | None, stop_reason: int | str | None,
                stop_sequences: list[str] | None, named_call: bool = False) -> dict:
    """Anthropic's stop_reason and stop_sequence from the engine's finish reason (max_tokens wherever it cut the
    reply, so whole and streamed agree), the reply's (tool_use where it made calls) and what stopped it. named_call:
    the reply is the call a named tool_choice asked for, which the chat reports as "stop" (as vLLM's) but Anthropic
    as tool_use (the SDK's tool runner runs a turn's tool_use blocks only where it ends so). A sample the engine
    ended ("abort": every token banned) has none: it is no turn ended naturally (end_turn), nor the model declining
    (refusal, which sends clients to a fallback model); null, as vLLM's Messages API tells it."""
    if engine_finish == "abort":
        return {"stop_reason": None, "stop_sequence": None}
    if engine_finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reply_finish == "tool_calls" or named_call:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def usage(turn: ChatTurn) -> dict:
    choice = turn.choices[0]
    return _usage(turn, choice.cached_tokens or 0, len(choice.token_ids))


def start_usage(turn: ChatTurn) -> dict:
    """The usage the stream's message_start tells, before any token is read: the prefix cache's count is the first
    update's, taken as the turn began (as the whole message's usage splits it off)."""
    return _usage(turn, turn.cached_tokens(), 0)


def _usage(turn: ChatTurn, cached: int, generated: int) -> dict:
    """Anthropic's usage: the prompt tokens computed (input_tokens) apart from those read from the prefix cache."""
    return {"input_tokens": len(turn.token_ids[0]) - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": generated}


def error_reply(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status)


def message_routes(start_chat: Callable[[ChatRequest, Any, str], Awaitable[ChatTurn]],
                   render_chat: Callable[[ChatRequest], Awaitable[RenderedChat]], model_name: str) -> APIRouter:
    """start_chat: the chat route's set-up (app.py), which submits a chat request as a turn; render_chat: its
    template and tokenizer alone (count_tokens)."""
    router = APIRouter()

    async def read(request: Request, **defaults: Any) -> MessagesRequest:
        """The body, read here (its fields over `defaults`): every refusal of it in Anthropic's error shape."""
        try:
            payload = await request.json()  # (the app's body check decoded it already: Starlette keeps it)
        except ValueError as exc:  # (JSONDecodeError, and UnicodeDecodeError where the body is no UTF-8)
            raise RequestError(f"the body is not valid JSON ({exc})") from None
        except RecursionError:  # (json.loads past its stack: a body nested some thousands deep)
            raise RequestError("the body is not JSON this server reads: it is nested too deeply") from None
        if not isinstance(payload, dict):
            raise RequestError("the body must be a JSON object")
        try:
            return MessagesRequest.model_validate({**defaults, **payload})
        except ValidationError as exc:
            raise invalid(exc) from None

    @router.post("/v1/messages")
    async def create(request: Request) -> Response:
        try:
            body = await read(request)
            chat = body.chat_request(body.stream)
            rid = f"msg_{request_id(request, chat.request_id)}"
            turn = await start_chat(chat, request, rid)
        except Exception as exc:  # (a refusal, the engine's failure, or a bug's: all in Anthropic's shape)
            return error_reply(*_status(exc, "a request's set-up (before its reply began)"))
        blocks = ContentBlocks(body.shows_thoughts())
        finishes: list[str | None] = [None, None]  # the engine's and the reply's

        async def events() -> AsyncIterator[dict]:
            async for _, u in turn.updates():
                _, delta, reply_finish = turn.apply(u)
                for event in blocks.add(delta):
                    yield event
                if u.finish_reason is not None:
                    finishes[:] = [u.finish_reason, reply_finish]
            for event in blocks.finish():
                yield event

        def message(content: list[dict]) -> dict:
            choice = turn.choices[0]
            return {"id": rid, "type": "message", "role": "assistant", "model": model_name, "content": content,
                    **stop_fields(*finishes, choice.stop_reason, body.stop_sequences, named_call=named_call()),
                    "usage": usage(turn)}

        def named_call() -> bool:
            return turn.replies[0].plan.mode == "named" and any(b["type"] == "tool_use" for b in blocks.blocks)

        if not body.stream:
            try:
                async for _ in events():
                    pass
            except Exception as exc:
                return error_reply(*_status(exc, "a whole reply"))
            finally:
                await turn.stream.aclose()
            if finishes[0] is None:  # (its client went away)
                return Response(status_code=499)
            return JSONResponse(message(blocks.blocks))

        async def stream() -> AsyncIterator[str]:
            start = {"id": rid, "type": "message", "role": "assistant", "model": model_name, "content": [],
                     "stop_reason": None, "stop_sequence": None, "usage": start_usage(turn)}
            yield typed_sse({"type": "message_start", "message": start})
            try:
                async for event in events():
                    yield typed_sse(event)
            except Exception as exc:  # (after the 200: Anthropic's error event ends the stream)
                status, text, _ = stream_failure(exc)
                yield typed_sse(anthropic_error_body(status, text))
                return
            if finishes[0] is None:
                return
            whole = message([])
            yield typed_sse({"type": "message_delta", "delta": {k: whole[k] for k in ("stop_reason", "stop_sequence")},
                             "usage": whole["usage"]})
            yield typed_sse({"type": "message_stop"})

        return EventStream(stream(), turn.stream, guard=None)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        try:  # (counting asks for no reply: max_tokens may be left out)
            body = await read(request, max_tokens=1)
            rendered = await render_chat(body.chat_request(stream=False))
        except Exception as exc:
            return error_reply(*_status(exc, "a token count"))
        return JSONResponse({"input_tokens": len(rendered.token_ids[0])})

    return router


def _status(exc: Exception, what: str) -> tuple[int, str]:
    status, message, _ = stream_failure(exc, what)
    return status, message

