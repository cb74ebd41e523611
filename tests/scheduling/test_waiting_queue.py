"""The waiting queue: priority first, then arrival; preempted work ahead of its class."""

from __future__ import annotations

from shared.scheduling.waiting_queue import WaitingQueue
from tests.scheduling.helpers import seq

# --- WaitingQueue -----------------------------------------------------------------------------


def test_waiting_queue_priority_then_fifo() -> None:
    q = WaitingQueue()
    for rid, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 9), ("e", 5)]:
        q.push(seq(rid, 1, priority=prio))
    assert len(q) == 5 and "c" in q and "z" not in q
    assert q.max_priority() == 9
    assert [q.pop().request_id for _ in range(5)] == ["d", "b", "e", "a", "c"]
    assert len(q) == 0 and q.peek() is None and q.max_priority() is None


def test_waiting_queue_front_goes_ahead_of_its_class_only() -> None:
    q = WaitingQueue()
    q.push(seq("a", 1, priority=1))
    q.push(seq("hi", 1, priority=5))
    q.push(seq("b", 1, priority=1))
    q.push(seq("p1", 1, priority=1), front=True)
    q.push(seq("p2", 1, priority=1), front=True)  # the latest front push is first
    assert [q.pop().request_id for _ in range(5)] == ["hi", "p2", "p1", "a", "b"]


def test_waiting_queue_lazy_remove() -> None:
    q = WaitingQueue()
    a, b, c = seq("a", 1), seq("b", 1), seq("c", 1)
    for s in (a, b, c):
        q.push(s)
    assert q.remove("a") is a and q.remove("a") is None and q.remove("zz") is None
    assert len(q) == 2 and "a" not in q
    assert q.peek() is b
    q.remove("c")
    assert q.pop() is b and q.peek() is None and len(q) == 0


def test_waiting_queue_remove_then_push_goes_to_the_back() -> None:
    from shared.scheduling.waiting_queue import WaitingQueue

    q = WaitingQueue()
    a, b = seq("a", 3), seq("b", 3)
    q.push(a)
    q.remove("a")
    q.push(b)
    q.push(a)
    assert [q.pop().request_id, q.pop().request_id] == ["b", "a"]
