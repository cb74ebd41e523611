"""Each service's /metrics, /health and /ready on the running system; values move with load,
and the KV handoffs went through the system's transport (for ``pool``: pinned, released, never
the spill store)."""

from __future__ import annotations

import asyncio
import os
import urllib.request

import pytest

from services.launcher import LocalSystem
from services.shell.registry import METRICS_ENDPOINTS, port_offset
from shared.client import BatonClient
from shared.observability.http_server import read_metrics
from shared.wire.messages import DoneReply

pytestmark = pytest.mark.integration


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


async def test_metrics_move_with_load(
    client: BatonClient, system: LocalSystem, metrics_port: int, transport: str
) -> None:
    ports = {name: metrics_port + port_offset(name) for name in METRICS_ENDPOINTS}
    for port in ports.values():
        assert _get(port, "/health")[0] == 200
        assert _get(port, "/ready")[0] == 200
    before = {name: read_metrics(port) for name, port in ports.items()}

    n, max_tokens = 12, 10
    replies = await asyncio.gather(
        *(
            client.generate(f"metrics probe {i} " * (i + 1), max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)
        )
    )
    assert all(isinstance(r, DoneReply) for r in replies)
    await asyncio.sleep(2.5)  # queue depths are polled every 2 s
    after = {name: read_metrics(port) for name, port in ports.items()}

    def moved(service: str, key: str) -> float:
        return after[service].get(key, 0.0) - before[service].get(key, 0.0)

    prompt_tokens = sum(r.usage["prompt_tokens"] for r in replies)  # type: ignore[union-attr]
    # detokenizer: one TTFT/E2E observation per request served, success by finish reason
    assert moved("detokenizer", "baton:pipeline_time_to_first_token_seconds_count") == n
    assert moved("detokenizer", "baton:pipeline_e2e_request_latency_seconds_count") == n
    assert moved("detokenizer", "baton:pipeline_request_time_per_output_token_seconds_count") == n
    assert moved("detokenizer", "baton:request_decode_time_seconds_count") == n
    assert moved("detokenizer", "baton:request_success_total{finished_reason=length}") == n
    # the engines: tokens per step (prefill: prompt tokens computed; decode: one per sequence)
    assert moved("prefill", "baton:iteration_tokens_total_sum") > 0
    assert moved("decode", "baton:iteration_tokens_total_sum") == n * (max_tokens - 1)
    # tokenizer: prompt tokens counted exactly
    assert moved("tokenizer", "baton:prompt_tokens_total") == prompt_tokens
    # prefill: batches ran, KV went through the transport
    assert moved("prefill", "baton:batch_size_count") >= 1
    assert moved("prefill", f"baton:handoff_bytes_total{{transport={transport}}}") > 0
    assert moved("prefill", "baton:prefix_cache_queries_total") >= prompt_tokens
    # decode: every token after the first was generated there, on KV loaded from the transport
    assert moved("decode", "baton:generation_tokens_total") == n * (max_tokens - 1)
    assert moved("decode", f"baton:handoff_seconds_count{{transport={transport}}}") == n
    assert moved("decode", f"baton:handoff_bytes_total{{transport={transport}}}") > 0
    assert "baton:kv_cache_usage_perc" in after["decode"]
    # both engines took their thread counts from the shared budget: 1..all cores per forward
    cores = len(os.sched_getaffinity(0))
    for engine in ("prefill", "decode"):
        used = moved(engine, "baton:forward_thread_seconds_total")
        mean_threads = used / moved(engine, "baton:forward_seconds_sum")
        assert 1 - 1e-9 <= mean_threads <= cores + 1e-9
        assert 1 <= after[engine]["baton:engine_threads"] <= cores
    assert "baton:queue_depth{queue=baton.requests}" in after["decode"]
    assert after["decode"]["baton:num_requests_running"] == 0
    assert after["decode"]["baton:kv_blocks_used"] == 0
    # no handoff took another way, and none was refused or recomputed
    for service in ("prefill", "decode"):
        for other in {"shm", "pool"} - {transport}:
            assert after[service].get(f"baton:handoff_bytes_total{{transport={other}}}", 0) == 0
        assert after[service]["baton:kv_handoff_fallbacks_total"] == 0
    assert moved("decode", "baton:kv_map_failures_total") == 0
    assert moved("decode", "baton:kv_stale_loads_total") == 0
    if transport == "pool":
        # Every pin was released by decode's notice (none left to a lease) once idle, and
        # nothing went through the spill store: its folder holds the pool file alone.
        assert after["prefill"]["baton:kv_blocks_pinned"] == 0
        assert after["prefill"]["baton:kv_blocks_used"] == 0
        assert moved("prefill", "baton:kv_leases_expired_total") == 0
        assert after["prefill"].get("baton:spill_store_bytes", 0) == 0
        names = os.listdir(system.spill_dir)
        assert [f for f in names if f.startswith("pool-")] and not [
            f for f in names if f.endswith((".kv", ".tmp"))
        ], names
