"""Tools a request offers and a reply read through ReplyReader, for the tool-call tests (test_tools.py reads whole
replies; test_tool_streams.py streamed ones against whole)."""

from __future__ import annotations

from tpgraph.server.reply import ReplyReader
from tpgraph.server.tools import ToolPlan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # (no parameters)


def read_reply(p: ToolPlan, pieces: list[str], finish: str = "stop", stream: bool = False
               ) -> tuple[list, dict, str]:
    """Feed the reply's pieces to a reader; returns the deltas it sends (the finish's last), the whole message and the
    finish reason."""
    reader = ReplyReader(p, stream=stream)
    deltas = [reader.feed(piece) for piece in pieces]
    rest, reason = reader.finish(finish)
    return [*deltas, rest], reader.message(), reason
