"""The scheduling policy with synthetic numbers: admission from both backlogs, the deadline by
length, prefill's window, slow-down and pause, decode's prefetch from its free slots."""

from __future__ import annotations

import pytest

from shared.config import BatonConfig
from shared.engine.load import EngineLoad
from shared.flow_control.policy import (
    MAX_BATCHES_AHEAD,
    SLOW_FROM,
    DeadlineSource,
    Intake,
    SchedulingPolicy,
    prefill_window,
    prefill_window_cap,
)
from shared.wire.queues import DECODE_QUEUE, PREFILL_QUEUE, REQUESTS_QUEUE

MB = 1 << 20


def policy(**config: object) -> SchedulingPolicy:
    return SchedulingPolicy(BatonConfig(**config))  # type: ignore[arg-type]


def idle_load(free_blocks: int = 10_000) -> EngineLoad:
    return EngineLoad(num_free_blocks=free_blocks)


# --- admission --------------------------------------------------------------------------------


def test_admits_until_a_backlog_is_polled() -> None:
    assert policy(max_prefill_backlog=0).admission().admit  # no reading yet: no guess


@pytest.mark.parametrize(
    ("prefill", "decode", "admit", "stage"),
    [
        (9, 99, True, None),
        (10, 0, False, "prefill"),
        (0, 100, False, "decode"),
        (500, 500, False, "prefill"),
    ],
)
def test_overloaded_when_either_backlog_is_at_its_limit(
    prefill: int, decode: int, admit: bool, stage: str | None
) -> None:
    p = policy(max_prefill_backlog=10, max_decode_backlog=100)
    p.observe_depths({PREFILL_QUEUE: prefill, DECODE_QUEUE: decode, REQUESTS_QUEUE: 7})
    decision = p.admission()
    assert decision.admit is admit
    if stage is not None:
        assert decision.reason is not None and f"{stage} backlog" in decision.reason


def test_a_missing_depth_keeps_its_last_reading() -> None:
    p = policy(max_prefill_backlog=10)
    p.observe_depths({PREFILL_QUEUE: 12, DECODE_QUEUE: 0})
    p.observe_depths({DECODE_QUEUE: 3})
    assert p.prefill_backlog == 12 and p.decode_backlog == 3 and not p.admission().admit


# --- deadlines by length ----------------------------------------------------------------------


def test_default_deadline_grows_with_prompt_and_output_length() -> None:
    p = policy(
        default_timeout_base_s=10.0,
        default_timeout_per_prompt_token_s=0.01,
        default_timeout_per_output_token_s=0.5,
    )
    assert p.default_timeout_s(0, 0) == 10.0
    assert p.default_timeout_s(1000, 16) == pytest.approx(10.0 + 10.0 + 8.0)
    d = p.deadline(1000.0, None, 1000, 16)
    assert d.source is DeadlineSource.DEFAULT and d.at == pytest.approx(1028.0)


def test_the_client_timeout_shortens_the_default_never_extends_it() -> None:
    p = policy(default_timeout_base_s=10.0, default_timeout_per_output_token_s=0.0)
    shorter = p.deadline(100.0, 3.0, 50, 16)
    assert shorter.at == 103.0 and shorter.seconds == 3.0
    assert shorter.source is DeadlineSource.CLIENT
    longer = p.deadline(100.0, 3600.0, 50, 16)
    assert longer.source is DeadlineSource.DEFAULT and longer.at == pytest.approx(110.5)


def test_base_zero_turns_the_default_off() -> None:
    p = policy(default_timeout_base_s=0.0)
    assert p.default_timeout_s(5000, 5000) is None
    none = p.deadline(100.0, None, 5000, 5000)
    assert none.at is None and none.source is DeadlineSource.NONE
    client = p.deadline(100.0, 2.5, 5000, 5000)
    assert client.at == 102.5 and client.source is DeadlineSource.CLIENT


def test_the_defaults_are_generous() -> None:
    """Nothing that finished before has a deadline now that cuts it short on this machine: a
    4k-token generation of a 1.5k-token prompt gets over 18 minutes."""
    p = policy()
    assert p.default_timeout_s(1536, 4096) == pytest.approx(120 + 15.36 + 1024)
    assert p.default_timeout_s(1, 16) == pytest.approx(124.01)


# --- prefill: window, slow-down, pause --------------------------------------------------------


def test_prefill_window_is_the_batch_in_the_forward_and_those_ahead() -> None:
    p = policy(max_num_batched_tokens=2048, prefill_max_num_seqs=64, block_size=16)
    cap = prefill_window_cap(p.config)
    assert cap == 128 and p.prefill_intake(idle_load()).prefetch == cap  # nothing known yet
    for _ in range(5):
        p.observe_step(0.01, num_seqs=4, num_scheduled_tokens=2048)  # 512 tokens a prompt
    assert p.prefill_batch_capacity(idle_load()) == 4
    assert p.prefill_batches_ahead() == 1  # nothing released yet: one batch ahead
    intake = p.prefill_intake(idle_load())
    assert intake.state is Intake.OPEN and intake.prefetch == prefill_window(4, 1) == 8
    for _ in range(30):  # a step's inputs are acked 35 ms after it: 4 batches of 10 ms ahead
        p.observe_release(0.035)
    assert p.prefill_batches_ahead() == 4 and p.prefill_intake(idle_load()).prefetch == 20
    for _ in range(60):  # prefix-cache hits: a prompt costs the forward 16 tokens
        p.observe_step(0.01, num_seqs=64, num_scheduled_tokens=64 * 16)
    assert p.prefill_batch_capacity(idle_load()) == 64
    assert p.prefill_intake(idle_load()).prefetch == cap  # 64 * 5, capped


def test_prefill_batches_ahead_are_bounded() -> None:
    p = policy()
    p.observe_step(0.001, num_seqs=1, num_scheduled_tokens=10)
    p.observe_release(10.0)
    assert p.prefill_batches_ahead() == MAX_BATCHES_AHEAD


def test_prefill_window_shrinks_with_free_kv_blocks() -> None:
    p = policy(max_num_batched_tokens=2048, prefill_max_num_seqs=64, block_size=16)
    p.observe_step(0.01, num_seqs=1, num_scheduled_tokens=128)  # 8 blocks each; budget: 16
    assert p.prefill_batch_capacity(idle_load(free_blocks=10_000)) == 16
    assert p.prefill_batch_capacity(idle_load(free_blocks=24)) == 3
    assert p.prefill_batch_capacity(idle_load(free_blocks=0)) == 1  # never zero


def test_prefill_slows_then_pauses_as_decode_backlog_fills_and_resumes_below_90pct() -> None:
    p = policy(prefill_pause_decode_backlog=100, prefill_max_num_seqs=64)
    load = idle_load()
    full = p.prefill_intake(load).prefetch
    p.observe_depths({DECODE_QUEUE: int(100 * SLOW_FROM)})
    assert p.prefill_intake(load).state is Intake.OPEN
    p.observe_depths({DECODE_QUEUE: 75})
    slowed = p.prefill_intake(load)
    assert slowed.state is Intake.SLOWED and slowed.prefetch == round(full / 2)
    assert slowed.pressure == 0.75
    p.observe_depths({DECODE_QUEUE: 99})
    assert p.prefill_intake(load).prefetch == 3  # 128 * 0.02, rounded
    p.observe_depths({DECODE_QUEUE: 100})
    paused = p.prefill_intake(load)
    assert paused.state is Intake.PAUSED and paused.prefetch == 1
    p.observe_depths({DECODE_QUEUE: 95})  # hysteresis: still paused
    assert p.prefill_intake(load).state is Intake.PAUSED
    p.observe_depths({DECODE_QUEUE: 89})
    assert p.prefill_intake(load).state is Intake.SLOWED


def test_prefill_pauses_before_the_spill_store_is_full() -> None:
    p = policy(spill_max_bytes=100 * MB, prefill_pause_spill_fraction=0.8)
    p.observe_spill(40 * MB)
    assert p.prefill_intake(idle_load()).state is Intake.OPEN
    p.observe_spill(60 * MB)
    assert p.prefill_intake(idle_load()).state is Intake.SLOWED
    p.observe_spill(80 * MB)  # 80% of the store: pause rather than hand off without KV
    assert p.prefill_intake(idle_load()).state is Intake.PAUSED
    assert p.prefill_pressure() == pytest.approx(1.0)


def test_the_larger_pressure_wins() -> None:
    p = policy(prefill_pause_decode_backlog=100, spill_max_bytes=100 * MB)
    p.observe_spill(8 * MB)
    p.observe_depths({DECODE_QUEUE: 70})
    assert p.prefill_pressure() == pytest.approx(0.7)


# --- decode: prefetch = free batch slots ------------------------------------------------------


def test_decode_prefetch_is_a_full_batch_plus_headroom_when_nothing_waits() -> None:
    p = policy(max_num_seqs=8, decode_prefetch_headroom=2)
    assert p.decode_prefetch(EngineLoad(0, 0, 0, 100)) == 10
    assert p.decode_prefetch(EngineLoad(0, 5, 10, 90)) == 10  # 5 held + 3 free + 2


def test_decode_takes_nothing_more_while_work_waits_in_it() -> None:
    p = policy(max_num_seqs=8, decode_prefetch_headroom=2)
    # KV short: 5 run, 1 waits for blocks; only 1 more of headroom (2 may wait in all).
    assert p.decode_prefetch(EngineLoad(1, 5, 60, 0)) == 5 + 1 + 1
    # Three wait already: nothing new (the rest stays in the broker, for another replica).
    assert p.decode_prefetch(EngineLoad(3, 5, 60, 0)) == 8
    # A full batch with nothing waiting: the headroom only.
    assert p.decode_prefetch(EngineLoad(0, 8, 60, 40)) == 10


def test_decode_stops_taking_work_when_kv_would_not_hold_another_sequence() -> None:
    p = policy(max_num_seqs=8, decode_prefetch_headroom=2)
    assert p.decode_prefetch(EngineLoad(0, 4, 40, 9)) == 4 + 2  # mean 10 blocks > 9 free
    assert p.decode_prefetch(EngineLoad(0, 4, 40, 10)) == 10


def test_prefetch_is_never_zero() -> None:
    """0 means "no limit" to the broker."""
    p = policy(max_num_seqs=1, decode_prefetch_headroom=0)
    assert p.decode_prefetch(EngineLoad(0, 0, 0, 0)) == 1
    assert policy(tokenizer_prefetch=0).tokenizer_prefetch() == 1
