"""A chat reply read as it streams: the model's thoughts (reasoning.py), its answer's text, and its tool calls
(tools.py), sent as OpenAI's streamed deltas and folded into the whole message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpgraph.server.reasoning import ReasoningReader
from tpgraph.server.tool_streams import CallStream, Event, RequiredStream
from tpgraph.server.tools import ToolPlan, tool_call_id


@dataclass
class Delta:
    """What a stretch of generated text adds to a reply: reasoning, content, and tool-call deltas (OpenAI's
    streaming form: the first delta of a call carries its index, id, type and name; later ones more of its
    arguments)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)
    reasoning: str = ""
    # the content's texts (str) and the call deltas (dict) in the order they were written, where that is not the
    # content then the calls (a whole reply's, or a piece that ends a call and goes on with text)
    parts: list[str | dict] = field(default_factory=list)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.content + other.content, self.calls + other.calls, self.reasoning + other.reasoning,
                     self.in_order() + other.in_order())

    def in_order(self) -> list[str | dict]:
        """The content's texts and the call deltas, in the order they were written (the thoughts come before both)."""
        return self.parts or ([self.content] if self.content else []) + self.calls

    def fields(self, plain: bool) -> dict:
        """The delta as a streamed chunk's `delta` object. plain: a reply without tools or thoughts sends content
        with every token ("" too, its finish chunk's as well, as vLLM's); otherwise what is held back sends
        nothing."""
        out: dict = {}
        if self.reasoning:
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        if self.content or (plain and not self.reasoning):
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = self.calls
        return out


@dataclass
class ReplyReader:
    """One choice's reply, read as it streams: reasoning (where the server has a reasoning parser), then content
    and tool calls (tools.py says how each tool_choice reads them). stream: the reply is streamed, so "required" and
    "auto" calls are sent as they are written (tool_streams.py); a whole reply reads its calls once it is whole, as a
    stream reads them, so that a reply is the same streamed or whole (a "required" call that broke off is kept as far
    as it went, as a stream cannot take back the part call it sent). But as vLLM's: a whole "auto" reply that vLLM's
    tool parser reads as no call (CallStream.whole_is_text: it ended inside a call, a call broke off on bad JSON, or a
    call object after the calls is bad) is its text, no call; one whose calls are whole finishes "tool_calls" even
    where max_tokens ended it."""

    plan: ToolPlan
    thoughts: ReasoningReader | None = None
    stream: bool = False
    include_reasoning: bool = True  # (false: the thoughts are split out and left out of the reply)
    thoughts_sent: list[str] = field(default_factory=list)  # the reasoning sent, in pieces (as contents)
    pieces: list[str] = field(default_factory=list)  # (a whole reply, "required" or "auto") the answer as it came
    contents: list[str] = field(default_factory=list)  # the content sent, in pieces (+= copied it all every token)
    call_deltas: list[dict] = field(default_factory=list)
    sent_calls: int = 0
    finish_reason: str | None = None
    calls: CallStream | None = None  # (streamed "required" and "auto") the calls as they are written
    broken_call: int | None = None  # the index of a call sent that broke off (its arguments not whole: no call to run)

    def __post_init__(self) -> None:
        if self.stream:
            self.calls = self._call_stream()

    def _call_stream(self) -> CallStream | None:
        """("required" and "auto") a reader of the calls as they are written."""
        plan = self.plan
        kind = RequiredStream if plan.mode == "required" else plan.parser.stream if plan.parser else None
        return None if kind is None else kind(plan.names, plan.one_call)

    def feed(self, text: str) -> Delta:
        """The reply's next text: what it adds to send now."""
        if self.thoughts is None:  # (no thoughts to split out: the answer's delta alone, a token at a time)
            return self._sent(self._feed(text))
        reasoning, text = self.thoughts.feed(text)
        return self._sent(Delta(reasoning=reasoning) + self._feed(text))

    def finish(self, finish_reason: str | None) -> tuple[Delta, str | None]:
        """What is left to send when generation ends, and the finish reason the reply reports."""
        delta = Delta()
        if self.thoughts is not None:
            reasoning, text = self.thoughts.finish()
            delta = Delta(reasoning=reasoning) + self._feed(text)
        rest, self.finish_reason = self._finish(finish_reason)
        return self._sent(delta + rest), self.finish_reason

    def message(self, role: str = "assistant") -> dict:
        """The whole reply as a non-streamed message: content is null beside tool calls where there is none."""
        calls = merge_calls(self.call_deltas)
        message: dict[str, Any] = {"role": role, "content": "".join(self.contents) or self._no_content(calls)}
        if self.thoughts is not None:
            message["reasoning"] = message["reasoning_content"] = "".join(self.thoughts_sent) or None
        if calls:
            message["tool_calls"] = calls
        return message

    def _no_content(self, calls: list[dict]) -> str | None:
        """The content of a reply without any, as vLLM answers: "" beside the calls a named or "required" tool
        choice made (vLLM builds that message with content ""); null beside "auto" calls, or where the server splits
        thoughts out, sent or not; "" for a plain empty reply."""
        if calls and self.plan.mode in ("named", "required"):
            return ""
        return None if calls or self.thoughts is not None else ""

    def _sent(self, delta: Delta) -> Delta:
        if not self.include_reasoning:
            delta.reasoning = ""
        if delta.reasoning:
            self.thoughts_sent.append(delta.reasoning)
        if delta.content:
            self.contents.append(delta.content)
        self.call_deltas += delta.calls
        return delta

    def _feed(self, text: str) -> Delta:
        mode = self.plan.mode
        if mode == "none":  # (nothing reads a plain reply back: it is not kept)
            return Delta(text)
        if mode == "named":
            if not text:  # (the call begins with its arguments' first text: none while a reasoning model thinks)
                return Delta()
            if self.sent_calls == 0:
                self.sent_calls = 1
                return Delta(calls=[{"index": 0, "id": tool_call_id(), "type": "function",
                                     "function": {"name": self.plan.function, "arguments": text}}])
            return Delta(calls=[{"index": 0, "function": {"arguments": text}}])
        if self.calls is not None:
            return self._noted(self.calls, self._events(self.calls.feed(text)))
        self.pieces.append(text)  # (a whole reply is read once it is whole)
        return Delta()

    def _finish(self, finish_reason: str | None) -> tuple[Delta, str | None]:
        mode = self.plan.mode
        if mode in ("none", "named"):  # (all sent as it came; a named reply with no answer text makes no call)
            return Delta(), finish_reason
        if self.calls is not None:
            return self._streamed(self.calls, self.calls.finish(), finish_reason)
        calls = self._call_stream()  # (a whole reply is read once it is whole)
        text = "".join(self.pieces)
        events = calls.read_whole(text)
        if mode == "auto":
            return self._whole_auto(calls, events, text, finish_reason)
        return self._streamed(calls, events, finish_reason)

    def _whole_auto(self, calls: CallStream, events: list[Event], text: str, finish_reason: str | None
                    ) -> tuple[Delta, str | None]:
        """A whole "auto" reply as vLLM's chat_completion_full_generator reads it with its tool parser: one that ended
        inside a call (cut by max_tokens, or an EOS), or whose call broke off on bad JSON (or Python), or that holds
        a bad call object after its calls, parses as no call (CallStream.whole_is_text), so it is its text, with the
        engine's finish reason; calls read whole finish "tool_calls" whatever ended generation (auto_tools_called)."""
        if calls.whole_is_text():
            return Delta(text), finish_reason
        return self._events(events), "tool_calls" if self.sent_calls else finish_reason

    def _streamed(self, calls: CallStream, events: list[Event], finish_reason: str | None
                  ) -> tuple[Delta, str | None]:
        """A call stream's last events, and the reply's finish reason."""
        rest = self._noted(calls, self._events(events))
        # (a call that broke off is no call a client may run: the reply keeps the engine's reason)
        whole = self.sent_calls and not calls.broken
        return rest, "tool_calls" if whole and finish_reason == "stop" else finish_reason

    def _noted(self, calls: CallStream, delta: Delta) -> Delta:
        """The delta, the call that broke off noted (the last sent as the stream saw it break: none follows it)."""
        if calls.broken and self.broken_call is None:
            self.broken_call = self.sent_calls - 1
        return delta

    def _events(self, events: list[Event]) -> Delta:
        """A call stream's events as a delta: a call's first delta carries its index, id and name."""
        delta = Delta()
        for kind, text in events:
            last = delta.parts[-1] if delta.parts else None
            if kind == "content":
                delta.content += text
                delta.parts.append(text)
            elif kind == "call":
                delta.calls.append({"index": self.sent_calls, "id": tool_call_id(), "type": "function",
                                    "function": {"name": text, "arguments": ""}})
                delta.parts.append(delta.calls[-1])
                self.sent_calls += 1
            elif isinstance(last, dict) and last["index"] == self.sent_calls - 1:
                last["function"]["arguments"] += text
            else:
                delta.calls.append({"index": self.sent_calls - 1, "function": {"arguments": text}})
                delta.parts.append(delta.calls[-1])
        return delta


def merge_calls(deltas: list[dict]) -> list[dict]:
    """Streaming tool-call deltas folded into whole calls (a non-streamed reply's message.tool_calls)."""
    calls: dict[int, dict] = {}
    arguments: dict[int, list[str]] = {}  # each call's in pieces, joined once (+= copied them all every delta)
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                             "function": {"name": None, "arguments": ""}})
        fn = d.get("function", {})
        call["function"]["name"] = fn.get("name") or call["function"]["name"]
        arguments.setdefault(d["index"], []).append(fn.get("arguments", ""))
    for i, call in calls.items():
        call["function"]["arguments"] = "".join(arguments[i])
    return [calls[i] for i in sorted(calls)]
