"""Msgpack bodies: packing message dataclasses, unpacking untrusted bytes within bounds."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import msgpack

from shared.wire.errors import ErrorCode, ProtocolError

# Largest single array/map/str msgpack may allocate, whatever the body length claims.
_MAX_CONTAINER = 1 << 20


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def to_map(obj: Any) -> dict[str, Any]:
    """A message dataclass as the map msgpack packs: nested messages become maps, everything
    else is passed as it is (msgpack packs lists and dicts of plain values itself).

    Not ``dataclasses.asdict``: that deep-copies every list element (one ``deepcopy`` per token
    id), a visible share of decode's and the detokenizer's CPU under load."""
    cls: Any = type(obj)
    names = _field_names(cls)
    return {name: _plain(getattr(obj, name)) for name in names}


@cache
def _field_names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


_SCALARS = frozenset({int, str, float, bool, bytes, type(None)})


def _plain(value: Any) -> Any:
    kind: Any = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:  # lists of messages are homogeneous here
        item: Any = type(value[0]) if value else None
        if not hasattr(item, "__dataclass_fields__"):
            return value
        return [v.to_dict() for v in value] if _has_own_map(item) else [to_map(v) for v in value]
    if not hasattr(kind, "__dataclass_fields__"):
        return value
    return value.to_dict() if _has_own_map(kind) else to_map(value)


@cache
def _has_own_map(cls: Any) -> bool:
    """A type with its own wire map: SamplingParams and StartInfo leave out the contract's
    additions at their defaults, so their messages read alike to an older consumer."""
    return callable(getattr(cls, "to_dict", None))


def unpack(body: bytes, max_bytes: int) -> Any:
    """Unpack an untrusted body: the size is checked before parsing, containers are capped."""
    if len(body) > max_bytes:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, f"message of {len(body)} bytes exceeds {max_bytes}"
        )
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=_MAX_CONTAINER,
            max_map_len=_MAX_CONTAINER,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types on hostile input
        why = str(exc) or type(exc).__name__
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, f"body is not valid msgpack ({why})"
        ) from None


def expect_map(obj: Any, kind: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{kind} must be a map")
    return obj
