"""Errors as OpenAI shapes them: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from starlette.responses import JSONResponse

# HTTP status -> OpenAI's error `type` for it.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Anything the server answers with an error status; raised anywhere under a route."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.err_type = err_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class EngineDeadError(APIError):
    def __init__(self, reason: str) -> None:
        super().__init__(503, f"the engine loop has stopped ({reason}); restart the server", code="engine_dead")


class QueueFullError(APIError):
    def __init__(self, waiting: int, limit: int, retry_after: int, adding: int = 1) -> None:
        extra = f" and this request would add {adding}" if adding > 1 else ""
        super().__init__(
            429, f"server is at capacity: {waiting} requests already wait to be scheduled{extra} (--max-waiting "
                 f"{limit}); retry after {retry_after}s", code="queue_full", headers={"Retry-After": str(retry_after)})
