"""Turn an untrusted client body into a :class:`RequestMsg`, or a :class:`ProtocolError`.

Every rule has a message a person can act on ("top_p must be in (0, 1], got 1.5"). Unknown keys
are ignored so newer clients keep working against older servers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from shared.config import BatonConfig
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.messages import MAX_REQUEST_ID_CHARS, RequestMsg, SamplingParams, unpack
from shared.wire.priority import check_priority, clamp_priority
from shared.wire.sampling import DEFAULT_MAX_TOKENS

_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
_MAX_SEED = (1 << 63) - 1
_MAX_TEMPERATURE = 100.0
_MAX_TIMEOUT_S = 24 * 3600.0
_MAX_REQUEST_ID_BYTES = 255  # an AMQP short string
MAX_STOP_TOKEN_IDS = 128
_MAX_REPETITION_PENALTY = 10.0
_MAX_ABS_PENALTY = 2.0  # presence / frequency: OpenAI's range
MAX_LOGPROBS = 20  # alternatives per token: vLLM's default max_logprobs


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, message)


def _integer(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if v is None:
        return default
    # bool is an int in Python; a client sending true for max_tokens has a bug worth reporting.
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{key} must be an integer, got {type(v).__name__}")
    return v


def _int(d: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = _integer(d, key, default)
    if not lo <= v <= hi:
        raise _bad(f"{key} must be in [{lo}, {hi}], got {v}")
    return v


def _optional_int(d: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    """An integer in ``[lo, hi]``, or None (absent or null: the feature is off)."""
    return None if d.get(key) is None else _int(d, key, lo, lo, hi)


def _float(
    d: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"{key} must be a number, got {type(v).__name__}")
    v = float(v)
    if math.isnan(v) or math.isinf(v) or v > hi or v < lo or (lo_open and v == lo):
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"{key} must be in {interval}, got {v}")
    return v


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{key} must be a boolean, got {type(v).__name__}")
    return v


def parse_request_map(d: Any, config: BatonConfig) -> RequestMsg:
    if not isinstance(d, dict):
        raise _bad(f"request body must be a msgpack map, got {type(d).__name__}")
    rid = d.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise _bad("request_id is required and must be a non-empty string")
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise _bad(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    # Replies carry it as their AMQP correlation_id, a short string: a longer one can never be
    # published, and the detokenizer would retry that reply forever (found by loadtest.faults.fuzz).
    if len(rid.encode("utf-8", "surrogatepass")) > _MAX_REQUEST_ID_BYTES:
        raise _bad(f"request_id is longer than {_MAX_REQUEST_ID_BYTES} bytes in UTF-8")

    given = [k for k in _PROMPT_FIELDS if d.get(k) is not None]
    if len(given) != 1:
        raise _bad(
            "exactly one of prompt, messages, prompt_token_ids is required, got "
            + (", ".join(given) if given else "none")
        )
    prompt = messages = token_ids = None
    if "prompt" in given:
        prompt = d["prompt"]
        if not isinstance(prompt, str):
            raise _bad(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise _bad("prompt must not be empty")
    elif "messages" in given:
        messages = _parse_messages(d["messages"])
    else:
        token_ids = _parse_token_ids(d["prompt_token_ids"], config)

    max_tokens = _int(d, "max_tokens", DEFAULT_MAX_TOKENS, 1, config.max_tokens_limit)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(d, "temperature", 0.0, 0.0, _MAX_TEMPERATURE),
        top_p=_float(d, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(d, "top_k", 0, 0, 1 << 20),
        seed=None if d.get("seed") is None else _int(d, "seed", 0, 0, _MAX_SEED),
        ignore_eos=_bool(d, "ignore_eos", False),
        min_p=_float(d, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_float(
            d, "repetition_penalty", 1.0, 0.0, _MAX_REPETITION_PENALTY, lo_open=True
        ),
        presence_penalty=_float(d, "presence_penalty", 0.0, -_MAX_ABS_PENALTY, _MAX_ABS_PENALTY),
        frequency_penalty=_float(d, "frequency_penalty", 0.0, -_MAX_ABS_PENALTY, _MAX_ABS_PENALTY),
        # As vLLM: more than max_tokens could never be met.
        min_tokens=_int(d, "min_tokens", 0, 0, max_tokens),
        stop_token_ids=_parse_stop_token_ids(d.get("stop_token_ids")),
        logprobs=_optional_int(d, "logprobs", 0, MAX_LOGPROBS),
        prompt_logprobs=_optional_int(d, "prompt_logprobs", 0, MAX_LOGPROBS),
        n=_int(d, "n", 1, 1, config.max_n),
    )
    timeout_s = d.get("timeout_s")
    if timeout_s is not None:
        timeout_s = _float(d, "timeout_s", 0.0, 0.0, _MAX_TIMEOUT_S, lo_open=True)
    return RequestMsg(
        request_id=rid,
        sampling=sampling,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=token_ids,
        stop=_parse_stop(d.get("stop"), config),
        stream=_bool(d, "stream", True),
        priority=check_priority(_integer(d, "priority", 0)),
        timeout_s=timeout_s,
        batch_replies=_bool(d, "batch_replies", False),
        include_stop_str_in_output=_bool(d, "include_stop_str_in_output", False),
    )


def parse_request(
    body: bytes, config: BatonConfig, header_priority: int | None = None
) -> RequestMsg:
    """Parse a request body. Its ``priority`` is the body's when the body has the field (even
    0: a body saying 0 overrides the header), else the AMQP ``header_priority`` clamped to 0..9,
    else 0."""
    d = unpack(body, config.max_message_bytes)
    req = parse_request_map(d, config)
    if d.get("priority") is None and header_priority is not None:
        req = replace(req, priority=clamp_priority(header_priority))
    return req


def _parse_messages(v: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(v, list) or not v:
        raise _bad("messages must be a non-empty list of {role, content} maps")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be a map with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a non-empty string")
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string")
        out.append((role, content))
    return tuple(out)


def _parse_token_ids(v: Any, config: BatonConfig) -> tuple[int, ...]:
    if not isinstance(v, list) or not v:
        raise _bad("prompt_token_ids must be a non-empty list of integers")
    if len(v) > config.max_prompt_tokens:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt has {len(v)} tokens, the limit is {config.max_prompt_tokens}",
        )
    if not all(type(t) is int for t in v):
        raise _bad("prompt_token_ids must contain only integers")
    # The vocabulary bound is checked by the tokenizer service, which knows the vocab size.
    return tuple(v)


def _parse_stop(v: Any, config: BatonConfig) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise _bad("stop must be a list of strings")
    if len(v) > config.max_stop_strings:
        raise _bad(f"stop has {len(v)} strings, the limit is {config.max_stop_strings}")
    for s in v:
        if not isinstance(s, str) or not s:
            raise _bad("stop must contain only non-empty strings")
        if len(s) > config.max_stop_chars:
            raise _bad(f"a stop string is longer than {config.max_stop_chars} characters")
    return tuple(v)


def _parse_stop_token_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _bad("stop_token_ids must be a list of integers")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"stop_token_ids has {len(v)} ids, the limit is {MAX_STOP_TOKEN_IDS}")
    if not all(type(t) is int and t >= 0 for t in v):
        raise _bad("stop_token_ids must contain only non-negative integers")
    # The vocabulary bound is checked by the tokenizer service, as for prompt_token_ids.
    return tuple(dict.fromkeys(v))
