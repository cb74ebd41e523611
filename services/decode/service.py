"""Decode service: ``HandoffMsg`` in, :class:`DecodeEngine` in between, one ``DetokMsg`` per step
carrying every sequence's new token.

A handoff stays unacked while its sequence runs (the engine names it in ``retired`` when it is
done): if this worker dies, the broker redelivers it to another, which finds the KV gone (the
spill-store entry was consumed) and recomputes it; sampling is a function of (seed, position), so
the replay emits the same tokens and the detokenizer drops the positions it already has.
"""

from __future__ import annotations

import math
import time

from services.shell.common import resolve_model_dir
from services.shell.engine_service import EngineService
from shared.config import BatonConfig
from shared.engine.build import build_decode_engine
from shared.engine.cpu_share import CpuShareManager
from shared.engine.decode import DecodeEngine
from shared.engine.load import EngineLoad
from shared.wire.messages import HandoffMsg
from shared.wire.queues import DECODE_QUEUE


class DecodeService(EngineService):
    name = "decode"
    queue = DECODE_QUEUE
    message_type = HandoffMsg

    def __init__(
        self, config: BatonConfig, engine: DecodeEngine, cpu_share: CpuShareManager | None = None
    ) -> None:
        # Prefetch: the free batch slots plus a little headroom (the policy's ``decode_prefetch``,
        # at most a full batch plus that headroom). A handoff stays unacked while its sequence
        # runs, so the broker delivers only as slots free up; the backlog stays queued there,
        # ordered by priority, for whichever decode replica has room.
        super().__init__(
            config,
            engine,
            prefetch=config.max_num_seqs + config.decode_prefetch_headroom,
            event_hold_s=config.decode_event_hold_s,
            cpu_share=cpu_share,
            yield_s=config.decode_yield_s,
        )
        self.decode_engine, self.slo_tpot_s = engine, config.slo_tpot_s

    def yield_slack_s(self) -> float:
        """The running streams' slack under BATON_SLO_TPOT_S: the TPOT objective decides how
        much of decode's pace a prefill wave (time to first token) may take."""
        if self.slo_tpot_s <= 0:
            return math.inf
        return self.decode_engine.tpot_slack(self.slo_tpot_s, time.monotonic())

    def window(self, load: EngineLoad) -> int:
        self.shell.metrics.on_policy_times(self.policy.release_s, None)
        return self.policy.decode_prefetch(load)


def build(config: BatonConfig, cpu_share: CpuShareManager | None = None) -> DecodeService:
    """``cpu_share``: the thread budget this engine shares with the deployment's others."""
    between_layers = cpu_share.rebalance if cpu_share is not None else None
    engine = build_decode_engine(config, resolve_model_dir(config), between_layers=between_layers)
    return DecodeService(config, engine, cpu_share)
