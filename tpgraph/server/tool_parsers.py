"""Tool-call parsers for tool_choice "auto": they find the calls a model wrote in its own format in the text it
generated (vLLM's --tool-call-parser names):

- llama3_json: Llama 3.1-3.3's JSON calls. The reply is one or more `{"name": ..., "parameters": {...}}` objects
  (`"arguments"` is taken too), `;`-separated, maybe after `<|python_tag|>`; a reply that begins otherwise is text.
  What follows the calls is dropped: vLLM's parser returns no content beside them.
- hermes: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after text (a last block
  left open is read too); the text before the first is content, and text between and after them is dropped, as
  vLLM's parser keeps only the text before the first <tool_call>.
- pythonic: Llama 3.2's and 4's calls as a Python list, `[get_weather(city="Oslo"), get_time()]` (Llama 4's between
  `<|python_start|>` and `<|python_end|>`): keyword arguments of literal values, parsed with `ast`, never run.

A reply is read as it streams (tool_streams.py), whole or not: one reader, so a reply is the same streamed or whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpgraph.server.tool_streams import CallStream, HermesStream, Llama3JsonStream, PythonicStream


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


class ToolParser:
    name = ""
    keeps_special_tokens = False  # must the text keep special tokens (the parser's markers may be ones)?
    stream: type[CallStream] = CallStream  # the reader of its calls

    def parse(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls): a whole reply's calls as its stream reads them, in order, and the text around them (None
        where there is none). A reply with no call (one to a function not among `names`, the request's tools, is
        none), or that vLLM's parser reads as no call (CallStream.whole_is_text: cut in a call, a call broken off on
        bad JSON, a bad call object after the calls), is content whole, as the server reads a whole "auto" reply
        (reply.py; a stream keeps the calls it sent)."""
        calls = self.stream(names, one_call=False)
        events = calls.read_whole(text)
        if calls.whole_is_text() or not calls.calls:
            return text, []
        named: list[tuple[str, list[str]]] = []
        content = []
        for kind, piece in events:
            if kind == "call":
                named.append((piece, []))
            elif kind == "args":
                named[-1][1].append(piece)
            else:
                content.append(piece)
        return "".join(content) or None, [ParsedCall(name, "".join(args)) for name, args in named]

class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream = Llama3JsonStream


class HermesParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True  # (Hermes checkpoints make <tool_call> a special token)
    stream = HermesStream


class PythonicParser(ToolParser):
    name = "pythonic"
    stream = PythonicStream


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Llama3JsonParser, HermesParser, PythonicParser)}
