"""Prefill service: ``PrefillMsg`` in, :class:`PrefillEngine` in between, first tokens to the
detokenizer and ``HandoffMsg`` (the KV descriptor) to decode.

The engine batches prompts under a token budget and hands each finished prompt's KV to the KV
connector; this module only translates. A request that ends at its first token (EOS,
``max_tokens`` 1) gets no handoff. The input is acked once its first token and handoff are
confirmed (``services/shell/engine_service.py``).

Scheduling policy (``shared/flow_control/policy.py``): every ``policy_poll_interval_s`` the shell's
poller reads the depths of ``baton.prefill`` and ``baton.decode`` and the spill store's size.
From them and its own steps come its prefetch (the batch in the forward and the batches it
forwards while a finished batch's acks come back; smaller as decode's backlog or the spill store
fills), the pause (no new prompt starts while either is at its limit) and the short-prompt
boost of its waiting queue. A handoff leaves with the request's
effective priority at that moment (aging included) as its AMQP priority.
"""

from __future__ import annotations

from collections.abc import Callable

from services.shell.common import resolve_model_dir
from services.shell.engine_service import EngineService, Received
from shared.config import BatonConfig
from shared.engine.build import build_prefill_engine
from shared.engine.cpu_share import CpuShareManager
from shared.engine.load import EngineLoad
from shared.engine.prefill import PrefillEngine
from shared.flow_control.policy import Intake, prefill_window_cap
from shared.wire.messages import PrefillMsg
from shared.wire.queues import DECODE_QUEUE, PREFILL_QUEUE


class PrefillService(EngineService):
    name = "prefill"
    queue = PREFILL_QUEUE
    message_type = PrefillMsg

    def __init__(
        self, config: BatonConfig, engine: PrefillEngine, cpu_share: CpuShareManager | None = None
    ) -> None:
        super().__init__(
            config,
            engine,
            prefetch=prefill_window_cap(config),
            batch_wait=(config.prefill_batch_wait_s, config.prefill_batch_wait_max_s),
            cpu_share=cpu_share,
        )
        # The shell's poller feeds the policy (the spill store's size only with a spill store).
        poller = self.shell.poller
        poller.on_depths(
            (PREFILL_QUEUE, DECODE_QUEUE),
            lambda depths: self._apply(lambda: self.policy.observe_depths(depths)),
        )
        poller.on_spill(lambda used: self._apply(lambda: self.policy.observe_spill(used)))

    def _work_tokens(self, item: Received) -> int:
        msg = item.msg
        return len(msg.prompt_token_ids) if isinstance(msg, PrefillMsg) else 0

    def _apply(self, observe: Callable[[], None]) -> None:
        """Feed the policy, then apply its answers: the window, and intake reopened."""
        was_open = self.intake_open()
        observe()
        self.shell.metrics.on_intake(self.policy.prefill_intake(self.load))
        self.prefetch.want(self.window(self.load))
        if self.intake_open() and not was_open:
            self.wake()

    def window(self, load: EngineLoad) -> int:
        policy = self.policy
        self.shell.metrics.on_policy_times(policy.release_s, policy.prefill_batches_ahead())
        return policy.prefill_intake(load).prefetch

    def intake_open(self) -> bool:
        return self.policy.prefill_intake(self.load).state is not Intake.PAUSED


def build(config: BatonConfig, cpu_share: CpuShareManager | None = None) -> PrefillService:
    """``cpu_share``: the thread budget this engine shares with the deployment's others."""
    between_layers = cpu_share.rebalance if cpu_share is not None else None
    engine = build_prefill_engine(config, resolve_model_dir(config), between_layers)
    return PrefillService(config, engine, cpu_share)
