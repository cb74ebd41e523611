"""OpenAI's error JSON and the one table that maps Baton's outcomes onto HTTP statuses.

Every error the gateway answers, whether it found the problem itself (bad JSON, auth, an
unsupported field) or Baton did (an ``error`` reply), is an :class:`ApiError` rendered as
``{"error": {"message", "type", "param", "code"}}``. The mapping lives here and nowhere else so
the docs table (docs/gateway.md) has a single source to agree with.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aio_pika

from shared.client import BatonConnectionLost, BatonUnavailable
from shared.wire.messages import ErrorReply

# Seconds a client should wait before retrying. The tokenizer re-reads the prefill backlog every
# 0.25 s, so an overload clears (or not) within a second; a missing Baton takes longer to appear.
OVERLOADED_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 5

# Baton's request fields whose names the tokenizer's messages start with ("max_tokens must be
# ..."): the error's ``param`` is filled in when a message names one of them.
_PARAMS = frozenset(
    ("prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k",
     "seed", "stop", "ignore_eos", "priority", "timeout_s", "min_p", "repetition_penalty",
     "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids",
     "include_stop_str_in_output", "n")
)  # fmt: skip


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field of a request body: ``default`` when absent or null, else a boolean."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean, got {type(value).__name__}", name)
    return value


def from_error_reply(reply: ErrorReply) -> ApiError:
    """Baton's ``error`` reply → the HTTP error. Unknown codes are server errors (500)."""
    code, message = reply.code, reply.message
    if code == "invalid_request":
        first_word = message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
        return invalid(message, param=first_word if first_word in _PARAMS else None)
    if code == "prompt_too_long":
        # 400 with OpenAI's code for the same condition, which clients already recognise.
        return ApiError(400, message, "invalid_request_error", "context_length_exceeded", "prompt")
    if code == "overloaded":
        # 503, not 429: the whole server is full, this client is not over a rate limit.
        return ApiError(
            503, message, "overloaded_error", "overloaded",
            headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)},
        )  # fmt: skip
    if code == "timeout":
        return ApiError(504, message, "timeout_error", "timeout", "timeout_s")
    return ApiError(500, message, "server_error", code or "internal")


def from_exception(exc: BaseException) -> ApiError | None:
    """What the client library raises instead of a reply → the HTTP error (None: a bug, 500)."""
    if isinstance(exc, asyncio.TimeoutError):
        # No terminal reply within the gateway's wait (Baton's own deadline normally answers
        # first; this is the backstop when a reply never comes). The client library has
        # already published a cancel.
        return ApiError(504, f"no reply from Baton: {exc}", "timeout_error", "timeout")
    if isinstance(exc, (BatonUnavailable, BatonConnectionLost, aio_pika.exceptions.AMQPError)):
        return ApiError(
            503, f"Baton is unavailable: {exc}", "server_error", "unavailable",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        )  # fmt: skip
    return None


def internal(message: str = "internal error in the gateway") -> ApiError:
    return ApiError(500, message, "server_error", "internal")
