"""The worker's errors: what a client did wrong (ProtocolError, 4xx) or what the worker could not do for an
accepted request (ServiceError, 5xx and 503 back-pressure), and why the worker could not start (ConfigError,
WorkerStartError). Every message is for the user: it says what was wrong and how to fix it. On the wire each
request error becomes OpenAI's error shape `{"error": {...}}` (`ErrorBody`, also the OpenAPI description)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: str
    type: str
    param: str | None = None            # the field that was wrong; null when no single field was
    code: int                           # the HTTP status


class ErrorBody(BaseModel):
    """Every error the worker answers: `{"error": {...}}`, OpenAI's shape."""
    model_config = ConfigDict(extra="allow")
    error: ErrorDetail


def one_line(exc: BaseException, max_chars: int | None = None) -> str:
    """An exception as one line for a log or an answer: its text with whitespace runs folded (its type's name when
    it has none), cut at `max_chars`."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if max_chars is None else text[:max_chars]


class ProtocolError(ValueError):
    """A request the worker cannot accept. `status` is the HTTP status, `param` names the field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=str(self), type=self.code, param=self.param, code=self.status)
        return ErrorBody(error=detail).model_dump(mode="json")


class PromptTooLongError(ProtocolError):
    """A prompt longer than the model reads (its context, or --max-prompt-tokens): refused in `prepare`, before the
    model thread spends anything on it. The message names the size, the limit and by how much it is over; the
    numbers are kept too (tokens, or characters when the text was refused before tokenizing)."""

    def __init__(self, message: str, *, num_tokens: int | None = None, max_tokens: int | None = None,
                 num_chars: int | None = None, max_chars: int | None = None):
        super().__init__(message, status=400, param="messages", code="context_length_exceeded")
        self.num_tokens, self.max_tokens = num_tokens, max_tokens
        self.num_chars, self.max_chars = num_chars, max_chars


class ServiceError(ProtocolError):
    """A request the worker accepted but could not answer (engine failure, timeout, loading, 502 schema)."""

    def __init__(self, message: str, *, status: int, code: str, headers: dict[str, str] | None = None):
        super().__init__(message, status=status, code=code, headers=headers)


class QueueFullError(ServiceError):
    """Back-pressure: the queue of requests waiting for the model is full; the client should retry later."""

    def __init__(self, max_queue: int, retry_after_s: int = 1):
        super().__init__(f"The worker is busy: {max_queue} requests are already waiting for the model "
                         f"(--max-queue {max_queue}); retry in {retry_after_s} s.", status=503, code="queue_full",
                         headers={"Retry-After": str(retry_after_s)})


class TooManyConnectionsError(ServiceError):
    """Back-pressure: more requests are open at once than --max-connections allows."""

    def __init__(self, max_connections: int, retry_after_s: int = 1):
        super().__init__(f"The worker is busy: {max_connections} requests are already open "
                         f"(--max-connections {max_connections}); retry in {retry_after_s} s.", status=503,
                         code="too_many_connections", headers={"Retry-After": str(retry_after_s)})


class CancelledError(ServiceError):
    """The client went away or its request timed out: the row was dropped, never retried."""

    def __init__(self, reason: str):
        super().__init__(f"The request was cancelled ({reason}).", status=499, code="cancelled")


class ConfigError(ValueError):
    """A worker option with a bad value; the message names the flag and what it accepts."""


class WorkerStartError(RuntimeError):
    """The worker could not start or its engine could not load; the message is for the user."""
