"""Every string of a JSON request body must be text UTF-8 can write.

JSON can carry a lone surrogate as an escape ("\\ud800"), which Python decodes into a string no UTF-8 encoder takes.
Anywhere a request's text goes on, it fails late: a reply that echoes it (a request_id, a tool's name, a response's
metadata) cannot be written and becomes a 500 after the request ran, and the tokenizer refuses it (bad_words) inside
the engine. So the server refuses such a body before any route reads it, naming where the string is, for every field
at once.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from tpgraph.errors import RequestError

TEXTUAL = (str, dict, list)  # the JSON values that are or may hold a string
TEXTUAL_SET = frozenset(TEXTUAL)


def lone_surrogate_at(value: Any) -> str | None:
    """Where in a decoded JSON value a string (or an object's key) holds a lone surrogate, as a path such as
    `messages[0].content` (the first in the body's order); None where every string is valid Unicode."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _writable(item):
                return path or "the body"
        elif isinstance(item, dict):  # (pushed last first: the walk takes them in the body's order)
            if any(not _writable(key) for key in item if isinstance(key, str)):
                return f"a key of {path or 'the body'}"
            stack.extend((child, f"{path}.{key}" if path else str(key)) for key, child in reversed(item.items())
                         if isinstance(child, TEXTUAL))
        elif isinstance(item, list) and not TEXTUAL_SET.isdisjoint(map(type, item)):
            # (a list of numbers, a batch's token ids, is passed over at C speed; a number gets no path)
            stack.extend((item[i], f"{path}[{i}]") for i in range(len(item) - 1, -1, -1)
                         if isinstance(item[i], TEXTUAL))
    return None


def _writable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def refuse_lone_surrogates(request: Request) -> None:
    """The app's dependency: a JSON body holding a lone surrogate is a 400 that names the field. A route with a body
    model has FastAPI read and decode the body before its dependencies run, one that reads it itself (the Messages
    API's) has it decoded here; Starlette keeps the decoded JSON for both, so this costs one walk over it. A body that
    is no JSON is left to the route's own refusal."""
    if not await request.body():
        return
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # (RecursionError: nested some thousands deep, past json.loads' stack)
        return
    where = lone_surrogate_at(body)
    if where is not None:
        raise RequestError(f"{where} is not valid Unicode text: it holds a lone surrogate (a \\ud800-\\udfff escape "
                           "that is no half of a pair)")
