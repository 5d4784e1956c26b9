"""Tool calls read from a streamed reply as they are written, so that a client sees each call's name once it is
known and its arguments as they are generated, as vLLM's streaming tool parsers send them. A reading turns text
into events: ("content", text); ("call", name) where a call begins; ("args", text), more of its arguments.

- The arguments are re-encoded as they come (json_stream.py), so their text is what the whole reply's parse gives.
- A call is sent once its name is read and is one of the request's tools, and its arguments have begun (an object;
  arguments written as a JSON string of one, once that is read).
- What turns out to be no call is sent as content, so nothing the model wrote is lost. Where no call was sent yet,
  that is the whole reply, as a whole reply is read. Otherwise it is the text from where the calls stopped parsing.
- A call begun and then broken off (cut by max_tokens, or bad JSON) keeps what was sent of it. (A whole reply's
  part call comes back as text instead.)
- With parallel_tool_calls false, later calls are read and left out, as a whole reply leaves them out.
Each character is looked at once, whatever was held before it: long runs of whitespace cost no rescans.
"""

from __future__ import annotations

from tpgraph.server.json_stream import WHITESPACE, CallReader
from tpgraph.server.tool_parsers import tag_begun

Event = tuple[str, str]


class CallStream:
    """Call objects and the framing around them, one format per subclass: its _frame reads one character outside a
    call. States every format shares: "lead" (the start), "call" (inside a call object), "after_call", "content"
    (all is content from here) and "end" (the calls have ended: nothing more is read)."""

    ARGS_KEYS = ("parameters", "arguments")
    SEPARATORS = WHITESPACE  # (what may stand after the calls without being content)

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        self.names, self.one_call = names, one_call
        self.state = "lead"
        self.held: list[str] = []  # text neither sent as content nor part of a call sent, a piece a character
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
            elif self.state != "end":
                self.held.append(ch)
                self._frame(ch)
        if self.announced:
            self._arguments()
        return self._take()

    def finish(self) -> list[Event]:
        """What is left when the reply ends: text held back that is no call (separators after calls are none)."""
        held = "".join(self.held)
        if not self.announced and (self.calls == 0 or held.strip(self.SEPARATORS)):
            self._content(held)
        return self._take()

    def _frame(self, ch: str) -> None:
        raise NotImplementedError

    def _begin_call(self) -> None:
        """The "{" just read (held) opens a call object."""
        self.state, self.reader, self.announced = "call", CallReader(self.names, self.ARGS_KEYS), False
        self.reader.feed("{")

    def _call_char(self, ch: str) -> None:
        reader = self.reader
        reader.feed(ch)
        if not self.announced:
            self.held.append(ch)
        if reader.failed:
            # a call not yet sent is content with what was held before it; one sent keeps what it sent
            self._give_up(ch if self.announced else "".join(self.held))
            return
        if reader.ready and not self.announced and not (self.one_call and self.calls):
            self.announced, self.held = True, []  # (a call for certain: it is sent, its text settled)
            self.calls += 1
            self._events.append(("call", reader.name))
        if reader.done:
            if self.announced:
                self._arguments()
            self.reader, self.announced, self.held = None, False, []  # (a call left out is dropped whole)
            self.state = "after_call"

    def _arguments(self) -> None:
        text = self.reader.take_arguments()
        if text:
            self._events.append(("args", text))

    def _give_up(self, rest: str) -> None:
        if self.announced:
            self._arguments()
        self.reader, self.announced, self.held, self.state = None, False, [], "content"
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
    SEPARATORS = WHITESPACE + ";"

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        super().__init__(names, one_call)
        self.head = ""  # the reply's beginning past its leading whitespace, while it may be the tag

    def _frame(self, ch: str) -> None:
        if self.state == "lead":
            if ch in WHITESPACE and not self.head:
                return
            if ch == "{" and not self.head:
                self._begin_call()
                return
            self.head += ch
            if self.head == self.TAG:
                self.state = "after_tag"
            elif not self.TAG.startswith(self.head):
                self._give_up("".join(self.held))
        elif ch == "{":
            self._begin_call()
        elif ch not in (WHITESPACE if self.state == "after_tag" else self.SEPARATORS):  # (calls are `;`-separated)
            self._give_up("".join(self.held))


class HermesStream(CallStream):
    """hermes: `<tool_call>{...}</tool_call>` blocks among content. As a whole reply is read, a stretch of text between
    or after blocks that is only whitespace is no content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        super().__init__(names, one_call)
        self.blank = 0  # (after a block, while the stretch is blank) leading whitespace held
        self.gap_text = False  # the stretch after the last block has text: it is content, whitespace and all
        self.closed = 0  # characters of the closing tag read

    def _frame(self, ch: str) -> None:
        if self.state == "after_call":  # its closing tag, maybe after whitespace
            if ch in WHITESPACE and not self.closed:
                return
            if ch != self.CLOSE[self.closed]:
                self._give_up("".join(self.held))
                return
            self.closed += 1
            if self.closed == len(self.CLOSE):
                self.state, self.held, self.closed, self.blank, self.gap_text = "text", [], 0, 0, False
            return
        if self.state == "open":  # inside the opening tag's block, before its object
            if ch == "{":
                self._begin_call()
            elif ch not in WHITESPACE:
                self._give_up("".join(self.held))
            return
        if self.calls and not self.gap_text:  # after a block: held while blank, or while it may begin the next tag
            if ch in WHITESPACE and self.blank == len(self.held) - 1:
                self.blank += 1
                return
            body = "".join(self.held[self.blank:])
            if body == self.OPEN:
                self.held, self.state = list(self.OPEN), "open"
                return
            if self.OPEN.startswith(body):
                return
            self.gap_text = True
        held = "".join(self.held)  # (short: text is sent as it comes, but for a beginning of the tag)
        opened = held.endswith(self.OPEN)
        keep = len(self.OPEN) if opened else tag_begun(held, self.OPEN)
        self._content(held[:len(held) - keep])
        self.held = list(held[len(held) - keep:])
        if opened:
            self.state = "open"


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
            self.held, self.state = [], "end"
        else:
            self._give_up("".join(self.held))


STREAMS: dict[str, type[CallStream]] = {"llama3_json": Llama3JsonStream, "hermes": HermesStream}
