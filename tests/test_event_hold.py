"""Decode's event hold (services/shell/event_hold.py): which steps wait, and what they become."""

from __future__ import annotations

from services.shell.event_hold import EventHold, merge
from shared.wire.messages import TokenEvent


def ev(rid: str, index: int, *ids: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent(rid, index, list(ids), finish)


def test_steps_wait_for_the_interval_then_go_out_merged_per_request() -> None:
    hold = EventHold(0.025)
    assert hold.offer([ev("a", 1, 11), ev("b", 1, 21)], now=10.000, urgent=False) == []
    assert hold.offer([ev("a", 2, 12), ev("b", 2, 22)], now=10.012, urgent=False) == []
    assert hold  # something is held
    out = hold.offer([ev("a", 3, 13), ev("b", 3, 23)], now=10.025, urgent=False)
    assert out == [ev("a", 1, 11, 12, 13), ev("b", 1, 21, 22, 23)]
    assert not hold
    # the interval counts from the oldest held event, not from the last send
    assert hold.offer([ev("a", 4, 14)], now=10.040, urgent=False) == []
    assert hold.offer([], now=10.066, urgent=False) == [ev("a", 4, 14)]


def test_an_urgent_step_sends_everything_held_before_its_own_events() -> None:
    hold = EventHold(1.0)
    hold.offer([ev("a", 1, 11), ev("b", 1, 21)], now=0.0, urgent=False)
    out = hold.offer([ev("a", 2, 12, finish="length"), ev("b", 2, 22)], now=0.001, urgent=True)
    assert out == [ev("a", 1, 11, 12, finish="length"), ev("b", 1, 21, 22)]


def test_no_interval_means_every_step_goes_out() -> None:
    hold = EventHold(0.0)
    assert hold.offer([ev("a", 1, 11)], now=0.0, urgent=False) == [ev("a", 1, 11)]
    assert hold.offer([], now=0.0, urgent=False) == []


def test_merge_keeps_apart_what_does_not_continue() -> None:
    err = TokenEvent("a", 0, [], error_code="internal", error_message="boom")
    events = [
        ev("a", 1, 11),
        ev("b", 5, 51),
        ev("a", 3, 13),  # a gap (position 2 missing): not merged
        ev("b", 6, 52, finish="stop"),
        ev("b", 7, 53),  # after an ending: not merged into it
        err,  # an error never merges
    ]
    assert merge(events) == [
        ev("a", 1, 11),
        ev("b", 5, 51, 52, finish="stop"),
        ev("a", 3, 13),
        ev("b", 7, 53),
        err,
    ]


def test_merge_leaves_the_events_it_was_given_as_they_were() -> None:
    first = ev("a", 0, 10)
    merged = merge([first, ev("a", 1, 11), ev("a", 2, 12)])
    assert merged == [ev("a", 0, 10, 11, 12)]
    assert first == ev("a", 0, 10)  # its token list was copied before the run grew


def test_merge_keeps_the_choices_of_a_request_apart() -> None:
    def choice(i: int, index: int, token: int) -> TokenEvent:
        return TokenEvent("a", index, [token], choice_index=i)

    events = [choice(0, 1, 10), choice(1, 1, 20), choice(0, 2, 11), choice(1, 2, 21)]
    assert merge(events) == [
        TokenEvent("a", 1, [10, 11], choice_index=0),
        TokenEvent("a", 1, [20, 21], choice_index=1),
    ]
