"""Goodput (services/detokenizer/goodput.py): a finished request counts if it met both
objectives; every terminal reply is judged, per the client's priority."""

from __future__ import annotations

from services.detokenizer.goodput import Goodput, meets_slo
from services.shell.service_metrics import ServiceMetrics
from shared.config import BatonConfig
from shared.wire.messages import DoneReply, ErrorReply, StartInfo


def done(ttft: float, tpot: float, reason: str = "length") -> DoneReply:
    timing = {"queue_s": 0.0, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": 1.0}
    return DoneReply(
        "r", "text", [1, 2], reason, {"prompt_tokens": 1, "completion_tokens": 2}, timing
    )


def test_both_objectives_must_be_met() -> None:
    assert meets_slo(done(1.0, 0.05), 2.0, 0.1)
    assert not meets_slo(done(2.5, 0.05), 2.0, 0.1)
    assert not meets_slo(done(1.0, 0.2), 2.0, 0.1)
    assert meets_slo(done(9.0, 0.05), 0.0, 0.1)  # 0: no objective on TTFT
    assert not meets_slo(done(0.1, 0.01, "cancelled"), 2.0, 0.1)
    assert not meets_slo(ErrorReply("r", "timeout", "late"), 2.0, 0.1)


def test_counted_per_priority_beside_every_judged_request() -> None:
    config = BatonConfig(slo_ttft_s=2.0, slo_tpot_s=0.1, served_model_name="m")
    goodput, service = Goodput(config), ServiceMetrics(config, "detokenizer")
    urgent, normal = StartInfo("a", "q", 1, priority=9), StartInfo("b", "q", 1)
    for info, reply in (
        (urgent, done(0.5, 0.01)),
        (urgent, done(3.0, 0.01)),
        (normal, ErrorReply("b", "internal", "boom")),
    ):
        service.on_slo_judged(info.priority, goodput.met(reply))
    text = service.metrics.render().decode()
    assert 'baton:request_goodput_total{model_name="m",priority="9"} 1.0' in text
    assert 'baton:request_slo_judged_total{model_name="m",priority="9"} 2.0' in text
    assert 'baton:request_slo_judged_total{model_name="m",priority="0"} 1.0' in text
    assert 'baton:request_goodput_total{model_name="m",priority="0"}' not in text
