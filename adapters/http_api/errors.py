"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""

from __future__ import annotations

from typing import Any

from chatcore.errors import ChatcoreError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(ChatcoreError):
    """A request that gets an error response; ``str(error)`` is the message."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, retry: bool = True
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.retry = retry  # False: the same request would fail the same way (sent as x-should-retry)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, str(self), self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
