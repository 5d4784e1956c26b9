"""OpenAI's Responses API (/v1/responses), read as a chat turn: the input items (and, with previous_response_id, the
stored conversation before them) become chat messages, which run through the chat route's own set-up (ChatTurn:
the template, tools, reasoning, structured outputs); the reply's reasoning, text and function calls come back as
output items, whole or as the API's stream of typed events.

What vLLM's Responses API takes beside OpenAI's fields (top_k, min_p, repetition_penalty, seed, stop, ignore_eos,
logit_bias, structured_outputs, ...) is taken here too (SAMPLING_EXTRAS). Refused with a 400 that names it,
not ignored: vLLM's fields the chat route does not serve either (UNSERVED: logprob_token_ids, thinking_token_budget,
structural_tag, ...), non-text input (images, files, audio), hosted tools (web search, file search, MCP, ...),
item references, `conversation` and `prompt` templates. `max_tool_calls` (OpenAI's limit on built-in tool calls,
none of which run here) is taken and echoed back, as vLLM's."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ConfigDict, ValidationError, field_validator

from tpgraph.errors import RequestError
from tpgraph.server.protocol import (
    REASONING_EFFORTS,
    ChatRequest,
    NullMeansDefault,
    _an_integer,
    _not_a_bool,
    forwarded_extras,
    invalid,
)
from tpgraph.server.reasoning import ReasoningReader
from tpgraph.server.reply import Delta

# the include value that asks for the output text's log-probabilities
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# OpenAI's include values (the SDK's ResponseIncludable): the others ask for what this server never makes, and are
# taken (as vLLM takes them); a value not among them is refused, as a typo would give nothing unsaid
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", OUTPUT_LOGPROBS)

# OpenAI's limits on metadata: pairs, a key's characters, a value's
METADATA_LIMITS = (16, 64, 512)

# the values OpenAI takes for the fields a response echoes back (the SDK's Response types read no others)
CHOICES = {"truncation": ("disabled", "auto"),
           "service_tier": ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast"),
           "reasoning.effort": REASONING_EFFORTS,  # (the chat request's reasoning_effort, which it runs as)
           "reasoning.summary": ("auto", "concise", "detailed"),
           "text.verbosity": ("low", "medium", "high")}

TEXT_PART_TYPES = ("input_text", "output_text", "text")
# the id an input item is given where it has none, by its type (OpenAI's prefixes)
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class ResponsesRequest(NullMeansDefault):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    reasoning: dict | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None  # "disabled" (the default) or "auto" (the prompt's last tokens that fit)
    service_tier: str | None = None  # (one of OpenAI's tiers, taken as vLLM's: one tier here)
    max_tool_calls: int | None = None  # (echoed back: it limits built-in tools' calls, and none run here)
    # refused where given (see the module's docstring)
    conversation: Any = None
    prompt: Any = None

    _counts_are_integers = field_validator("max_output_tokens", "top_logprobs", "max_tool_calls",
                                           mode="before")(_an_integer)
    _numbers_are_no_bools = field_validator("temperature", "top_p", mode="before")(_not_a_bool)

    def check(self) -> None:
        """What this server cannot honour, refused by name."""
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise RequestError(f"{name} is not supported by this server's Responses API")
        for name, allowed in CHOICES.items():
            value = self.field(name)
            if value is not None and value not in allowed:
                raise RequestError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.background and not self.store:
            raise RequestError("background needs store: true (a background response is read back by its id)")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise RequestError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        if self.max_tool_calls is not None and self.max_tool_calls < 0:
            raise RequestError(f"max_tool_calls must be >= 0, got {self.max_tool_calls}")
        pairs, key_chars, value_chars = METADATA_LIMITS
        metadata = self.metadata or {}
        if len(metadata) > pairs:
            raise RequestError(f"metadata has {len(metadata)} pairs; OpenAI's limit is {pairs}")
        for key, value in metadata.items():
            if len(key) > key_chars or len(value) > value_chars:
                raise RequestError(f"metadata {key[:key_chars]!r}: keys are at most {key_chars} characters, values "
                                   f"at most {value_chars} (OpenAI's limits)")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise RequestError(f"include[{i}] {value!r} is none of OpenAI's include values "
                                   f"({', '.join(INCLUDABLE)})")

    def field(self, name: str) -> Any:
        """A field's value by its dotted name (None where it or an object above it is not given)."""
        value: Any = self
        for key in name.split("."):
            value = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        return value

    def input_items(self) -> list[dict]:
        """The input as a list of items (a string is one user message), each as OpenAI keeps it for GET
        /v1/responses/{id}/input_items (listed_item)."""
        if isinstance(self.input, str):
            return [listed_item({"role": "user", "content": self.input})]
        if not self.input:
            raise RequestError("input is empty")
        return [listed_item(item) if isinstance(item, dict) else item for item in self.input]

    def logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def chat_request(self, items: list[dict]) -> ChatRequest:
        """The chat request this response runs as: the instructions as a system message, then the items' messages (a
        last assistant message not finished continued)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) \
            + chat_messages(items)
        extras = self.model_extra or {}
        fmt = response_format(self.text)
        if extras.get("structured_outputs") is not None and fmt is not None and fmt["type"] != "text":
            # (as vLLM's: each asks the grammar; the chat's own refusal would name the chat's fields)
            raise RequestError("give one of structured_outputs and text.format (json_object or json_schema), not both")
        body: dict[str, Any] = forwarded_extras(extras)
        body.update(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                    temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                    tools=chat_tools(self.tools), tool_choice=chat_tool_choice(self.tool_choice),
                    parallel_tool_calls=self.parallel_tool_calls, response_format=fmt)
        if self.logprobs():  # (without it, top_logprobs asks for nothing, as vLLM's)
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:  # (the chat request's reasoning_effort: the template gets it, and enable_thinking)
            body["reasoning_effort"] = effort
        if self.truncation == "auto":
            body["truncate_prompt_tokens"] = -1
        if items and continues(items[-1]):
            body.update(add_generation_prompt=False, continue_final_message=True)
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as exc:
            raise invalid(exc) from None


def continues(item: Any) -> bool:
    """Is the input's last item an assistant message or a reasoning item not finished (in_progress or incomplete, as
    a response cut by max_output_tokens leaves it)? Its reply goes on with it, no new turn opened after it (vLLM's
    partial message completion)."""
    if not isinstance(item, dict) or item.get("status") not in ("in_progress", "incomplete"):
        return False
    kind = item.get("type", "message")
    return kind == "reasoning" or kind == "message" and item.get("role") == "assistant"


def listed_item(item: dict) -> dict:
    """An input item in the form OpenAI lists it (the SDK's ResponseItem): with an id (its own, else one made for it,
    named as OpenAI names them), its type, its status, and a message's text as content parts (output_text an
    assistant's, with its annotations), whatever short form the request gave it in."""
    kind = item.get("type", "message" if "role" in item else None)
    out = {"id": item_id(ITEM_ID_PREFIXES.get(kind, "item")), **item}
    if kind == "message":
        out["type"] = "message"
        assistant = item.get("role") == "assistant"
        if isinstance(item.get("content"), str):
            out["content"] = [{"type": "output_text" if assistant else "input_text", "text": item["content"]}]
        if assistant and isinstance(out.get("content"), list):
            out["content"] = [{"annotations": [], **part} if isinstance(part, dict) and part.get("type") ==
                              "output_text" else part for part in out["content"]]
    if kind in ("message", "function_call", "function_call_output"):
        out.setdefault("status", "completed")
    return out


def chat_messages(items: list[Any]) -> list[dict]:
    """Responses input items as chat messages: a message item as itself (its text parts as the chat's), a
    function_call as an assistant's tool call (calls in a row, or after the assistant's text, one message's), a
    function_call_output as a tool message, a reasoning item as the next assistant message's reasoning (dropped where
    no reply follows it directly, as where another message or a call's output comes first: a template renders
    earlier thoughts only beside a reply; a last one not finished is an assistant message of its own, continued)."""
    messages: list[dict] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object (a message or another input item), got {item!r}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, where)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning"] = reasoning
            reasoning = None  # (thoughts no reply followed are dropped: not a later turn's)
            messages.append(message)
        elif kind == "function_call":
            call = _call(item, where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            if reasoning is not None:
                last["reasoning"], reasoning = reasoning, None
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}.call_id must be a string (the call's call_id)")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _parts(output, f"{where}.output")})
            reasoning = None
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        else:
            raise RequestError(f"{where}.type {kind!r} is not supported: give message, function_call, "
                               "function_call_output or reasoning items")
    if reasoning is not None and continues(items[-1]):  # (thoughts not finished: the reply goes on from them)
        messages.append({"role": "assistant", "content": "", "reasoning": reasoning})
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(f"{where}.role must be user, system, developer or assistant, got {role!r}")
    content = item.get("content")
    if role == "assistant":  # (an earlier reply's text, written in pieces: one text)
        return {"role": role, "content": "".join(_texts(content, f"{where}.content"))}
    return {"role": role, "content": _parts(content, f"{where}.content")}


def _parts(content: Any, where: str) -> str | list[dict]:
    """A user's (system's, developer's, a tool output's) content as the chat's: a string, one part's text, or several
    parts as the chat's text parts, as vLLM hands a message item's parts to its chat parser: the template gets them
    joined by newlines, or as parts where it loops over them (glued into one text, "Describe:" ran into the text it
    introduced)."""
    texts = _texts(content, where)
    if isinstance(content, str) or len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _texts(content: Any, where: str) -> list[str]:
    """A content's texts: a string's, or each text part's (input_text, output_text, refusal)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts, got {content!r}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise RequestError(f"{where}[{j}] must be a text part (input_text or output_text, with its text); this "
                               f"server serves a text model, got {part!r}")
    return texts


def _call(item: dict, where: str) -> dict:
    """A function_call item as a chat tool call."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str):
            raise RequestError(f"{where}.{field} must be a string, got {value!r}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its content's reasoning_text parts, else its summary's texts."""
    for field in ("content", "summary"):
        parts = item.get(field) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise RequestError(f"{where}.{field} must be a list of text parts")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) as chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}].type {kind!r} is not supported: this server runs function tools only")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """A Responses tool_choice as the chat's: "auto", "none", "required", or a function named. "auto" is the Responses
    API's default, tools or none (SDKs send it explicitly): it is the chat's default too, not a choice that needs
    tools."""
    if choice == "auto":
        return None
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name"}}, got '
                           f"{choice!r}")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict | None) -> dict | None:
    """text.format as the chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format json_schema needs schema, a JSON schema object")
        if not isinstance(fmt.get("name"), str):  # (OpenAI's: the response echoes the format, name and all)
            raise RequestError("text.format json_schema needs text.format.name, the format's name (a string)")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise RequestError(f"text.format.type must be text, json_object or json_schema, got {kind!r}")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A reply's output items as its deltas come (reasoning, message text, function calls), and the stream's events
    that build them: each item is added, grows, and is done before the next begins. The same fold makes a whole
    response's output, so a response is the same streamed or not (but where a call broke off: a whole "auto" reply
    is then its text, as vLLM's parser reads it, while a stream's item for it, sent as it came, is done "incomplete",
    no call to run)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.pending: list[dict] = []  # log-probability entries not yet given to the text
        self.broken_call: int | None = None  # the call (by its index) that broke off: its item is done "incomplete"
        self.calls = 0  # the function_call items begun
        # the open item's text (a call's: its arguments) in pieces, joined where it is read: += on the item's field
        # copied all of it every token
        self.grown: list[str] = []
        # whitespace written where no message is open (a reasoning model's "\n\n" after its thoughts): held until
        # text follows it (then its message's beginning); beside a call it is no message of its own
        self.held = ""

    def add(self, delta: Delta, entries: list[dict], broken_call: int | None = None) -> list[dict]:
        """What an update added (its delta, and its tokens' log-probability entries): the events it makes.
        broken_call: the reply's call that broke off (ReplyReader.broken_call), once it did."""
        self.broken_call = broken_call
        events: list[dict] = []
        self.pending += entries
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        for part in delta.in_order():  # (as written: a call's last arguments, then the text after it)
            events += self._text(part) if isinstance(part, str) else self._call(part)
        if delta.calls and not delta.content:  # (a call's tokens: none of a text's)
            self.pending = []
        return events

    def retake_text_logprobs(self, tokens: AnswerTokens) -> None:
        """(a reply read whole) Each output text's log-probabilities, its own tokens': its text and calls came at once
        at the end, when every token's entries were pending."""
        self._settle()
        parts = [item["content"][0] for item in self.items if item["type"] == "message"]
        first_call = next((i for i, item in enumerate(self.items) if item["type"] == "function_call"), len(self.items))
        head = sum(item["type"] == "message" for item in self.items[:first_call])
        found = tokens.entries_of([part["text"] for part in parts], head)
        if found is None:  # (a text not found in the answer: left as the fold gave it)
            return
        for part, entries in zip(parts, found, strict=True):
            part["logprobs"] = entries
        self.pending = []

    def current(self) -> list[dict]:
        """The output items as they stand (the open one's text so far written in)."""
        self._settle()
        return list(self.items)

    def release(self) -> list[dict]:
        """(the reply ended) The whitespace still held: a message of its own after no call (a reply's whitespace
        alone), else nothing."""
        if self.held and not (self.items and self.items[-1]["type"] == "function_call"):
            return self._text("", whole=True)
        self.held = ""
        return []

    def finish(self, incomplete: bool) -> list[dict]:
        """The last item's end (its status "incomplete" where the reply was cut short)."""
        events = self.release()
        if self.pending and self.open is not None and self.open["type"] == "message":
            # (tokens that added no text, the end's: their entries in a last delta, so the deltas carry the text's all)
            events += self._text("")
        self.pending = []
        return events + self._close("incomplete" if incomplete else "completed")

    def cut(self) -> None:
        """(the response failed or was cancelled) The item being written done "incomplete": no item of a response
        that is over is still in progress."""
        self.held, self.pending = "", []
        self._close("incomplete")

    def _begin(self, item: dict, part: dict | None) -> list[dict]:
        events = self._close("completed")
        self.items.append(item)
        self.open, self.grown = item, []
        at = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": at,
                       "item": {**item, "content": []} if part is not None else dict(item)})
        if part is not None:
            # (the part as it begins, its lists its own: the item's grow after it, by its first text's entries too)
            begun = {key: list(value) if isinstance(value, list) else value for key, value in part.items()}
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": at,
                           "content_index": 0, "part": begun})
        return events

    def _settle(self) -> None:
        """The open item's text so far written into it (kept as one piece, so the next join copies it once)."""
        item = self.open
        if item is None:
            return
        text = "".join(self.grown)
        self.grown = [text]
        if item["type"] == "function_call":
            item["arguments"] = text
        else:
            item["content"][0]["text"] = text

    def _close(self, status: str) -> list[dict]:
        self._settle()
        item, self.open = self.open, None
        if item is None:
            return []
        at, events = len(self.items) - 1, []
        where = {"item_id": item["id"], "output_index": at}
        if item["type"] == "reasoning":
            part = item["content"][0]
            events += [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part["text"]},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        elif item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                        "logprobs": part["logprobs"]},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        else:
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
            if self.calls - 1 == self.broken_call:  # (no call to run, though its deltas went out)
                status = "incomplete"
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": at, "item": item})
        return events

    def _reasoning(self, text: str) -> list[dict]:
        # (pending is kept: a thought's token brings no entries (ResponseRun._entries), and a token that ends the
        # thoughts and begins the answer brings its entry for the text that follows in the same delta)
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            events += self._begin({"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [part],
                                   "encrypted_content": None, "status": "in_progress"}, part)
        self.grown.append(text)
        return [*events, {"type": "response.reasoning_text.delta", "item_id": self.open["id"],
                          "output_index": len(self.items) - 1, "content_index": 0, "delta": text}]

    def _text(self, text: str, whole: bool = False) -> list[dict]:
        """whole: the held whitespace is a message of its own, whatever comes next (the reply ended)."""
        events = []
        if self.open is None or self.open["type"] != "message":
            if not whole and not (self.held + text).strip():  # (held: a call may come next)
                self.held += text
                return []
            text, self.held = self.held + text, ""
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._begin({"id": item_id("msg"), "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": [part]}, part)
        part = self.open["content"][0]
        entries, self.pending = self.pending, []
        self.grown.append(text)
        part["logprobs"] += entries
        return [*events, {"type": "response.output_text.delta", "item_id": self.open["id"],
                          "output_index": len(self.items) - 1, "content_index": 0, "delta": text,
                          "logprobs": entries}]

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: a call's first (with its id and name) begins a function_call item."""
        events = []
        function = call.get("function", {})
        if "id" in call:
            if self.held:  # (whitespace before the call: no message, nor are its tokens' entries a text's)
                self.held, self.pending = "", []
            events += self._begin({"id": item_id("fc"), "type": "function_call", "call_id": call["id"],
                                   "name": function["name"], "arguments": "", "status": "in_progress"}, None)
            self.calls += 1  # (after _begin: the item it closes is the call before)
        arguments = function.get("arguments") or ""
        if arguments:
            self.grown.append(arguments)
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.open["id"],
                           "output_index": len(self.items) - 1, "delta": arguments})
        return events


class AnswerTokens:
    """A reply's answer as its tokens wrote it: each update's answer text and its log-probability entries (none for a
    thought's: no part of the answer's text), to find each output text's own tokens in."""

    def __init__(self) -> None:
        self.tokens: list[tuple[str, list[dict]]] = []
        self.answer_from = 0  # the first token past the thoughts: those before it give no entries

    def add(self, text: str, entries: list[dict], thought: bool) -> None:
        self.tokens.append((text, entries))
        if thought:  # (what came before the thoughts' end is no answer either; marked, not rewritten every token)
            # (a token that ends the thoughts and writes the answer's first text is the answer's)
            self.answer_from = len(self.tokens) - (1 if text else 0)

    def entries_of(self, texts: list[str], head: int) -> list[list[dict]] | None:
        """Each text's entries (the texts found in order in the answer): those of the tokens whose text falls in it,
        and of the tokens that wrote none there (or after it, where it ends the answer); None where a text is not
        found. head: how many of the texts come before the first call (the others after one)."""
        answer = "".join(t for t, _ in self.tokens)
        spans = _spans(answer, texts, head)
        if spans is None:
            return None
        found: list[list[dict]] = [[] for _ in texts]
        begin = 0
        for n, (text, entries) in enumerate(self.tokens):
            end = begin + len(text)
            at = next((i for i, span in enumerate(spans) if _falls_in(begin, end, span, len(answer))), None)
            if at is not None and n >= self.answer_from:
                found[at] += entries
            begin = end
        return found


def _spans(answer: str, texts: list[str], head: int) -> list[tuple[int, int]] | None:
    """Where the texts stand in the answer, in order: the head's (before any call) found from its start, the others
    from its end, as a call's text before them may write the same words (its arguments); None where one is not."""
    spans: list[tuple[int, int]] = []
    at = 0
    for text in texts[:head]:
        start = answer.find(text, at)
        if start < 0:
            return None
        at = start + len(text)
        spans.append((start, at))
    tail: list[tuple[int, int]] = []
    end = len(answer)
    for text in reversed(texts[head:]):
        start = answer.rfind(text, at, end)
        if start < 0:
            return None
        tail.append((start, start + len(text)))
        end = start
    return spans + tail[::-1]


def _falls_in(begin: int, end: int, span: tuple[int, int], length: int) -> bool:
    """Does a token's text [begin, end) fall in the span? One that wrote none goes with the text it stands in, or with
    the text that ends the answer where it stands at the end (as a streamed text takes the entries that came before
    it, and the last text those of the tokens after it)."""
    start, stop = span
    if begin < end:
        return begin < stop and end > start
    return start <= begin < stop or begin == stop == length


class ThoughtTokens:
    """How many of a reply's tokens are its thoughts (usage's reasoning_tokens): each token written while the reply
    is in its thoughts, a token whose text is held back (it might begin the end tag) or that writes none too; not the
    tags that open and close them (as vLLM's reasoning parsers count them)."""

    def __init__(self, thoughts: ReasoningReader | None) -> None:
        self.thoughts, self.count = thoughts, 0
        self.thinking, self.started = False, False

    def before(self) -> None:
        """(before a token is read) where the reply stands."""
        if self.thoughts is not None:
            self.thinking, self.started = self.thoughts.thinking, self.thoughts.started

    def in_thoughts(self) -> bool:
        """(after before()) Was the reply in its thoughts as the token came?"""
        return self.thinking

    def after(self, text: str) -> None:
        """(once the token of this text is read)"""
        thoughts = self.thoughts
        if thoughts is None or not (self.thinking and thoughts.thinking):  # (the end tag's token closed them)
            return
        if self.started or text.strip() != thoughts.parser.start:  # (the model's own opening tag is none)
            self.count += 1
