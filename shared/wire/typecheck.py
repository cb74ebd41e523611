"""Leaf types of a decoded internal message, checked against its dataclass annotations.

msgpack gives back whatever the sender packed, and ``cls(**d)`` checks only the field names: a
list where a ``str`` belongs would travel on into a worker and raise far from the broker (an
unhashable request id in a dict lookup, a string token id in a forward), failing everything
batched with it. Checked here, such a message is refused as malformed and dead-lettered.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

Check = Callable[[Any], bool]


@cache
def _checker(hint: Any) -> Check:
    """A predicate for values of type ``hint``, built once per type (decoding is a hot path)."""
    origin = get_origin(hint)
    if hint is Any:
        return lambda v: True
    if origin in (Union, types.UnionType):
        options = [_checker(arg) for arg in get_args(hint)]
        return lambda v: any(ok(v) for ok in options)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    if hint in (bool, int, str):
        return lambda v: type(v) is hint
    if origin in (list, tuple):
        item = _checker(get_args(hint)[0])
        if get_args(hint)[0] is int:  # token ids: the common, long case
            return lambda v: isinstance(v, (list, tuple)) and all(type(x) is int for x in v)
        return lambda v: isinstance(v, (list, tuple)) and all(item(x) for x in v)
    if origin is dict or hint is dict:
        return lambda v: isinstance(v, dict) and all(type(k) is str for k in v)
    if dataclasses.is_dataclass(hint):
        return lambda v: isinstance(v, hint) and first_mismatch(v) is None  # type: ignore[arg-type]
    return lambda v: True


@cache
def _fields(cls: Any) -> tuple[tuple[str, Check], ...]:
    hints = get_type_hints(cls)
    return tuple((f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls))


def first_mismatch(obj: Any) -> str | None:
    """The first field of dataclass ``obj`` whose value does not have its annotated type."""
    cls: Any = type(obj)
    for name, ok in _fields(cls):
        if not ok(getattr(obj, name)):
            return name
    return None
