"""Service processes hide their start-up heap from the cyclic collector
(services/shell/common.py: freeze_startup_heap)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from services.shell.common import freeze_startup_heap


@pytest.fixture
def unfreeze_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # this test process is not a service: give the collector its heap back


def test_what_exists_at_start_up_is_out_of_the_collectors_sight(unfreeze_after: None) -> None:
    startup = [[1, 2], [[]]]  # tracked objects of a pretend start-up
    walked_before = len(gc.get_objects())
    freeze_startup_heap()
    assert gc.get_freeze_count() >= walked_before // 2
    walked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in walked for o in startup)  # frozen: never walked again
    served = [[3], [[]]]  # made while serving: still collected as usual
    walked = {id(o) for o in gc.get_objects()}
    assert all(id(o) in walked for o in served)
