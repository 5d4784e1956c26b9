"""Tool calls read from a streamed reply as they are written, so that a client sees each call's name once it is
known and its arguments as they are generated, as vLLM's streaming tool parsers send them. A reading turns text
into events: ("content", text); ("call", name) where a call begins; ("args", text), more of its arguments.

- The arguments are re-encoded as they come (json_stream.py), so their text is what the whole reply's parse gives.
- A call is sent once its name is read and is one of the request's tools, and its arguments have begun.
- What turns out to be no call is sent as content, so nothing the model wrote is lost. Where no call was sent yet,
  that is the whole reply, as a whole reply is read. Otherwise it is the text from where the calls stopped parsing.
- A call begun and then broken off (cut by max_tokens, or bad JSON) keeps what was sent of it. (A whole reply's
  part call comes back as text instead.)
"""

from __future__ import annotations

from tpgraph.server.json_stream import WHITESPACE, CallReader
from tpgraph.server.tool_parsers import tag_begun

Event = tuple[str, str]


class CallStream:
    """Call objects and the framing around them, one format per subclass: its _frame reads one character outside a
    call. States every format shares: "lead" (the start), "call" (inside a call object), "content" (all is content
    from here) and "drop" (the calls have ended; with parallel_tool_calls false, after the one call)."""

    ARGS_KEYS = ("parameters", "arguments")

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        self.names, self.one_call = names, one_call
        self.state = "lead"
        self.unsettled = ""  # text neither sent as content nor part of a call sent
        self.reader: CallReader | None = None
        self.announced = False  # is the call being read sent?
        self.calls = 0
        self._events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        for ch in text:
            if self.state == "content":
                self._content(ch)
            elif self.state == "call":
                self._call_char(ch)
            elif self.state != "drop":
                self.unsettled += ch
                self._frame(ch)
        if self.announced:
            self._arguments()
        return self._take()

    def finish(self) -> list[Event]:
        """What is left when the reply ends: text held back that is no call (whitespace after calls is none)."""
        if not self.announced and (self.calls == 0 or self.unsettled.strip()):
            self._content(self.unsettled)
        return self._take()

    def _frame(self, ch: str) -> None:
        raise NotImplementedError

    def _begin_call(self) -> None:
        """The "{" just read (in unsettled) opens a call object."""
        self.state, self.reader, self.announced = "call", CallReader(self.names, self.ARGS_KEYS), False
        self.reader.feed("{")

    def _call_char(self, ch: str) -> None:
        reader = self.reader
        reader.feed(ch)
        if not self.announced:
            self.unsettled += ch
            if reader.ready:  # (a call for certain: it is sent, and its text settled)
                self.announced, self.unsettled = True, ""
                self.calls += 1
                self._events.append(("call", reader.name))
        if reader.failed:
            # a call not yet sent is content with what was held before it; one sent keeps what it sent
            self._give_up(ch if self.announced else self.unsettled)
        elif reader.done:
            self._arguments()
            self.reader, self.announced, self.unsettled = None, False, ""
            self.state = "drop" if self.one_call else "after_call"

    def _arguments(self) -> None:
        text = self.reader.take_arguments()
        if text:
            self._events.append(("args", text))

    def _give_up(self, rest: str) -> None:
        if self.announced:
            self._arguments()
        self.reader, self.announced, self.unsettled, self.state = None, False, "", "content"
        self._content(rest)

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._events and self._events[-1][0] == "content":
            self._events[-1] = ("content", self._events[-1][1] + text)
        else:
            self._events.append(("content", text))

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


class Llama3JsonStream(CallStream):
    """llama3_json: `{...}; {...}`, maybe after `<|python_tag|>`; a reply that begins otherwise is content."""

    TAG = "<|python_tag|>"

    def _frame(self, ch: str) -> None:
        if self.state == "lead":
            head = self.unsettled.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
            elif self.TAG.startswith(head):
                return  # (maybe the tag, not whole yet)
            if head == "{":
                self._begin_call()
            elif head:
                self._give_up(self.unsettled)
        elif ch == "{":
            self._begin_call()
        elif ch not in WHITESPACE and ch != ";":  # (calls are `;`-separated)
            self._give_up(self.unsettled)


class HermesStream(CallStream):
    """hermes: `<tool_call>{...}</tool_call>` blocks among content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _frame(self, ch: str) -> None:
        if self.state in ("lead", "text"):  # content, held back where it may begin the tag
            opened = self.unsettled.endswith(self.OPEN)
            keep = len(self.OPEN) if opened else tag_begun(self.unsettled, self.OPEN)
            ready, held = self.unsettled[:len(self.unsettled) - keep], self.unsettled[len(self.unsettled) - keep:]
            if self.calls and not ready.strip():  # (whitespace between blocks is no content: held, then dropped)
                if not opened:
                    return
                ready = ""
            self._content(ready)
            self.unsettled = held
            if opened:
                self.state = "open"
        elif self.state == "open":
            if ch == "{":
                self._begin_call()
            elif ch not in WHITESPACE:
                self._give_up(self.unsettled)
        else:  # after a call: its closing tag
            tail = self.unsettled.lstrip()
            if tail == self.CLOSE:
                self.unsettled, self.state = "", "text"
            elif not self.CLOSE.startswith(tail):
                self._give_up(self.unsettled)


class RequiredStream(CallStream):
    """tool_choice "required": the grammar's `[{"name": ..., "parameters": {...}}, ...]`."""

    ARGS_KEYS = ("parameters",)

    def _frame(self, ch: str) -> None:
        if ch in WHITESPACE:
            return
        if self.state == "lead" and ch == "[" or self.state == "after_call" and ch == ",":
            self.state = "element"
        elif self.state == "element" and ch == "{":
            self._begin_call()
        elif self.state == "after_call" and ch == "]":
            self.unsettled, self.state = "", "drop"
        else:
            self._give_up(self.unsettled)


STREAMS: dict[str, type[CallStream]] = {"llama3_json": Llama3JsonStream, "hermes": HermesStream}
