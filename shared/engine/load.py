"""What an engine reports of its state after every step: the input of flow control
(shared/flow_control/policy.py) and the engine's gauges."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.scheduling.priority import PriorityState


@dataclass(frozen=True)
class EngineLoad:
    """The engine's state after a step, forward or not (blocks also come back without one: a
    pooled sender's pins released, a request aborted or expired)."""

    num_waiting: int = 0
    num_running: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_host_blocks_used: int = 0  # of the used blocks, those in the host tier
    num_staged_blocks: int = 0  # host tier -> device pool copies since start (cumulative)
    priority: PriorityState = field(default_factory=PriorityState)  # its waiting queue's aging
