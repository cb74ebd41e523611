"""Goodput: finished requests that met the service-level objectives, per priority.

Throughput counts every token; goodput counts only requests a user was served well by (after
DistServe): a ``done`` with ``stop`` or ``length`` whose time to first token is at most
``BATON_SLO_TTFT_S`` and whose mean time per output token is at most ``BATON_SLO_TPOT_S`` (0 =
no objective on that one). The detokenizer judges it because it sees both the first token and
the end. Every terminal reply is judged — errors, cancels and timeouts count as missed — so
``rate(baton:request_goodput_total[5m]) / rate(baton:request_slo_judged_total[5m])`` is the
fraction served within the objectives (docs/deploy.md, "Health and metrics": Goodput).
"""

from __future__ import annotations

from shared.config import BatonConfig
from shared.wire.messages import DoneReply, ErrorReply

SERVED = ("stop", "length")


def meets_slo(reply: DoneReply | ErrorReply, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    if not isinstance(reply, DoneReply) or reply.finish_reason not in SERVED:
        return False
    ttft, tpot = reply.timing.get("ttft_s") or 0.0, reply.timing.get("tpot_s") or 0.0
    return (slo_ttft_s <= 0 or ttft <= slo_ttft_s) and (slo_tpot_s <= 0 or tpot <= slo_tpot_s)


class Goodput:
    """The deployment's objectives; the detokenizer judges each terminal reply by them and
    counts the verdict (ServiceMetrics.on_slo_judged)."""

    def __init__(self, config: BatonConfig) -> None:
        self.slo_ttft_s = config.slo_ttft_s
        self.slo_tpot_s = config.slo_tpot_s

    def met(self, reply: DoneReply | ErrorReply) -> bool:
        return meets_slo(reply, self.slo_ttft_s, self.slo_tpot_s)
