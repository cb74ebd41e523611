"""P:D advice (loadtest/serving/pd_advice.py) with synthetic metrics: which stage limits, and the
ratio."""

from __future__ import annotations

import pytest

from loadtest.serving.pd_advice import (
    DECODE_DEPTH,
    FORWARD_S,
    GENERATED,
    KV_USAGE,
    PREFILL_DEPTH,
    RUNNING,
    WAITING,
    Stage,
    advise,
    closest_ratio,
    report,
    stage_windows,
)


def stage(load: float, rate: float = 100.0, grows: float = 0.0, replicas: int = 1) -> Stage:
    """A stage over 10 s whose backlog grows by ``grows`` per second (from none, if it grows;
    else it stays empty)."""
    return Stage(replicas, load, rate, 0.0, 10 * grows, 10.0)


def test_demand_is_load_then_capacity_times_backlog_growth() -> None:
    assert stage(0.5).demand == 0.5  # no backlog: the load is the demand
    assert stage(0.9, rate=100, grows=50).growth == 0.5
    standing = Stage(1, 0.3, 100.0, 500.0, 1000.0, 10.0)  # at capacity, and 50/s short of it
    assert standing.saturated and standing.demand == pytest.approx(1.5)
    draining = Stage(1, 0.9, 100.0, 500.0, 100.0, 10.0)
    assert draining.growth == 0 and draining.demand == 1.0


def test_prefill_bound_workload() -> None:
    advice = advise(stage(0.95, grows=50), stage(0.3))
    assert advice.bottleneck == "prefill"
    assert advice.ratio == "5:1"  # need 1.78 prefill for 0.375 decode


def test_decode_bound_workload() -> None:
    advice = advise(stage(0.2), stage(1.0, rate=40, grows=20))
    assert advice.bottleneck == "decode"
    assert advice.ratio == "1:8"  # need 0.25 prefill for 1.875 decode


def test_balanced_workload_with_replicas() -> None:
    advice = advise(stage(0.8, replicas=2), stage(0.8, replicas=1))
    assert advice.bottleneck == "prefill" and advice.ratio == "2:1"


def test_a_lightly_loaded_system_needs_no_change() -> None:
    advice = advise(stage(0.1), stage(0.2))
    assert advice.bottleneck is None
    assert "no change needed" in report(stage(0.1), stage(0.2), advice, 100.0)


def test_closest_ratio_uses_small_terms() -> None:
    assert closest_ratio(1.0) == (1, 1)
    assert closest_ratio(2.5) == (5, 2)
    assert closest_ratio(0.2) == (1, 5)
    assert closest_ratio(50.0) == (8, 1)  # lopsided: the largest term


def test_stage_windows_from_scrapes() -> None:
    seconds = 10.0
    prefill = [
        [
            {FORWARD_S: 100.0, GENERATED: 1000.0, PREFILL_DEPTH: 200.0, DECODE_DEPTH: 10.0},
            {FORWARD_S: 109.0, GENERATED: 1800.0, PREFILL_DEPTH: 500.0, DECODE_DEPTH: 10.0},
        ]
    ]
    decode = [
        [
            {RUNNING: 20.0, WAITING: 0.0, KV_USAGE: 0.1, GENERATED: 0.0},
            {RUNNING: 40.0, WAITING: 0.0, KV_USAGE: 0.2, GENERATED: 5000.0},
        ]
    ]
    p, d = stage_windows(prefill, decode, seconds, max_num_seqs=128)
    assert p.load == pytest.approx(0.9) and p.rate == 80.0
    assert (p.backlog_start, p.backlog_end) == (200.0, 500.0)
    assert p.saturated and p.demand == pytest.approx(1 + 30 / 80)
    assert d.load == pytest.approx(30 / 128) and d.rate == 80.0  # every handoff was taken
    advice = advise(p, d)
    assert advice.bottleneck == "prefill"
    text = report(p, d, advice, 500.0)
    assert "bottleneck: prefill" in text and f"prefill:decode = {advice.ratio}" in text


def test_decode_load_counts_kv_blocks_and_its_own_backlog() -> None:
    prefill = [[{FORWARD_S: 0.0, GENERATED: 0.0}, {FORWARD_S: 1.0, GENERATED: 500.0}]]
    decode = [
        [
            {RUNNING: 10.0, WAITING: 5.0, KV_USAGE: 1.0, DECODE_DEPTH: 100.0},
            {RUNNING: 10.0, WAITING: 5.0, KV_USAGE: 1.0, DECODE_DEPTH: 300.0},
        ]
    ]
    p, d = stage_windows(prefill, decode, 10.0, max_num_seqs=128)
    assert d.load == 1.0  # the KV cache is full though the batch holds 10 of 128
    assert d.rate == 30.0 and d.growth == pytest.approx(20 / 30)  # 50/s made, 20/s piled up
    assert advise(p, d).bottleneck == "decode"
