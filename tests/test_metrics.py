"""shared.observability.metrics and shared.observability.http_server over a real socket."""

from __future__ import annotations

import asyncio
import socket
import sys
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.shell.polling import Poller
from services.shell.service_metrics import ServiceMetrics
from shared.config import BatonConfig
from shared.engine.load import EngineLoad
from shared.engine.outputs import EngineInfo, KVTransferStat, StepStats
from shared.observability.http_server import MAX_LINE_BYTES, start_metrics_server
from shared.observability.metrics import Metrics

# The names the brief, dashboards and docs/deploy.md rely on (vLLM's, with the baton: prefix).
EXPECTED_FAMILIES = {
    "baton:time_to_first_token_seconds": "histogram",
    "baton:inter_token_latency_seconds": "histogram",
    "baton:time_per_output_token_seconds": "histogram",
    "baton:request_time_per_output_token_seconds": "histogram",
    "baton:e2e_request_latency_seconds": "histogram",
    "baton:request_queue_time_seconds": "histogram",
    "baton:pipeline_time_to_first_token_seconds": "histogram",
    "baton:pipeline_e2e_request_latency_seconds": "histogram",
    "baton:num_requests_running": "gauge",
    "baton:num_requests_waiting": "gauge",
    "baton:queue_depth": "gauge",
    "baton:batch_size": "histogram",
    "baton:batch_token_utilization": "histogram",
    "baton:kv_cache_usage_perc": "gauge",
    "baton:kv_blocks_used": "gauge",
    "baton:kv_blocks_free": "gauge",
    "baton:kv_host_blocks_used": "gauge",
    "baton:kv_host_staged_blocks": "counter",
    "baton:prefix_cache_queries": "counter",
    "baton:prefix_cache_hits": "counter",
    "baton:handoff_bytes": "counter",
    "baton:handoff_seconds": "histogram",
    "baton:num_preemptions": "counter",
    "baton:request_errors": "counter",
    "baton:request_success": "counter",
    "baton:prompt_tokens": "counter",
    "baton:generation_tokens": "counter",
    "baton:redelivered_messages": "counter",
    "baton:spill_store_bytes": "gauge",
    "baton:memory_bandwidth_bytes_per_second": "gauge",
    "baton:forward_seconds": "histogram",
}


MODEL = "tiny-random"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(families: dict, family: str, sample: str, **labels: str) -> float:
    """The value of ``sample`` with ``labels``, and ``model_name`` but on the device's series."""
    per_model = not family.startswith("baton:gpu_")
    for s in families[family].samples:
        rest = {k: v for k, v in s.labels.items() if k != "model_name"}
        if s.name == sample and rest == labels and ("model_name" in s.labels) == per_model:
            return s.value
    raise KeyError((family, sample, labels))


async def _http(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    response = await reader.read()  # the server closes after one response
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("ascii").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    assert int(headers["content-length"]) == len(body) or raw.startswith(b"HEAD")
    return int(status_line.split()[1]), headers, body


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\nAccept: */*\r\n\r\n".encode()


@pytest.fixture
async def served():
    metrics = Metrics(MODEL)
    state = {"ready": False}
    port = _free_port()
    server = await start_metrics_server(port, metrics, lambda: state["ready"], host="127.0.0.1")
    assert server is not None
    yield port, metrics, state
    server.close()
    await server.wait_closed()


def test_every_expected_family_is_exported_with_its_type() -> None:
    families = _families(Metrics(MODEL).render().decode())
    for name, kind in EXPECTED_FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, name


def test_each_metrics_object_has_its_own_registry() -> None:
    # a global registry would raise "Duplicated timeseries" here
    a, b = Metrics(MODEL), Metrics(MODEL)
    a.generation_tokens.inc(5)
    fa, fb = _families(a.render().decode()), _families(b.render().decode())
    assert _sample(fa, "baton:generation_tokens", "baton:generation_tokens_total") == 5
    assert _sample(fb, "baton:generation_tokens", "baton:generation_tokens_total") == 0


def test_kv_gauges_agree() -> None:
    m = Metrics(MODEL)
    m.set_kv_blocks(num_used_blocks=30, num_free_blocks=10)
    f = _families(m.render().decode())
    assert _sample(f, "baton:kv_cache_usage_perc", "baton:kv_cache_usage_perc") == 0.75
    assert _sample(f, "baton:kv_blocks_used", "baton:kv_blocks_used") == 30
    m.set_kv_blocks(num_used_blocks=0, num_free_blocks=0)  # an engine with no pool yet
    f = _families(m.render().decode())
    assert _sample(f, "baton:kv_cache_usage_perc", "baton:kv_cache_usage_perc") == 0.0


def test_cpu_device_exports_no_gpu_metrics() -> None:
    m = Metrics(MODEL)
    m.watch_device("cpu")
    assert not [n for n in _families(m.render().decode()) if n.startswith("baton:gpu_")]


async def test_port_zero_starts_nothing() -> None:
    assert await start_metrics_server(0, Metrics(MODEL), lambda: True) is None


async def test_metrics_endpoint_serves_current_values(served) -> None:
    port, metrics, _ = served
    metrics.time_to_first_token.observe(0.2)
    metrics.time_to_first_token.observe(3.0)
    metrics.request_success.labels(finished_reason="length").inc(2)
    metrics.request_errors.labels(code="timeout").inc()
    metrics.set_queue_depths({"baton.prefill": 7, "baton.decode": 0})
    metrics.handoff_bytes.labels(transport="shm").inc(4096)

    status, headers, body = await _http(port, _get("/metrics"))
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    f = _families(body.decode())
    ttft = "baton:time_to_first_token_seconds"
    assert _sample(f, ttft, ttft + "_count") == 2
    assert _sample(f, ttft, ttft + "_sum") == pytest.approx(3.2)
    assert _sample(f, ttft, ttft + "_bucket", le="0.25") == 1
    assert _sample(f, ttft, ttft + "_bucket", le="+Inf") == 2
    ok = "baton:request_success"
    assert _sample(f, ok, ok + "_total", finished_reason="length") == 2
    err = "baton:request_errors"
    assert _sample(f, err, err + "_total", code="timeout") == 1
    assert _sample(f, "baton:queue_depth", "baton:queue_depth", queue="baton.prefill") == 7
    hb = "baton:handoff_bytes"
    assert _sample(f, hb, hb + "_total", transport="shm") == 4096

    metrics.request_errors.labels(code="timeout").inc()  # a second scrape sees the change
    _, _, body = await _http(port, _get("/metrics?name=ignored"))
    assert _sample(_families(body.decode()), err, err + "_total", code="timeout") == 2


async def test_health_and_readiness(served) -> None:
    port, _, state = served
    assert (await _http(port, _get("/health")))[::2] == (200, b"ok\n")
    assert (await _http(port, _get("/ready")))[0] == 503
    state["ready"] = True
    assert (await _http(port, _get("/ready")))[0] == 200
    status, headers, body = await _http(port, b"HEAD /ready HTTP/1.1\r\n\r\n")
    assert (status, body) == (200, b"")
    assert int(headers["content-length"]) == len(b"ready\n")


async def test_readiness_check_that_raises_is_not_ready() -> None:
    def broken() -> bool:
        raise RuntimeError("engine gone")

    port = _free_port()
    server = await start_metrics_server(port, Metrics(MODEL), broken, host="127.0.0.1")
    assert server is not None
    try:
        assert (await _http(port, _get("/ready")))[0] == 503
        assert (await _http(port, _get("/health")))[0] == 200
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (_get("/nope"), 404),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"garbage\r\n\r\n", 400),
        (b"GET /health SPDY/3\r\n\r\n", 400),
        (b"GET /" + b"a" * (2 * MAX_LINE_BYTES) + b" HTTP/1.1\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nX: " + b"b" * (2 * MAX_LINE_BYTES) + b"\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n", 431),
    ],
    ids=["unknown-path", "post", "garbage", "not-http", "long-line", "long-header", "many-headers"],
)
async def test_bad_requests_are_answered_and_the_server_keeps_serving(
    served, raw: bytes, expected: int
) -> None:
    port, _, _ = served
    status, headers, _ = await _http(port, raw)
    assert status == expected
    if expected == 405:
        assert headers["allow"] == "GET, HEAD"
    assert (await _http(port, _get("/health")))[0] == 200


async def test_client_that_hangs_up_does_not_break_the_server(served) -> None:
    port, _, _ = served
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /hea")
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    assert (await _http(port, _get("/health")))[0] == 200


async def test_probe_cli_follows_the_http_status(served) -> None:
    """The Docker HEALTHCHECK command: exit 0 on 200 only."""
    port, _, state = served

    async def probe(*args: str) -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.observability.http_server", *args,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        return await proc.wait()

    assert await probe("--port", str(port), "/health") == 0
    assert await probe("--port", str(port), "/ready") == 1
    state["ready"] = True
    assert await probe("--port", str(port), "/ready") == 0
    assert await probe("--port", str(_free_port()), "/health") == 1  # nothing listening
    assert await probe("--port", "0") == 1  # metrics disabled: never reported healthy


async def test_failing_collector_gives_500_not_a_dead_endpoint(served) -> None:
    port, metrics, _ = served

    class Broken:
        def collect(self):
            raise RuntimeError("device lost")

    metrics.registry.register(Broken())
    assert (await _http(port, _get("/metrics")))[0] == 500
    assert (await _http(port, _get("/health")))[0] == 200


def test_cuda_device_exports_gpu_memory() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m = Metrics(MODEL)
    m.watch_device("cuda:0")
    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    f = _families(m.render().decode())
    allocated = "baton:gpu_memory_allocated_bytes"
    assert _sample(f, allocated, allocated, gpu="0") >= held.numel()
    used = "baton:gpu_memory_used_perc"
    assert 0 < _sample(f, used, used, gpu="0") <= 1


def _stats(**overrides: float) -> StepStats:
    base = dict(
        num_seqs=4, num_scheduled_tokens=4, num_generated_tokens=4, num_context_tokens=100,
        forward_s=0.01,
        prefix_queries_total=64, prefix_hits_total=16, preemptions_total=0,
    )  # fmt: skip
    return StepStats(**{**base, **overrides})  # type: ignore[arg-type]


def test_engine_step_facts_feed_the_metrics() -> None:
    """What prefill and decode feed, from StepStats, EngineLoad and KVTransferStat (running
    totals become counter increments, so a step reported twice in a row counts once)."""
    sm = ServiceMetrics(BatonConfig(max_num_seqs=8), "decode")
    sm.set_engine(_info(weight_bytes=1000, kv_bytes_per_token=10))
    sm.on_step(_stats())
    sm.on_step(_stats(prefix_queries_total=96, prefix_hits_total=32, preemptions_total=2))
    sm.on_transfer(KVTransferStat("shm", 4096, 0.002))
    sm.on_load(EngineLoad(num_waiting=2, num_running=3, num_used_blocks=30, num_free_blocks=10))
    for staged in (40, 40, 55):  # a host tier's cumulative copies, as each step reports them
        sm.on_load(EngineLoad(2, 3, 30, 10, num_host_blocks_used=12, num_staged_blocks=staged))
    sm.on_redelivered("baton.decode")
    f = _families(sm.metrics.render().decode())
    assert _sample(f, "baton:generation_tokens", "baton:generation_tokens_total") == 8
    assert _sample(f, "baton:prefix_cache_queries", "baton:prefix_cache_queries_total") == 96
    assert _sample(f, "baton:prefix_cache_hits", "baton:prefix_cache_hits_total") == 32
    preempted = _sample(f, "baton:num_preemptions", "baton:num_preemptions_total", mode="recompute")
    assert preempted == 2
    assert _sample(f, "baton:batch_size", "baton:batch_size_count") == 2
    utilization = "baton:batch_token_utilization"
    assert _sample(f, utilization, utilization + "_sum") == pytest.approx(2 * 4 / 8)
    assert _sample(f, "baton:kv_cache_usage_perc", "baton:kv_cache_usage_perc") == 0.75
    assert _sample(f, "baton:kv_host_blocks_used", "baton:kv_host_blocks_used") == 12
    staged = "baton:kv_host_staged_blocks"
    assert _sample(f, staged, staged + "_total") == 55
    bandwidth = "baton:memory_bandwidth_bytes_per_second"
    assert _sample(f, bandwidth, bandwidth) == pytest.approx((1000 + 100 * 10) / 0.01)
    handoff = "baton:handoff_bytes"
    assert _sample(f, handoff, handoff + "_total", transport="shm") == 4096
    assert _sample(f, "baton:num_requests_running", "baton:num_requests_running") == 3
    assert _sample(f, "baton:num_requests_waiting", "baton:num_requests_waiting") == 2
    redelivered = "baton:redelivered_messages"
    assert _sample(f, redelivered, redelivered + "_total", queue="baton.decode") == 1


def test_prefill_utilization_is_against_the_token_budget() -> None:
    sm = ServiceMetrics(BatonConfig(max_num_batched_tokens=1000), "prefill")
    sm.on_step(_stats(num_scheduled_tokens=250, num_context_tokens=0))
    f = _families(sm.metrics.render().decode())
    utilization = "baton:batch_token_utilization"
    assert _sample(f, utilization, utilization + "_sum") == pytest.approx(0.25)
    bandwidth = "baton:memory_bandwidth_bytes_per_second"
    assert _sample(f, bandwidth, bandwidth) == 0  # a decode figure: prefill never sets it


class _NoQueues:
    """A broker stand-in for the poller's depth readings (this test is about the spill store)."""

    async def queue_depths(self, names: object = None) -> dict[str, int]:
        return {}


class _Depths:
    """A broker stand-in that records which queues each depth reading asked for."""

    def __init__(self) -> None:
        self.asked: list[object] = []

    async def queue_depths(self, names: object = None) -> dict[str, int]:
        self.asked.append(None if names is None else tuple(names))  # type: ignore[arg-type]
        return {"baton.prefill": 3, "baton.decode": 4}


async def test_one_poller_feeds_the_policy_before_consuming_and_the_gauges() -> None:
    """The policy's queues at its interval, the first reading taken by ``start``; with the
    metrics endpoint on, a reading of every queue (names None) serves both."""
    policy = ("baton.prefill", "baton.decode")
    for port, first in ((0, policy), (_free_port(), None)):
        config = BatonConfig(policy_poll_interval_s=0.01, metrics_port=port)
        sm, broker, seen = ServiceMetrics(config, "tokenizer"), _Depths(), []
        poller = Poller(config, broker=broker, metrics=sm)  # type: ignore[arg-type]
        poller.on_depths(policy, seen.append)
        await poller.start()
        assert seen == [{"baton.prefill": 3, "baton.decode": 4}] and broker.asked == [first]
        await asyncio.sleep(0.1)
        await poller.stop()
        assert len(seen) > 3 and set(broker.asked[1:]) == {policy}  # every queue: each 2 s
        f = _families(sm.metrics.render().decode())
        assert _sample(f, "baton:queue_depth", "baton:queue_depth", queue="baton.decode") == 4


def _info(**overrides: object) -> EngineInfo:
    base = dict(
        kind="decode", vocab_size=256, max_model_len=64, weight_bytes=0, kv_bytes_per_token=0,
        release_route=None, spill_store=False,
    )  # fmt: skip
    return EngineInfo(**{**base, **overrides})  # type: ignore[arg-type]


async def test_spill_store_size_is_polled_while_the_endpoint_runs() -> None:
    port = _free_port()
    config = BatonConfig(metrics_port=port)
    sm = ServiceMetrics(config, "prefill")
    poller = Poller(config, broker=_NoQueues(), metrics=sm)  # type: ignore[arg-type]
    poller.watch_spill(lambda: 12345)
    await sm.start(ready=lambda: True)
    await poller.start()
    try:
        for _ in range(100):
            status, _, body = await _http(port, _get("/metrics"))
            f = _families(body.decode())
            if _sample(f, "baton:spill_store_bytes", "baton:spill_store_bytes") == 12345:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("spill store size never exported")
        assert status == 200
    finally:
        await poller.stop()
        await sm.stop()


def test_engine_service_registers_the_gpu_collector_on_cuda() -> None:
    """Registration touches no device (the collector reads it at scrape time), so this runs on
    any machine; ``test_cuda_device_exports_gpu_memory`` checks the values on a GPU."""
    from types import SimpleNamespace

    from services.prefill.service import PrefillService
    from shared.observability.collectors import CudaCollector

    def collectors(device: str) -> list[object]:
        engine: object = SimpleNamespace(info=_info(kind="prefill"))
        service = PrefillService(BatonConfig(device=device), engine)  # type: ignore[arg-type]
        registry = service.shell.metrics.metrics.registry
        return [c for c in registry._collector_to_names if isinstance(c, CudaCollector)]

    assert len(collectors("cuda:0")) == 1
    assert collectors("cpu") == []


def test_swaps_feed_the_preemption_and_swap_in_counters() -> None:
    sm = ServiceMetrics(BatonConfig(max_num_seqs=8), "decode")
    sm.on_step(_stats(swaps_out_total=3, swaps_in_total=1))
    sm.on_step(_stats(swaps_out_total=3, swaps_in_total=2))  # running totals: deltas counted
    f = _families(sm.metrics.render().decode())
    swapped = _sample(f, "baton:num_preemptions", "baton:num_preemptions_total", mode="swap")
    assert swapped == 3
    assert _sample(f, "baton:num_swap_ins", "baton:num_swap_ins_total") == 2


def test_preemption_causes_and_prefetch_hits_feed_their_counters() -> None:
    sm = ServiceMetrics(BatonConfig(max_num_seqs=8), "decode")
    first = replace(_stats(), preemptions_by_cause={"priority_slot": 2})
    sm.on_step(replace(first, prefetch_hits_total=1))
    sm.on_step(replace(first, preemptions_by_cause={"priority_slot": 2, "kv_full": 1},
                       prefetch_hits_total=3))  # fmt: skip
    f = _families(sm.metrics.render().decode())
    by_cause = "baton:num_preemptions_by_cause"
    assert _sample(f, by_cause, f"{by_cause}_total", cause="priority_slot") == 2
    assert _sample(f, by_cause, f"{by_cause}_total", cause="kv_full") == 1
    assert _sample(f, "baton:kv_prefetch_hits", "baton:kv_prefetch_hits_total") == 3
