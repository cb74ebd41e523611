"""Decode's TPOT slack (DecodeEngine.tpot_slack): how long it may yield to a prefill wave before
a running stream's mean time per output token would pass BATON_SLO_TPOT_S."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shared.engine.decode import DecodeEngine
from shared.runtime import SamplingParams, Sequence


def _running(started_at: float, output_tokens: int) -> Sequence:
    seq = Sequence("r", [5, 6, 7] + [9] * output_tokens, SamplingParams(), num_prompt_tokens=3)
    seq.started_at = started_at
    return seq


def test_slack_is_the_tightest_streams_time_left_under_the_objective() -> None:
    ahead = _running(started_at=10.0, output_tokens=20)  # 20 tokens in 0.5 s: 1.5 s to spare
    behind = _running(started_at=9.0, output_tokens=10)  # 10 tokens in 1.5 s: 0.5 s past it
    engine = SimpleNamespace(scheduler=SimpleNamespace(running={"a": ahead}))
    assert DecodeEngine.tpot_slack(engine, 0.1, now=10.5) == pytest.approx(1.5)  # type: ignore[arg-type]
    engine.scheduler.running["b"] = behind
    assert DecodeEngine.tpot_slack(engine, 0.1, now=10.5) == pytest.approx(-0.5)  # type: ignore[arg-type]
    engine.scheduler.running.clear()
    assert DecodeEngine.tpot_slack(engine, 0.1, now=10.5) == float("inf")  # type: ignore[arg-type]
