"""BATON_STEP_TRACE: the engine loop's spans written as JSON lines, and the summary read back."""

from __future__ import annotations

from pathlib import Path

from loadtest.serving.step_trace import read, summarize
from services.shell.step_trace import StepTrace


def test_trace_off_writes_nothing(tmp_path: Path) -> None:
    trace = StepTrace("", "decode")
    with trace.span("idle"):
        pass
    trace.record("step", 0.0, 1.0)
    assert not trace and list(tmp_path.iterdir()) == []


def test_spans_and_steps_summarized(tmp_path: Path) -> None:
    trace = StepTrace(str(tmp_path / "t-{service}.jsonl"), "decode")
    # Two steps of 2 ms with a 3 ms gap in which the loop published for 1 ms, then a yield.
    trace.record("step", 10.000, 10.002, forward_s=0.0015, seqs=4, tokens=4, threads=2)
    trace.record("publish", 10.002, 10.003)
    trace.record("step", 10.005, 10.007, forward_s=0.0015, seqs=4, tokens=4, threads=2)
    trace.record("yield", 10.007, 10.010, running=4)
    with trace.span("idle"):
        pass
    trace.close()
    summary = summarize(read(tmp_path / "t-decode.jsonl"))
    assert summary["steps"] == 2 and summary["seqs_mean"] == 4
    assert abs(summary["gap_ms_mean"] - 3.0) < 1e-6
    assert abs(summary["step_ms_mean"] - 2.0) < 1e-6
    assert abs(summary["forward_ms_mean"] - 1.5) < 1e-6
    share = summary["share"]
    assert abs(share["step"] - 0.4) < 1e-6 and abs(share["yield"] - 0.3) < 1e-6
    assert abs(summary["loop_share"] - 0.2) < 1e-6  # 10.003 -> 10.005: the loop's own time
