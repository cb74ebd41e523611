"""Service-side metric updates (placeholder until shared/metrics.py lands)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.config import BatonConfig


class ServiceMetrics:
    def __init__(self, config: BatonConfig, service: str, broker: Any = None) -> None:
        self.config = config
        self.service = service
        self.broker = broker

    async def start(self, ready: Callable[[], bool]) -> None:
        pass

    async def stop(self) -> None:
        pass

    def on_accepted(self, num_prompt_tokens: int) -> None: ...
    def on_error(self, code: str) -> None: ...
    def on_prefill_batch(self, batch: Any, block_manager: Any, seconds: float) -> None: ...
    def on_handoffs(self, results: Any) -> None: ...
    def on_kv_received(self, nbytes: int) -> None: ...
    def on_decode_step(
        self, step: Any, scheduler: Any, block_manager: Any, seconds: float
    ) -> None: ...
    def on_request_finished(self, info: Any, reply: Any) -> None: ...
