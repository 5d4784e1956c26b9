"""The API's refusals in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    # (a message may quote the request, whose JSON may hold a lone surrogate: escaped, else the body cannot be encoded
    # as UTF-8 and the refusal becomes a 500)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
