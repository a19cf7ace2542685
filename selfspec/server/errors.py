"""Errors answered to clients in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from selfspec.coercion import ConfigTypeError
from selfspec.errors import SelfSpecError


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


def config_error(e: SelfSpecError) -> APIError:
    """The request builder's error as the 400 naming its field: "top_p must be in (0, 1], got
    1.5" -> "'top_p' must be in (0, 1], got 1.5."."""
    name, msg = getattr(e, "field", None), str(e)
    msg = f"'{name}'{msg[len(name):]}" if name and msg.startswith(name + " ") else msg[:1].upper() + msg[1:]
    return bad(f"{msg}.", param=name, code="invalid_type" if isinstance(e, ConfigTypeError) else "invalid_value")


class Cancelled(Exception):
    """Raised inside the engine (from on_event, or between prefill chunks) to abandon a
    generation whose client left."""


class ClientGone(Exception):
    """The client of a request disconnected before its response was complete."""
