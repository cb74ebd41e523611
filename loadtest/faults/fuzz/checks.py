"""What every reply to a fuzz case must satisfy: the client contract (docs/contract.md).

Pure functions over the replies one case got, so the rules are readable in one place and
testable without a broker. Each returns the problems found (empty: the case passed).
"""

from __future__ import annotations

from typing import Any

from loadtest.faults.fuzz.cases import Case
from shared.wire.errors import ErrorCode

ERROR_CODES = frozenset(c.value for c in ErrorCode)
FINISH_REASONS = frozenset({"stop", "length", "cancelled", "timeout"})
TIMING_KEYS = frozenset({"queue_s", "ttft_s", "tpot_s", "e2e_s"})
# A body the parser accepts may still be refused downstream, or run out of time.
ACCEPTED_BUT_REFUSED = frozenset({"invalid_request", "prompt_too_long", "overloaded", "timeout"})


def outcome(reply: dict[str, Any]) -> str:
    """The outcome table's row of a terminal reply."""
    if reply.get("type") == "done":
        return f"done/{reply.get('finish_reason')}"
    return f"error/{reply.get('code')}"


def check_case(case: Case, replies: list[tuple[str | None, dict[str, Any]]]) -> list[str]:
    """``replies``: (AMQP correlation id, decoded body) in arrival order."""
    problems: list[str] = []
    terminals = [r for _, r in replies if r.get("type") in ("done", "error")]
    if len(terminals) != 1:
        return [f"{len(terminals)} terminal replies (types {[r.get('type') for _, r in replies]})"]
    if replies[-1][1] is not terminals[0]:
        problems.append("a reply arrived after the terminal one")
    ids = {case.correlation_id, case.request_id, case.case_id} - {None}
    for corr, reply in replies:
        kind = reply.get("type")
        if kind not in ("token", "done", "error"):
            problems.append(f"reply of unknown type {kind!r}")
        if not isinstance(reply.get("request_id"), str):
            problems.append(f"{kind} reply without a string request_id")
        if case.correlation_id is not None and corr not in ids:
            problems.append(f"{kind} reply with correlation_id {corr!r}, not the request's")
    terminal = terminals[0]
    if terminal["type"] == "error":
        problems += _check_error(case, terminal)
    else:
        problems += _check_done(case, terminal)
        problems += _check_stream(
            case, [r for _, r in replies if r.get("type") == "token"], terminal
        )
    return problems


def _check_error(case: Case, reply: dict[str, Any]) -> list[str]:
    code = reply.get("code")
    if code not in ERROR_CODES:
        return [f"error code {code!r} is not a contract code"]
    problems = [] if isinstance(reply.get("message"), str) else ["error without a message"]
    if case.expected_code is not None and code != case.expected_code:
        problems.append(f"error/{code}, the parser says {case.expected_code}")
    if case.expected_code is None and code not in ACCEPTED_BUT_REFUSED:
        problems.append(f"error/{code} for a valid request: {reply.get('message')!r}")
    return problems


def _check_done(case: Case, reply: dict[str, Any]) -> list[str]:
    if case.expected_code is not None:
        return [f"done, but the parser refuses the body ({case.expected_code})"]
    problems = []
    ids, text, usage = reply.get("token_ids"), reply.get("text"), reply.get("usage")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        problems.append(f"done token_ids {ids!r:.80} are not a list of ints")
        ids = []
    if not isinstance(text, str):
        problems.append("done text is not a string")
    if reply.get("finish_reason") not in FINISH_REASONS:
        problems.append(f"finish_reason {reply.get('finish_reason')!r} not in the contract")
    if (
        not isinstance(usage, dict)
        or type(usage.get("prompt_tokens")) is not int
        or usage["prompt_tokens"] < 1
        or usage.get("completion_tokens") != len(ids)
    ):
        problems.append(f"usage {usage!r} inconsistent with {len(ids)} tokens")
    timing = reply.get("timing")
    if not isinstance(timing, dict) or set(timing) != TIMING_KEYS:
        problems.append(f"timing {timing!r} lacks the contract's keys")
    elif not all(v is None or (isinstance(v, (int, float)) and v >= 0) for v in timing.values()):
        problems.append(f"timing {timing!r} has a negative or non-numeric value")
    if case.request is not None:
        max_tokens = case.request.sampling.max_tokens
        if len(ids) > max_tokens:
            problems.append(f"{len(ids)} tokens, max_tokens was {max_tokens}")
        if reply.get("finish_reason") == "length" and len(ids) != max_tokens:
            problems.append(f"finish_reason length after {len(ids)} of {max_tokens} tokens")
    return problems


def _check_stream(case: Case, tokens: list[dict[str, Any]], done: dict[str, Any]) -> list[str]:
    stream = case.request.stream if case.request is not None else True
    if not stream:
        return [f"{len(tokens)} token replies for stream=false"] if tokens else []
    streamed: list[Any] = []
    for t in tokens:
        if t.get("index") != len(streamed):
            return [f"token reply at index {t.get('index')!r}, expected {len(streamed)}"]
        streamed += t.get("token_ids") or []
    problems = []
    if streamed != done.get("token_ids"):
        problems.append("streamed token_ids do not add up to the done reply's")
    if "".join(str(t.get("text", "")) for t in tokens) != done.get("text"):
        problems.append("streamed text does not add up to the done reply's")
    return problems
