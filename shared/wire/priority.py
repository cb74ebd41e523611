"""The contract's priority: an integer 0..9, higher served first (docs/contract.md).

It travels twice: in the body and as the AMQP message priority, so the work queues are declared
with ``x-max-priority`` = ``MAX_PRIORITY + 1`` levels (``queues.py``). The range is written here
only: the tokenizer's validation and the gateway check a client's value with
:func:`check_priority`; an AMQP header's octet and an effective priority (aging, boosts:
``shared/scheduling/priority.py``) become a contract priority through :func:`clamp_priority`.
"""

from __future__ import annotations

import math

from shared.wire.errors import ErrorCode, ProtocolError

MAX_PRIORITY = 9


def check_priority(value: int) -> int:
    """``value`` if it is a contract priority, else an ``invalid_request`` naming the range."""
    if not 0 <= value <= MAX_PRIORITY:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, f"priority must be in [0, {MAX_PRIORITY}], got {value}"
        )
    return value


def clamp_priority(value: float) -> int:
    """The contract priority at or below ``value``: rounded down (a level is earned in full) and
    cut to 0..MAX_PRIORITY."""
    return max(0, min(MAX_PRIORITY, math.floor(value)))
