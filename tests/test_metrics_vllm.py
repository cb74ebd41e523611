"""What a dashboard written for vLLM reads: vLLM's names and labels (``model_name`` on every
series, ``finished_reason``), the table in docs/deploy.md, and the latencies the gateway measures
on the replies it serves."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics, RequestLatencies
from services.shell.service_metrics import ServiceMetrics
from shared.client import TimedReply
from shared.config import BatonConfig
from shared.observability.collectors import observe_many
from shared.wire.messages import DoneReply, StartInfo, TokenReply

MODEL = "my-model"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
# The HTTP server's series and the process's identity: the only ones without model_name.
PER_PROCESS = {
    "baton:service_info", "baton:http_requests", "baton:http_request_duration_seconds",
    "baton:gateway_overhead_seconds", "baton:http_client_disconnects",
    "baton:http_requests_in_flight",
}  # fmt: skip


def _families(metrics: GatewayMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def _value(m: GatewayMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0


def test_every_series_carries_model_name_but_the_process_ones() -> None:
    m = GatewayMetrics(MODEL)
    m.http_requests.labels(route="/metrics", status="200").inc()
    m.request_success.labels(finished_reason="stop").inc()
    m.request_errors.labels(code="timeout").inc()
    families = _families(m)
    assert PER_PROCESS <= set(families)
    for name, family in families.items():
        for s in family.samples:
            own = name.removesuffix("_created") in PER_PROCESS
            assert s.labels.get("model_name") == (None if own else MODEL), s


def test_the_served_model_id_is_the_label() -> None:
    for config, expected in (
        (BatonConfig(model="/models/Qwen3-0.6B/"), "Qwen3-0.6B"),
        (BatonConfig(model="/models/Qwen3-0.6B", served_model_name="qwen"), "qwen"),
    ):
        sm = ServiceMetrics(config, "decode")
        assert sm.metrics.registry.get_sample_value(
            "baton:num_requests_running", {"model_name": expected}
        ) == 0  # fmt: skip


def test_request_success_is_labelled_finished_reason() -> None:
    sm = ServiceMetrics(BatonConfig(served_model_name=MODEL), "detokenizer")
    done = DoneReply("r", "abc", [1, 2, 3, 4, 5], "length", {"prompt_tokens": 3},
                     {"queue_s": 0.1, "ttft_s": 0.4, "tpot_s": 0.05, "e2e_s": 0.7})  # fmt: skip
    sm.on_request_finished(StartInfo("r", "q", 3), done)
    reg = sm.metrics.registry

    def value(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0

    assert value("baton:request_success_total", finished_reason="length") == 1
    assert value("baton:pipeline_time_to_first_token_seconds_sum") == pytest.approx(0.4)
    assert value("baton:pipeline_request_time_per_output_token_seconds_sum") == pytest.approx(0.05)
    assert value("baton:request_queue_time_seconds_sum") == pytest.approx(0.1)
    assert value("baton:request_prefill_time_seconds_sum") == pytest.approx(0.3)
    assert value("baton:request_decode_time_seconds_sum") == pytest.approx(0.2)
    assert value("baton:request_inference_time_seconds_sum") == pytest.approx(0.5)
    # the gateway's series stay at zero in the detokenizer: one owner each
    assert value("baton:time_to_first_token_seconds_count") == 0


def _table() -> list[tuple[str, str, str]]:
    row = r"^\| `(vllm:[a-z_]+)` \| `(baton:[a-z_]+)` \| ([a-z, ]+) \|"
    rows = re.findall(row, DOCS.read_text(), re.MULTILINE)
    assert len(rows) >= 20, "the table of vLLM's names in docs/deploy.md"
    return rows


def test_the_docs_table_names_exported_series() -> None:
    """Each row: vLLM's name with Baton's prefix, exported by every service with model_name."""
    families = _families(GatewayMetrics(MODEL))
    owners = {"gateway", "tokenizer", "prefill", "decode", "detokenizer"}
    for vllm, baton, owner in _table():
        assert baton == "baton:" + vllm.removeprefix("vllm:")
        family = families.get(baton) or families.get(baton.removesuffix("_total"))
        assert family is not None, baton
        assert {s.labels.get("model_name") for s in family.samples} <= {MODEL}, baton
        assert set(owner.split(", ")) <= owners, owner


def test_observe_many_equals_repeated_observe() -> None:
    buckets = (0.01, 0.1, 1.0)
    one, many = (Histogram("h", "d", registry=CollectorRegistry(), buckets=buckets) for _ in "ab")
    for value, count in ((0.05, 3), (2.0, 2), (0.01, 1), (0.5, 0)):
        for _ in range(count):
            one.observe(value)
        observe_many(many, value, count)
    assert [s for s in one.collect()[0].samples if not s.name.endswith("_created")] == [
        s for s in many.collect()[0].samples if not s.name.endswith("_created")
    ]


def _token(index: int, n: int, at: float) -> TimedReply:
    return TimedReply(TokenReply("r", "x" * n, list(range(n)), index, index), at, at - 99.0)


def _done(n: int, at: float, elapsed: float, **timing: float) -> TimedReply:
    reply = DoneReply("r", "x" * n, list(range(n)), "length", {}, dict(timing))
    return TimedReply(reply, at, elapsed)


def test_streamed_latencies_are_the_gateway_clock() -> None:
    """Tokens arriving together share their gap; a re-sent reply adds nothing; the gaps add up
    to first-to-last, so their mean is the request's time per output token."""
    m = GatewayMetrics(MODEL)
    timeline = RequestLatencies(m, t0=100.0, params=(8, 1))
    for t in (_token(0, 2, 100.5), _token(2, 3, 100.8), _token(2, 3, 100.9),
              _done(5, 101.0, 1.0, ttft_s=9.0, tpot_s=9.0)):  # fmt: skip
        timeline.add(t)
    assert _value(m, "baton:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "baton:time_to_first_token_seconds_count") == 1
    for itl in ("baton:inter_token_latency_seconds", "baton:time_per_output_token_seconds"):
        assert _value(m, itl + "_count") == 4  # one with the first (gap 0), three 0.1 s apart
        assert _value(m, itl + "_sum") == pytest.approx(0.3)
        assert _value(m, itl + "_bucket", le="0.0005") == 1
    tpot = "baton:request_time_per_output_token_seconds_sum"
    assert _value(m, tpot) == pytest.approx(0.3 / 4)
    assert _value(m, "baton:e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert _value(m, "baton:request_params_max_tokens_sum") == 8
    assert _value(m, "baton:request_params_n_sum") == 1


def test_unstreamed_latencies_take_batons_timing() -> None:
    m = GatewayMetrics(MODEL)
    timeline = RequestLatencies(m, t0=100.0, params=(5, 1))
    timeline.add(_done(5, 102.0, 1.9, ttft_s=0.4, tpot_s=0.05))  # published at 100.1
    assert _value(m, "baton:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "baton:inter_token_latency_seconds_count") == 4
    assert _value(m, "baton:inter_token_latency_seconds_sum") == pytest.approx(0.2)
    tpot = "baton:request_time_per_output_token_seconds_sum"
    assert _value(m, tpot) == pytest.approx(0.05)
    assert _value(m, "baton:e2e_request_latency_seconds_sum") == pytest.approx(2.0)


async def test_timed_passes_replies_through_and_closes_them() -> None:
    closed: list[bool] = []

    async def replies() -> AsyncGenerator[TimedReply, None]:
        try:
            yield _token(0, 1, 100.2)
            yield _token(1, 1, 100.3)
        finally:
            closed.append(True)  # what makes the client library publish a cancel

    m = GatewayMetrics(MODEL)
    timed = m.timed(replies(), 100.0, max_tokens=4)
    assert (await anext(timed)).reply.index == 0
    await timed.aclose()
    assert closed == [True]
    assert _value(m, "baton:time_to_first_token_seconds_count") == 1
    assert _value(m, "baton:e2e_request_latency_seconds_count") == 0  # it never finished
