"""Errors answered to clients in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param=None, code=None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


class Cancelled(Exception):
    """Raised inside the engine (from on_event, or between prefill chunks) to abandon a
    generation whose client left."""


class ClientGone(Exception):
    """The client of a request disconnected before its response was complete."""
