"""The API's refusals in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; the Messages API's in
Anthropic's: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": _encodable(message), "type": kind, "param": param, "code": status}}


def _encodable(message: str) -> str:
    # (a message may quote the request, whose JSON may hold a lone surrogate: escaped, else the body cannot be encoded
    # as UTF-8 and the refusal becomes a 500)
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


# Anthropic's error types by HTTP status (another 4xx is an invalid request, a 5xx an api_error)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}
MESSAGES_PATH = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": _encodable(message)}}


def is_messages_path(path: str) -> bool:
    """Is this (a route's path) the Messages API's, whose clients read Anthropic's error shape?"""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def refusal_body(path: str, status: int, message: str, kind: str) -> dict:
    """A refusal of a request for `path` (a route's) in the shape its client reads: Anthropic's under the Messages
    API's path, else OpenAI's (of `kind`)."""
    if is_messages_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, kind)
