"""The pure parts of ``python -m loadtest serve-bench``: gamma arrivals, the SSE timing of a
recorded stream, the summary, the table and the plot. No server, no vLLM."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from loadtest.serving import http_load
from loadtest.serving.http_load import SseTimer
from loadtest.serving.serve_bench import parse_args, plot, table
from loadtest.serving.workload import (
    RequestResult,
    RequestSpec,
    Slo,
    gamma_arrivals,
    make_workload,
    poisson_arrivals,
    summarize,
)

# `vllm serve` (0.32, CPU), 5 tokens: one per event, the finish reason on the last one with text.
VLLM_STREAM = [
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" Edmi",'
    '"finish_reason":null}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"ingzo",'
    '"finish_reason":null}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"oru",'
    '"finish_reason":null}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"oringsa",'
    '"finish_reason":null}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" fenanteka",'
    '"finish_reason":"length"}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","choices":[],'
    '"usage":{"prompt_tokens":6,"total_tokens":11,"completion_tokens":5}}',
    "",
    "data: [DONE]",
]

# Baton's gateway paces a stream (BATON_STREAM_INTERVAL_S): an event may carry several tokens;
# the finish reason comes in an event of its own with empty text; a keep-alive comment.
BATON_STREAM = [
    'data: {"id":"cmpl-b","object":"text_completion","choices":[{"index":0,"text":"a",'
    '"finish_reason":null}],"usage":null}',
    ": keep-alive",
    'data: {"id":"cmpl-b","object":"text_completion","choices":[{"index":0,"text":"bcd",'
    '"finish_reason":null}],"usage":null}',
    'data: {"id":"cmpl-b","object":"text_completion","choices":[{"index":0,"text":"ef",'
    '"finish_reason":null}],"usage":null}',
    'data: {"id":"cmpl-b","object":"text_completion","choices":[{"index":0,"text":"",'
    '"finish_reason":"length"}],"usage":null}',
    'data: {"id":"cmpl-b","object":"text_completion","choices":[],'
    '"usage":{"prompt_tokens":4,"completion_tokens":6,"total_tokens":10}}',
    "data: [DONE]",
]


def feed(lines: list[str], times: list[float], sent_at: float = 10.0) -> SseTimer:
    timer = SseTimer(sent_at, num_prompt_tokens=4)
    for line, at in zip(lines, times, strict=True):
        timer.feed(line, at)
    return timer


# --- arrivals ---------------------------------------------------------------------------------


def test_gamma_arrivals_of_burstiness_one_are_the_poisson_ones() -> None:
    """Burstiness 1 draws exactly what poisson_arrivals draws, so a default workload is the
    same requests whichever function built it."""
    a = gamma_arrivals(np.random.default_rng(3), 50, 4.0, 1.0)
    assert a == poisson_arrivals(np.random.default_rng(3), 50, 4.0)
    w = make_workload(8, 16, 4, 100, seed=5, rate=2.0)
    assert w == make_workload(8, 16, 4, 100, seed=5, rate=2.0, burstiness=1.0)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_vary_with_the_shape(burstiness: float) -> None:
    """Mean gap 1/rate at any shape; the gaps' coefficient of variation is 1/sqrt(shape)
    (vLLM's --burstiness: below 1 burstier than Poisson, above 1 more even)."""
    arrivals = gamma_arrivals(np.random.default_rng(0), 40_000, 8.0, burstiness)
    assert arrivals[0] == 0.0
    gaps = np.diff(arrivals)
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_gamma_arrivals_edge_cases() -> None:
    rng = np.random.default_rng(0)
    assert gamma_arrivals(rng, 3, math.inf, 0.5) == [0.0, 0.0, 0.0]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            gamma_arrivals(rng, 3, 4.0, bad)
    with pytest.raises(ValueError):
        gamma_arrivals(rng, 3, 0.0, 0.5)
    bursty = make_workload(6, 8, 4, 100, seed=1, rate=4.0, burstiness=0.5)
    plain = make_workload(6, 8, 4, 100, seed=1, rate=4.0)
    assert [s.prompt_token_ids for s in bursty] == [s.prompt_token_ids for s in plain]
    assert [s.arrival_s for s in bursty] != [s.arrival_s for s in plain]


# --- SSE timing -------------------------------------------------------------------------------


def test_vllm_stream_gives_ttft_itl_and_usage_tokens() -> None:
    times = [10.2, 0, 10.25, 0, 10.31, 0, 10.36, 0, 10.40, 0, 10.41, 0, 10.42]
    r = feed(VLLM_STREAM, times).result(ended_at=10.42)
    assert r.ok and r.error is None
    assert r.ttft == pytest.approx(0.2)
    assert r.itl == pytest.approx([0.05, 0.06, 0.05, 0.04])
    assert r.e2e == pytest.approx(0.42)
    assert r.num_output_tokens == 5 and r.num_prompt_tokens == 6
    assert r.finish_reason == "length"
    assert r.tpot == pytest.approx((0.42 - 0.2) / 4)


def test_baton_stream_of_several_tokens_per_event() -> None:
    """An event of several tokens is one ITL gap; the empty finish event is no token; the
    output length is usage's, not the count of events; TPOT spreads the time over tokens."""
    times = [10.1, 10.12, 10.15, 10.2, 10.21, 10.22, 10.23]
    r = feed(BATON_STREAM, times).result(ended_at=10.23)
    assert r.ok
    assert r.ttft == pytest.approx(0.1)
    assert r.itl == pytest.approx([0.05, 0.05])  # "a" -> "bcd" -> "ef", not the finish event
    assert r.num_output_tokens == 6
    assert r.tpot == pytest.approx((0.23 - 0.1) / 5)
    assert r.finish_reason == "length"


def test_stream_failures() -> None:
    usage = BATON_STREAM[-2]
    cut = feed(BATON_STREAM[:3], [10.1, 10.12, 10.15]).result(10.2)
    assert not cut.ok and cut.error == "no_done"
    no_usage = feed([BATON_STREAM[0], "data: [DONE]"], [10.1, 10.2]).result(10.2)
    assert not no_usage.ok and no_usage.error == "no_usage"
    err = '{"error": {"message": "engine failed", "type": "server_error", "code": "internal"}}'
    broken = feed([BATON_STREAM[0], f"data: {err}", "data: [DONE]"], [10.1, 10.2, 10.3])
    assert broken.result(10.3).error == "internal"
    garbage = feed(["data: {not json", usage, "data: [DONE]"], [10.1, 10.2, 10.3])
    assert garbage.result(10.3).error == "bad_event"


def test_stream_without_text_times_the_first_choice() -> None:
    """Tokens that decode to no text (special tokens of a random model) still arrived."""
    empty = BATON_STREAM[3]
    r = feed([empty, BATON_STREAM[-2], "data: [DONE]"], [10.3, 10.4, 10.4]).result(10.4)
    assert r.ok and r.ttft == pytest.approx(0.3) and r.itl == []


async def test_stream_one_over_http() -> None:
    """The request body vLLM and Baton both take, and the recorded stream read back."""
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["max_tokens"] == 99:
            return httpx.Response(503, json={"error": {"code": "overloaded"}})
        return httpx.Response(200, text="\n".join(BATON_STREAM) + "\n")

    spec = RequestSpec((5, 6, 7, 8), max_tokens=6)
    async with httpx.AsyncClient(
        base_url="http://test", transport=httpx.MockTransport(handler)
    ) as http:
        r = await http_load.stream_one(http, "m", spec)
        refused = await http_load.stream_one(http, "m", RequestSpec((5,), max_tokens=99))
    assert r.ok and r.num_output_tokens == 6 and len(r.itl) == 2
    assert not refused.ok and refused.error == "http_503"
    assert seen[0] == {
        "model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


# --- summary, table, plot ---------------------------------------------------------------------


def result(ttft: float, e2e: float, n: int, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, num_prompt_tokens=8, num_output_tokens=n, ttft=ttft, e2e=e2e,
                         itl=[(e2e - ttft) / max(n - 1, 1)] * (n - 1))  # fmt: skip


def runs_of(slo: Slo) -> list[dict[str, Any]]:
    fast = [result(0.1, 0.1 + 0.02 * 31, 32), result(0.2, 0.2 + 0.04 * 31, 32)]
    slow_tpot = [result(0.1, 0.1 + 0.08 * 31, 32), result(0.9, 0.9 + 0.02 * 31, 32)]
    broken = [result(0.1, 0.5, 32), RequestResult(ok=False, num_prompt_tokens=8, error="x")]
    return [
        {"server": "baton", "rate": 4.0, "summary": summarize(fast, 2.0, slo)},
        {"server": "vllm", "rate": 4.0, "summary": summarize(slow_tpot, 2.0, slo)},
        {"server": "vllm", "rate": 8.0, "summary": summarize(broken, 1.0, slo)},
    ]


def test_goodput_needs_both_slos() -> None:
    slo = Slo(0.5, 0.05)
    runs = runs_of(slo)
    fast, slow, broken = (r["summary"] for r in runs)
    assert fast.goodput == pytest.approx(1.0) and fast.slo_attainment == 1.0
    assert fast.output_throughput == pytest.approx(32.0)
    assert fast.tpot.p50 == pytest.approx(0.03)
    # one misses TPOT (80 ms/token), the other TTFT (0.9 s): none meets both
    assert slow.goodput == 0.0 and slow.slo_attainment == 0.0
    # a failed request counts against attainment, not towards throughput
    assert broken.completed == 1 and broken.failed == 1
    assert broken.slo_attainment == 0.5 and broken.request_throughput == 1.0


def test_table_and_plot(tmp_path: Path) -> None:
    slo = Slo(0.5, 0.05)
    runs = runs_of(slo)
    text = table(runs, slo)
    lines = text.splitlines()
    assert "TTFT <= 500 ms and TPOT <= 50 ms" in lines[0]
    assert len(lines) == 2 + len(runs)
    assert lines[2].split()[:4] == ["baton", "4", "2", "0"] and lines[2].endswith("100%")
    assert lines[4].split()[-2:] == ["1.00", "50%"]  # 1 good request in 1 s
    empty = {"server": "baton", "rate": math.inf, "summary": summarize([], 1.0, slo)}
    assert "nan" in table([empty], slo)  # no request, no figures: printed, not raised
    png = tmp_path / "serve.png"
    plot(png, runs, slo, "test")
    assert png.stat().st_size > 0


def test_command_line() -> None:
    args = parse_args(["--rates", "2,4,inf", "--servers", "vllm"])
    assert args.rate_list == [2.0, 4.0, math.inf] and args.server_list == ["vllm"]
    assert parse_args([]).rate_list == [1.0]
    assert (args.slo_ttft, args.slo_tpot) == (0.5, 0.05)
    with pytest.raises(SystemExit):
        parse_args(["--servers", "baton,tgi"])
    with pytest.raises(SystemExit):
        parse_args(["--model", "x", "--model-shape", "bench"])


def test_vllm_bench_reports_a_sigill_crash(tmp_path: Path) -> None:
    """vLLM's CPU build dies of SIGILL importing its bench client on a CPU without AVX-512: the
    harness says so instead of failing (a stand-in python that does the same)."""
    import subprocess
    import sys

    from loadtest.serving.serve_targets import Server, vllm_bench

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nkill -ILL $$\n")
    python.chmod(0o755)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    server = Server("baton", "http://127.0.0.1:1", done, lambda: "")
    args = parse_args(["--num-requests", "2"])
    got = vllm_bench(python, server, "m", tmp_path, 4.0, args, tmp_path)
    assert not got["ok"] and "SIGILL" in got["error"]
