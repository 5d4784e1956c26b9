"""Tool calls read from a reply as they are written, so that a client sees each call's name once it is known and its
arguments as they are generated, as vLLM's streaming tool parsers send them. A whole (non-streamed) reply is read by
the same reader, fed in one piece (read_whole), so that a reply is the same streamed or whole (but where vLLM's whole
"auto" reply differs: reply.py, whole_is_text). A reading turns text into events: ("content", text); ("call", name)
where a call begins; ("args", text), more of its arguments.

- JSON arguments are re-encoded as they come (json_stream.py), in the form json.dumps gives; pythonic ones are
  written as JSON a keyword argument at a time.
- A call is sent once its name is read and is one of the request's tools, and its arguments have begun (an object;
  arguments written as a JSON string of one, once that is read; a pythonic call's first keyword argument, read).
- What turns out to be no call is sent as content, so nothing the model wrote is lost. Where no call was sent yet,
  that is the whole reply. Otherwise it is the text from where the calls stopped parsing; but llama3_json and hermes
  drop what follows whole calls, as vLLM's parsers return no content after them (CONTENT_AFTER_CALLS).
- A call begun and then broken off (cut by max_tokens or an EOS, or bad JSON) keeps what was sent of it: deltas
  cannot be taken back. Its arguments are left as the model wrote them (no JSON is made up to close them), and the
  reply's finish_reason is then never "tool_calls", which tells a client its calls are whole: "length" where
  max_tokens cut it, as OpenAI reports a cut call, "stop" where the model stopped.
- With parallel_tool_calls false, later calls are read and left out.
Each character is looked at once, whatever was held before it: long runs of whitespace cost no rescans.
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
import warnings

from tpgraph.server.json_stream import WHITESPACE, CallReader

Event = tuple[str, str]
PY_SPACE = " \t\n\r\x0c"  # Python's whitespace between tokens (around a whole reply, str.strip takes any)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def tag_begun(text: str, tag: str) -> int:
    """How many characters at text's end could begin `tag` (held back while streaming, until it is told)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def parse_expression(text: str) -> ast.expr:
    """A Python expression's tree, parsed and never run, without the warnings some literals raise (a model's odd
    escapes would print them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(text, mode="eval").body


class CallStream:
    """Call objects and the framing around them, one format per subclass: its _frame reads one character outside a
    call. States every format shares: "lead" (the start), "call" (inside a call object), "after_call", "content"
    (all is content from here) and "end" (the calls have ended: nothing more is read)."""

    ARGS_KEYS = ("parameters", "arguments")
    SEPARATORS: str | None = WHITESPACE  # (what may stand after the calls without being content; None: whitespace)
    CONTENT_AFTER_CALLS = True  # is what follows whole calls, and is no call, content? (else it is dropped)

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        self.names, self.one_call = names, one_call
        self.state = "lead"
        self.held: list[str] = []  # text neither sent as content nor part of a call sent, a piece a character
        self.reader: CallReader | None = None
        self.announced = False  # is the call being read sent?
        self.calls = 0
        self.broken = False  # a call sent broke off: its arguments are not whole
        self.spoiled = False  # a call object (or block) after whole calls was no JSON, or no call (but for its name)
        self._events: list[Event] = []
        self._text: list[str] = []  # content after the last event, in pieces (joined once, as it is taken)

    def feed(self, text: str) -> list[Event]:
        at = 0
        while at < len(text):
            if self.state == "content":  # (all is content from here: the rest at once)
                self._content(text[at:])
                break
            if self.state == "end":  # (nothing more is read: the rest is not looked at a character at a time)
                break
            plain = self._plain(text, at)
            if plain:
                self._content(text[at:at + plain])
                at += plain
                continue
            ch = text[at]
            at += 1
            if self.state == "call":
                self._call_char(ch)
            else:
                self.held.append(ch)
                self._frame(ch)
        if self.announced:
            self._arguments()
        return self._take()

    def finish(self) -> list[Event]:
        """What is left when the reply ends: text held back that is no call (separators after calls are none)."""
        self._broken_off()  # (a call sent and not ended: cut)
        if self.announced and self.reader is not None:  # (what its arguments held back is content)
            self._content(self.reader.pending)
        held = "".join(self.held)
        # (a whole reply is str.strip()ped: any whitespace may end it, past the separators; after whole calls, what
        # was held, a call object or block cut before it was sent among it, is content only where such text is)
        if not self.announced and (self.calls == 0 or self.CONTENT_AFTER_CALLS
                                   and held.rstrip().strip(self.SEPARATORS)):
            self._content(held)
        return self._take()

    def read_whole(self, text: str) -> list[Event]:
        """A whole reply's events: those of its text fed in one piece, then finished. (A reply that cannot hold a
        call is content at once: no need to read a long JSON answer a character at a time.)"""
        if not self.may_call(text):
            return [("content", text)] if text else []
        return self.feed(text) + self.finish()

    def ended_in_call(self) -> bool:
        """(once the reply is read) Did it end inside a call, cut by max_tokens or an EOS? vLLM's whole-reply parsers
        then parse no call (json.loads, raw_decode or the pythonic list fail on it), and return the text."""
        return self.state == "call"

    def whole_is_text(self) -> bool:
        """(once the reply is read whole) Do vLLM's whole-reply parsers read it as no call, the model's text? Where
        it ended inside a call, where a call broke off on bad JSON, or where a call object after calls was no JSON,
        or no call (json.loads, raw_decode or obj["name"] fail on it; a name not offered they would take)."""
        return self.ended_in_call() or self.broken or self.calls > 0 and self.spoiled

    def may_call(self, text: str) -> bool:
        """Could the whole text hold a call? Its name is a JSON string: where no escape is written that could spell
        one of the tools' names otherwise (\\u, \\/), a name that needs none stands in the text as written, quoted."""
        return "\\u" in text or "\\/" in text or any(
            not n.isprintable() or '"' in n or "\\" in n or f'"{n}"' in text for n in self.names)

    def _frame(self, ch: str) -> None:
        raise NotImplementedError

    def _plain(self, text: str, at: int) -> int:
        """How many characters from `at` are content whatever they are, to be sent at once (a whole reply is fed in
        one piece)."""
        return 0

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
            self._broken_off()
            self.spoiled |= not reader.unoffered
            self._give_up(reader.rest if self.announced else "".join(self.held))
            return
        if reader.ready and not self.announced and not (self.one_call and self.calls):
            self.announced, self.held = True, []  # (a call for certain: it is sent, its text settled)
            self.calls += 1
            self._event("call", reader.name)
        if reader.done:
            if self.announced:
                self._arguments()
            self.reader, self.announced, self.held = None, False, []  # (a call left out is dropped whole)
            self.state = "after_call"

    def _broken_off(self) -> None:
        """The call being read ends here: is a call sent without its whole arguments?"""
        self.broken |= self.announced and not (self.reader is not None and self.reader.args_done)

    def _arguments(self) -> None:
        if self.reader is None:  # (pythonic calls send their arguments as each is read)
            return
        text = self.reader.take_arguments()
        if text:
            self._event("args", text)

    def _give_up(self, rest: str) -> None:
        if self.announced:
            self._arguments()
        elif self.calls and not self.CONTENT_AFTER_CALLS:  # (after whole calls: the calls have ended, nothing is kept)
            self.reader, self.held, self.state = None, [], "end"
            return
        self.reader, self.announced, self.held, self.state = None, False, [], "content"
        self._content(rest)

    def _content(self, text: str) -> None:
        if text:
            self._text.append(text)

    def _event(self, kind: str, text: str) -> None:
        self._flush_content()
        self._events.append((kind, text))

    def _flush_content(self) -> None:
        if self._text:
            self._events.append(("content", "".join(self._text)))
            self._text = []

    def _take(self) -> list[Event]:
        self._flush_content()
        events, self._events = self._events, []
        return events


class Llama3JsonStream(CallStream):
    """llama3_json: `{...}; {...}`, maybe after `<|python_tag|>`; a reply that begins otherwise is content. What
    follows whole calls and is no call is dropped, as vLLM's parser returns no content beside its calls (its stream
    sends nothing past the `;`-separated objects)."""

    TAG = "<|python_tag|>"
    SEPARATORS = WHITESPACE + ";"
    CONTENT_AFTER_CALLS = False

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        super().__init__(names, one_call)
        self.head = ""  # the reply's beginning past its leading whitespace, while it may be the tag
        self.spaced = False  # (after a call) whitespace no separator was read: only the reply's end may follow

    def _frame(self, ch: str) -> None:
        # a whole reply is str.strip()ped and the tag str.lstrip()ped: any whitespace, not only JSON's, at either end
        if self.state == "lead":
            if ch.isspace() and not self.head:
                return
            if ch == "{" and not self.head:
                self._begin_call()
                return
            self.head += ch
            if self.head == self.TAG:
                self.state = "after_tag"
            elif not self.TAG.startswith(self.head):
                self._give_up("".join(self.held))
        elif self.state == "after_tag":
            if ch == "{":
                self._begin_call()
            elif not ch.isspace():
                self._give_up("".join(self.held))
        elif ch == "{" and not self.spaced:
            self._begin_call()
        elif not ch.isspace() and (self.spaced or ch not in self.SEPARATORS):  # (calls are `;`-separated)
            self._give_up("".join(self.held))
        elif ch not in self.SEPARATORS:
            self.spaced = True  # (between calls it is no separator: a call or `;` after it is text)


class HermesStream(CallStream):
    """hermes: `<tool_call>{...}</tool_call>` blocks after content. Text between or after the blocks, once a call was
    read whole, is no content (later blocks are still calls), as vLLM's parser keeps only the text before the first
    <tool_call>; a block that is no call ends the calls there."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    CONTENT_AFTER_CALLS = False

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        super().__init__(names, one_call)
        self.blank = 0  # (after a block, while the stretch is blank) leading whitespace held
        self.gap_text = False  # the stretch after the last block has text: it is content, whitespace and all
        self.closed = 0  # characters of the closing tag read

    def ended_in_call(self) -> bool:
        # (a block opened and not closed: vLLM's json.loads of what follows its <tool_call>, to the end, fails, on a
        # cut end tag too)
        return self.state in ("call", "open") or self.state == "after_call" and self.closed > 0

    def _content(self, text: str) -> None:
        if not (self.calls and self.state == "text"):  # (text between or after the blocks: dropped)
            super()._content(text)

    def _plain(self, text: str, at: int) -> int:
        # (in text, nothing held: up to a "<", which may begin the tag)
        if self.state not in ("lead", "text") or self.held or self.calls and not self.gap_text:
            return 0
        end = text.find("<", at)
        return (len(text) if end < 0 else end) - at

    def _frame(self, ch: str) -> None:
        if self.state == "after_call":  # its closing tag, maybe after whitespace
            if ch in WHITESPACE and not self.closed:
                return
            if ch != self.CLOSE[self.closed]:
                self.spoiled = True  # (the block holds more than its object: vLLM's json.loads of it fails)
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
                self.spoiled = True  # (a block of no JSON object)
                self._give_up("".join(self.held))
            return
        if self.calls and not self.gap_text:  # after a block: held while blank, or while it may begin the next tag
            if ch.isspace() and self.blank == len(self.held) - 1:  # (blank as str.strip() finds it, a whole reply)
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

    def finish(self) -> list[Event]:
        self.held = list(self._past_separator("".join(self.held)))
        return super().finish()

    def _give_up(self, rest: str) -> None:
        super()._give_up(rest if self.announced else self._past_separator(rest))

    def _past_separator(self, held: str) -> str:
        """Text held after a call, from where the content begins: past the whitespace and comma between calls, which
        are no content."""
        if not self.calls or self.announced:
            return held
        rest = held.lstrip(WHITESPACE)
        return rest[1:].lstrip(WHITESPACE) if rest.startswith(",") else rest

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


class PythonScanner:
    """Where a Python expression's text stands, a character at a time: inside a string literal (single or triple
    quoted, escapes honoured) or not, and how deep in brackets."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""  # the open string's quote ("'", '"', or three of either)
        self.escaped = False
        self.run = 0  # quotes in a row: at an opening, two may be an empty string or the start of a triple
        self.run_char = ""
        self.closing = 0  # (in a triple-quoted string) its quote character seen in a row
        self.comment = False  # inside a "#" comment, to the line's end

    def step(self, ch: str) -> None:
        if self.run:  # an opening quote run: what follows decides it
            if ch == self.run_char and self.run < 3:
                self.run += 1
                if self.run == 3:
                    self.quote, self.run, self.closing = ch * 3, 0, 0
                return
            if self.run == 1:  # a one-quote string, this its first character
                self.quote, self.run = self.run_char, 0
                self._in_string(ch)
                return
            self.run = 0  # two quotes: an empty string, closed; this character stands outside it
        if self.comment:
            self.comment = ch not in "\n\r"  # (a lone \r ends a line too, as Python reads it)
        elif self.quote:
            self._in_string(ch)
        elif ch == "#":
            self.comment = True
        elif ch in "'\"":
            self.run, self.run_char = 1, ch
        elif ch in "([{":
            self.depth += 1
        elif ch in ")]}":
            self.depth -= 1

    def _in_string(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
            self.closing = 0
        elif ch == "\\":
            self.escaped = True
            self.closing = 0
        elif len(self.quote) == 1:
            if ch == self.quote:
                self.quote = ""
        elif ch == self.quote[0]:
            self.closing += 1
            if self.closing == 3:
                self.quote = ""
        else:
            self.closing = 0

    def top_level(self, ch: str) -> bool:
        """Would ch stand outside every string and bracket? (Two quotes followed by another character were an empty
        string.)"""
        if self.run == 2 and ch != self.run_char:
            self.run = 0
        return not self.quote and not self.run and not self.comment and self.depth == 0


class PythonicStream(CallStream):
    """pythonic: `[get_weather(city="Oslo"), get_time()]`, maybe between `<|python_start|>` and `<|python_end|>`.
    Each keyword argument is read once it is whole: parsed with `ast`, never run, its literal value written as JSON.
    A call is sent with its first argument (or at its ")" where it has none), its name one of the tools; its other
    arguments follow as each is read. A keyword given twice ends the calls, as Python refuses it. A call that
    breaks off after an argument was sent is closed, so its arguments stay a JSON object (one cut by max_tokens is
    not), yet it is no whole call: the reply does not finish "tool_calls"."""

    TAG, END = "<|python_start|>", "<|python_end|>"  # (Llama 4's)
    SEPARATORS = None  # (any whitespace, as str.strip takes it around a whole reply)

    def __init__(self, names: frozenset[str], one_call: bool) -> None:
        super().__init__(names, one_call)
        self.head = ""  # (lead) the reply's beginning past whitespace, while it may be the tag
        self.name = ""  # the call's name being read (as written; once read, as Python reads it, NFKC)
        self.decomposed = tuple(unicodedata.normalize("NFKD", n) for n in names)  # (what a name read may begin)
        self.name_done = False  # whitespace came after the name: only "(" may follow
        self.arg: list[str] = []  # the keyword argument being read
        self.keys: set[str] = set()  # the call's keywords so far
        self.scan = PythonScanner()
        self.end_at = 0  # characters of the closing tag read
        self.comment = False  # inside a "#" comment between calls, to its line's end
        self.continued = False  # a backslash between calls: a line continuation, if a line's end follows
        self.parens = [0, 0]  # parentheses around the call being read (ast drops them): opened, closed

    def may_call(self, text: str) -> bool:
        return True  # (a name may be written in other forms Python reads as the same, NFKC: "ｇet" is "get")

    def ended_in_call(self) -> bool:
        return self.state in ("list", "next", "args", "after_call")  # (the list not closed: vLLM's parse fails)

    def finish(self) -> list[Event]:
        if self.state == "args" and self.announced:  # a call cut off: its argument not read whole is content
            self._content("".join(self.arg))
        return super().finish()

    def _frame(self, ch: str) -> None:
        state = self.state
        if self.comment:  # (ast skips it, as whitespace)
            self.comment = ch not in "\n\r"
            return
        if self.continued:  # (ast reads a backslash and a line's end as whitespace)
            self.continued = False
            if ch in "\n\r":
                self.name_done = state != "after_call" and bool(self.name)
            else:
                self._give_up("".join(self.held))
            return
        if ch in "#\\" and state in ("list", "next", "after_call"):
            self.comment, self.continued = ch == "#", ch == "\\"
            self.name_done = state != "after_call" and bool(self.name)  # (after a name, only "(" may follow)
            return
        if state == "lead":
            if ch.isspace() and self.head in ("", self.TAG):
                return
            if ch == "[" and self.head in ("", self.TAG):
                self.state = "list"
                return
            self.head += ch
            if not self.TAG.startswith(self.head):
                self._give_up("".join(self.held))
        elif state in ("list", "next"):
            if ch in PY_SPACE and not self.name:
                return
            if ch in PY_SPACE:
                self.name_done = True
                return
            if ch == "(" and not self.name or ch == ")" and self.name and self.parens[1] < self.parens[0]:
                self.parens["()".index(ch)] += 1  # (around the call, or its name: "(get_time)()")
                self.name_done = bool(self.name)
                return
            name = unicodedata.normalize("NFKC", self.name)  # (as Python reads an identifier: "ｇet" is "get")
            if ch == "(" and self.name.isidentifier() and name in self.names:
                self.state, self.arg, self.keys, self.scan = "args", [], set(), PythonScanner()
                self.name, self.name_done = name, False
            elif ("_" + ch).isidentifier() and not self.name_done and any(
                    n.startswith(unicodedata.normalize("NFKD", self.name + ch)) for n in self.decomposed):
                self.name += ch
            elif ch == "]" and state == "next" and not self.name and not self.parens[0]:  # (a trailing comma)
                self.state, self.held = "closed", []
            else:  # (an empty list, a name not offered, or no call)
                self._give_up("".join(self.held))
        elif state == "args":
            if self.announced:
                self.held.clear()  # (a call sent: its text is settled)
            if ch not in ",)" or not self.scan.top_level(ch):
                self.scan.step(ch)
                self.arg.append(ch)
                if self.scan.depth < 0:
                    self._fail("")
                return
            if not self._argument(last=ch == ")"):
                self._fail(ch)
        elif state == "after_call":
            if ch == ")" and self.parens[1] < self.parens[0]:
                self.parens[1] += 1
            elif ch in ",]" and self.parens[1] < self.parens[0]:  # (a tuple, or a bracket not closed: no call)
                self._give_up("".join(self.held))
            elif ch == ",":
                self.state, self.name, self.parens = "next", "", [0, 0]
            elif ch == "]":
                self.state, self.held = "closed", []
            elif ch not in PY_SPACE:
                self._give_up("".join(self.held))
        elif ch.isspace() and self.end_at in (0, len(self.END)):  # closed: whitespace, maybe Llama 4's end tag
            return
        elif self.end_at < len(self.END) and ch == self.END[self.end_at]:
            self.end_at += 1
            if self.end_at == len(self.END):
                self.held = []
        else:
            self._give_up("".join(self.held))

    def _fail(self, ch: str) -> None:
        """No call after all (at ch, not in arg yet): where one was sent, what is left of it is content; else all that
        was held."""
        if self.announced:  # (its arguments closed: what was sent of them stays a JSON object)
            self._event("args", "}")
            self.broken = True  # (yet not the call the model wrote: no "tool_calls" finish, as a JSON call's)
        self._give_up("".join(self.arg) + ch if self.announced else "".join(self.held))

    def _argument(self, last: bool) -> bool:
        """The keyword argument just ended (at "," or, last, at ")"): sent; False where it is none."""
        text = "".join(self.arg).strip()
        try:  # (parsed, never run)
            call = parse_expression(f"f({text}\n)") if text else None
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return False
        if call is not None and (call.args or call.keywords):  # (comments and line continuations alone are none)
            try:
                (keyword,) = call.keywords
                # (TypeError, ValueError: a value JSON has no form for, a set or NaN; a lone surrogate, which UTF-8
                # cannot encode raw, is written as an escape)
                entry = LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(
                    {keyword.arg: ast.literal_eval(keyword.value)}, ensure_ascii=False, allow_nan=False))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, ArithmeticError):
                return False
            if call.args or keyword.arg is None or keyword.arg in self.keys:
                return False
            self._send(("{" if not self.keys else ", ") + entry[1:-1])  # ("key": value, as json.dumps writes it)
            self.keys.add(keyword.arg)
        elif not last:  # (an empty argument; one after a trailing comma, or in "f()", is none)
            return False
        self.arg = []
        if last:
            self._send("}" if self.keys else "{}")
            self.state, self.announced, self.held = "after_call", False, []
        return True

    def _send(self, text: str) -> None:
        """Arguments' text; a call's first is sent with its name (a later call, with parallel_tool_calls false, is
        read and left out)."""
        if self.one_call and self.calls and not self.announced:
            return
        if not self.announced:
            self.announced, self.held = True, []
            self.calls += 1
            self._event("call", self.name)
        self._event("args", text)

