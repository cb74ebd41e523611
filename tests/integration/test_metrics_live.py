"""Each service's /metrics, /health and /ready on the running system; values move with load."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.client import BatonClient
from shared.protocol import DoneReply

pytestmark = pytest.mark.integration

SERVICES = ("tokenizer", "prefill", "decode", "detokenizer")  # port offsets 0..3 in `up`


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _scrape(port: int) -> dict[str, float]:
    status, text = _get(port, "/metrics")
    assert status == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


async def test_metrics_move_with_load(client: BatonClient, metrics_port: int) -> None:
    ports = {name: metrics_port + i for i, name in enumerate(SERVICES)}
    for port in ports.values():
        assert _get(port, "/health")[0] == 200
        assert _get(port, "/ready")[0] == 200
    before = {name: _scrape(port) for name, port in ports.items()}

    n, max_tokens = 12, 10
    replies = await asyncio.gather(
        *(
            client.generate(f"metrics probe {i} " * (i + 1), max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)
        )
    )
    assert all(isinstance(r, DoneReply) for r in replies)
    await asyncio.sleep(2.5)  # queue depths are polled every 2 s
    after = {name: _scrape(port) for name, port in ports.items()}

    def moved(service: str, key: str) -> float:
        return after[service].get(key, 0.0) - before[service].get(key, 0.0)

    # detokenizer: one TTFT/E2E observation per request served, success by finish reason
    assert moved("detokenizer", "baton:time_to_first_token_seconds_count") == n
    assert moved("detokenizer", "baton:e2e_request_latency_seconds_count") == n
    assert moved("detokenizer", "baton:time_per_output_token_seconds_count") == n
    assert moved("detokenizer", "baton:request_success_total{finish_reason=length}") == n
    # tokenizer: prompt tokens counted exactly
    prompt_tokens = sum(r.usage["prompt_tokens"] for r in replies)  # type: ignore[union-attr]
    assert moved("tokenizer", "baton:prompt_tokens_total") == prompt_tokens
    # prefill: batches ran, KV went through the transport
    assert moved("prefill", "baton:batch_size_count") >= 1
    assert moved("prefill", "baton:handoff_bytes_total{transport=shm}") > 0
    assert moved("prefill", "baton:prefix_cache_queries_total") >= prompt_tokens
    # decode: every token after the first was generated there
    assert moved("decode", "baton:generation_tokens_total") == n * (max_tokens - 1)
    assert moved("decode", "baton:handoff_seconds_count{transport=shm}") == n
    assert "baton:kv_cache_usage_perc" in after["decode"]
    assert "baton:queue_depth{queue=baton.requests}" in after["decode"]
    assert after["decode"]["baton:num_requests_running"] == 0
