"""JSON read a character at a time, for tool calls: a value re-encoded as it arrives, in the form
`json.dumps(json.loads(text), ensure_ascii=False)` gives the whole, and a call object `{"name": ..., "parameters":
{...}}` whose arguments are sent as they come. Where they differ: a key given twice is written twice (json.loads
keeps the last; a stream sends the first before it reads the second), and a lone surrogate written as an escape stays
one. Raw control characters in strings (a tab, as models write) are taken; NaN, Infinity and a number past a float's
range are refused (JSON has no form for them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
LITERALS = ("true", "false", "null")
NUMBER_CHARS = frozenset("-+.eE0123456789")
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
# a call's values nested deeper are refused (Python's json.loads, a client's too, stops near 1000)
MAX_DEPTH = 512


def encode_char(ch: str) -> str:
    """One decoded string character as json.dumps(ensure_ascii=False) writes it (a lone surrogate escaped, so the
    text stays encodable as UTF-8)."""
    code = ord(ch)
    if 0xD800 <= code <= 0xDFFF:
        return f"\\u{code:04x}"
    return json.dumps(ch)[1:-1] if ch in '"\\' or code < 0x20 else ch


class Reencoder:
    """One JSON value, fed a character at a time; `take()` returns the re-encoded text so far (what is certain:
    a number is written when it ends). feed() returns False for a character that is not the value's (the one
    after a number or a literal ends it); `done` once the value is whole; `failed` where the text is no JSON."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.expect = "value"  # value, key, colon, next (a comma or the close), or first_value/first_key
        self.in_string = False
        self.escape = ""  # an escape begun in a string ("\\", "\\u12", ...)
        self.high = ""  # a high surrogate waiting for its low half
        self.high_raw = ""  # ... as it was written ("\\ud83d")
        self.token: list[str] = []  # a number or a literal being read, a character a piece (joined once, as it ends)
        self._key = False  # is the string being read an object's key?
        self.done = self.failed = False
        self.rest = ""  # (failed) the text from where it stopped being JSON, as written: none of it was output

    @property
    def pending(self) -> str:
        """The text read and not yet output, as written (a number, an escape, a high surrogate's): where the text
        breaks off here, it is no part of the output."""
        return self.high_raw + self.escape + "".join(self.token)

    def take(self) -> str:
        text, self.out = "".join(self.out), []
        return text

    def feed(self, ch: str) -> bool:
        if self.done or self.failed:
            return False
        if self.in_string:
            self._string(ch)
            return True
        if self.token:
            if ch in NUMBER_CHARS or ch.isalpha():
                return self._token_char(ch)
            self._end_token()
            if self.failed:
                self.rest += ch  # (the token, then the character that ended it)
            if self.done or self.failed:
                return False
        if ch in WHITESPACE:
            return True
        expect = self.expect
        if expect in ("value", "first_value") or (expect in ("key", "first_key") and ch == '"'):
            if expect == "first_value" and ch == "]":
                return self._close(ch)
            self._value(ch, key=expect in ("key", "first_key"))
        elif expect == "first_key" and ch == "}":
            return self._close(ch)
        elif expect == "colon" and ch == ":":
            self.out.append(": ")
            self.expect = "value"
        elif expect == "next" and ch == ",":
            self.out.append(", ")
            self.expect = "key" if self.stack[-1] == "{" else "value"
        elif expect == "next" and ch in "]}":
            return self._close(ch)
        else:
            self._fail(ch)
        return not self.failed

    def _fail(self, rest: str) -> None:
        self.failed, self.rest = True, rest

    def _value(self, ch: str, key: bool) -> None:
        if ch == '"':
            self.in_string, self._key = True, key
            self.out.append('"')
        elif key:
            self._fail(ch)
        elif ch in "{[":
            if len(self.stack) == MAX_DEPTH:
                self._fail(ch)
                return
            self.stack.append(ch)
            self.out.append(ch)
            self.expect = "first_key" if ch == "{" else "first_value"
        elif ch in NUMBER_CHARS or ch.isalpha():
            self._token_char(ch)
        else:
            self._fail(ch)

    def _token_char(self, ch: str) -> bool:
        """ch is the number's or literal's next character: False where no JSON value begins so any more (a word that
        begins no literal, a letter in a number), which fails at once, as no character after it can mend it."""
        self.token.append(ch)
        if self.token[0].isalpha():  # (true, false or null: a word longer than these fails here)
            word = "".join(self.token)
            may_be = any(literal.startswith(word) for literal in LITERALS)
        else:
            may_be = ch in NUMBER_CHARS
        if not may_be:
            self._fail("".join(self.token))
        return may_be

    def _close(self, ch: str) -> bool:
        if not self.stack or "{[".index(self.stack[-1]) != "}]".index(ch):
            self._fail(ch)
            return False
        self.stack.pop()
        self.out.append(ch)
        self._value_ended()
        return True

    def _value_ended(self, key: bool = False) -> None:
        if key:
            self.expect = "colon"
        elif self.stack:
            self.expect = "next"
        else:
            self.done = True

    def _end_token(self) -> None:
        token, self.token = "".join(self.token), []
        if token in LITERALS:
            self.out.append(token)
        else:
            try:
                value = json.loads(token)
            except ValueError:  # (not a number; NaN and Infinity, which JSON has not, too)
                self._fail(token)
                return
            if not isinstance(value, int | float) or isinstance(value, float) and not math.isfinite(value):
                self._fail(token)
                return
            self.out.append(json.dumps(value))
        self._value_ended()

    def end(self) -> None:
        """The text has ended: a number or literal standing alone is whole."""
        if self.token:
            self._end_token()

    def _string(self, ch: str) -> None:
        if self.escape:
            self.escape += ch
            if self.escape.startswith("\\u"):
                if len(self.escape) < 6:
                    return
                raw, self.escape = self.escape, ""
                if not all(c in HEX_DIGITS for c in raw[2:]):
                    self._fail(self.high_raw + raw)
                    return
                self._char(chr(int(raw[2:], 16)), raw)
            elif ch in SIMPLE_ESCAPES:
                self.escape = ""
                self._char(SIMPLE_ESCAPES[ch], "\\" + ch)
            else:
                self._fail(self.high_raw + self.escape)
            return
        if ch == "\\":
            self.escape = "\\"
        elif ch == '"':
            self._flush_high()
            self.in_string = False
            self.out.append('"')
            self._value_ended(self._key)
        else:
            self._char(ch, ch)

    def _char(self, ch: str, raw: str) -> None:
        """A decoded character (raw: as written): surrogate halves written as \\u escapes join into one character,
        as json.loads joins them."""
        if self.high:
            if 0xDC00 <= ord(ch) <= 0xDFFF:
                ch = chr(0x10000 + ((ord(self.high) - 0xD800) << 10) + (ord(ch) - 0xDC00))
                self.high = self.high_raw = ""
            else:
                self._flush_high()
        if 0xD800 <= ord(ch) <= 0xDBFF:
            self.high, self.high_raw = ch, raw
            return
        self.out.append(encode_char(ch))

    def _flush_high(self) -> None:
        if self.high:
            self.out.append(encode_char(self.high))
            self.high = self.high_raw = ""


def object_text(text: str) -> str | None:
    """JSON text of an object (arguments written as a JSON string of one), re-encoded as a stream re-encodes it; None
    where it is no object."""
    reader = Reencoder()
    body = text.strip(WHITESPACE)
    if not body.startswith("{") or not all(reader.feed(ch) for ch in body) or not reader.done:
        return None
    return reader.take()


@dataclass
class CallReader:
    """One call object, `{"name": "f", "parameters": {...}}` (the first of args_keys written is the arguments; a
    name or arguments given again are skipped: the first was sent before the second was read), fed a character at a
    time. Once it is `ready`, `take_arguments()` gives the arguments' re-encoded text as it comes; arguments written
    before the name wait for it. `failed`: no call (bad JSON, a name not offered, no arguments, or arguments that are
    no object)."""

    names: frozenset[str]
    args_keys: tuple[str, ...] = ("parameters", "arguments")
    name: str | None = None
    done: bool = False
    failed: bool = False
    unoffered: bool = False  # (failed) for a name the request's tools do not have, and only so
    started: bool = False  # past the object's "{"
    value: Reencoder | None = None  # the key or value being read
    role: str = ""  # what `value` is: "key", "name", "args", "args_text" (a JSON string of them), "skip"
    key: str = ""
    expect: str = "first_key"  # first_key, key, colon, value, next
    args: list[str] = field(default_factory=list)  # arguments' text not yet taken
    args_seen: bool = False  # an arguments key was read (a second is skipped)
    name_seen: bool = False  # a name key was read (a second is skipped)
    has_args: bool = False  # arguments that are a call's: an object begun, or a JSON string of one read
    args_done: bool = False  # the arguments are whole (the object closed, or the JSON string of one read)
    rest: str = ""  # (failed) the text from where it stopped being a call, as written, that no argument took

    @property
    def pending(self) -> str:
        """The arguments' text read and not yet given (a number, an escape), as written: where the call is cut here,
        it is no part of them."""
        return self.value.pending if self.value is not None and self.role == "args" else ""

    @property
    def ready(self) -> bool:
        """Is this a call for certain (its name read and offered, its arguments begun)? (A call object without
        arguments is none.)"""
        return self.name is not None and self.has_args

    def take_arguments(self) -> str:
        if not self.ready:
            return ""
        text, self.args = "".join(self.args), []
        return text

    def feed(self, ch: str) -> bool:
        """False where the character is past the object (it has ended) or where the call failed."""
        if self.done or self.failed:
            return False
        if not self.started:
            if ch in WHITESPACE:
                return True
            self.started = True
            self.failed = ch != "{"
            return not self.failed
        if self.value is not None:
            consumed = self.value.feed(ch)
            self._collect()
            if self.value.failed:
                self.failed, self.rest = True, self.value.rest
                return False
            if self.value.done:
                self._value_done()
            if consumed:
                return True
        if ch in WHITESPACE:
            return True
        if self.expect in ("first_key", "key") and ch == '"':
            self._begin("key", ch)
        elif self.expect == "first_key" and ch == "}" or self.expect == "next" and ch == "}":
            self._close()
        elif self.expect == "colon" and ch == ":":
            self.expect = "value"
        elif self.expect == "next" and ch == ",":
            self.expect = "key"
        elif self.expect == "value":
            if self.key in self.args_keys and not self.args_seen:
                self.args_seen = True
                role = "args" if ch == "{" else "args_text" if ch == '"' else ""
                self.has_args = role == "args"
            elif self.key == "name" and not self.name_seen:
                self.name_seen = True
                role = "name" if ch == '"' else ""
            else:
                role = "skip"
            if not role:  # (arguments must be an object or a JSON string of one; a name, a string)
                self.failed, self.rest = True, ch
                return False
            self._begin(role, ch)
        else:
            self.failed, self.rest = True, ch
        return not self.failed

    def _begin(self, role: str, ch: str) -> None:
        self.role, self.value = role, Reencoder()
        self.value.feed(ch)
        self._collect()

    def _collect(self) -> None:
        if self.role == "args":
            self.args.append(self.value.take())

    def _value_done(self) -> None:
        value, role, self.value = self.value, self.role, None
        self.expect = "next"
        if role == "key":
            self.key, self.expect = json.loads("".join(value.out)), "colon"
        elif role == "name":
            name = json.loads("".join(value.out))
            if name not in self.names:
                self.failed = self.unoffered = True
            else:
                self.name = name
        elif role == "args":
            self.args_done = True
        elif role == "args_text":  # (arguments written as a JSON string: sent whole, once read)
            text = object_text(json.loads("".join(value.out)))
            if text is None:
                self.failed = True
            else:
                self.args.append(text)
                self.has_args = self.args_done = True

    def _close(self) -> None:
        self.done = True
        self.failed = not self.ready
