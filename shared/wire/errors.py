"""Error codes of the client contract and the exception that carries one."""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"
    PROMPT_TOO_LONG = "prompt_too_long"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A message that cannot be served; ``code`` is what the client's error reply says."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
