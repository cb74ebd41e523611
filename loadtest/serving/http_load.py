"""The client side of ``serve-bench``: a workload streamed to an OpenAI-compatible server.

Each request is ``POST /v1/completions`` with the prompt as token ids, greedy, EOS ignored,
``stream: true`` and ``stream_options.include_usage``, sent at its arrival time (httpx, async,
one connection per request in flight). Its SSE events are timed as they arrive
(:class:`SseTimer`):

- TTFT: send → the first event whose choice carries non-empty text;
- ITL: the gaps between successive events carrying text (an event holding several tokens is one
  gap, as vLLM's client counts them);
- E2E: send → the end of the stream; output tokens: the usage event's ``completion_tokens``.

Events with empty text (a finish marker, a token that is an incomplete UTF-8 sequence) are not
token arrivals. A stream without ``[DONE]``, without usage, or with an error event is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from tqdm import tqdm

from loadtest.serving.workload import RequestResult, RequestSpec


class SseTimer:
    """Times one streamed completion from its SSE lines, fed with their arrival times."""

    def __init__(self, sent_at: float, num_prompt_tokens: int) -> None:
        self.sent_at = sent_at
        self.num_prompt_tokens = num_prompt_tokens
        self.first_at: float | None = None  # first event with text
        self.first_choice_at: float | None = None  # first event with a choice, text or not
        self.last_at: float | None = None
        self.itl: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None
        self.finish_reason: str | None = None

    def feed(self, line: str, at: float) -> None:
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separators, ": comments" (keep-alives), event: / id: fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or "bad_event"
            return
        if not isinstance(event, dict):
            self.error = self.error or "bad_event"
            return
        if "error" in event:
            err = event["error"]
            code = err.get("code") if isinstance(err, dict) else None
            self.error = self.error or str(code or "stream_error")
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        choices = event.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if self.first_choice_at is None:
            self.first_choice_at = at
        if not choice.get("text"):
            return
        if self.first_at is None:
            self.first_at = at
        elif self.last_at is not None:
            self.itl.append(at - self.last_at)
        self.last_at = at

    def result(self, ended_at: float) -> RequestResult:
        r = RequestResult(ok=False, num_prompt_tokens=self.num_prompt_tokens)
        r.finish_reason, r.itl = self.finish_reason, self.itl
        r.e2e = ended_at - self.sent_at
        # A stream whose every token decoded to no text (special tokens of a random model) still
        # had a first token: its first choice event.
        first = self.first_at if self.first_at is not None else self.first_choice_at
        r.ttft = None if first is None else first - self.sent_at
        if self.usage is not None:
            r.num_output_tokens = int(self.usage.get("completion_tokens") or 0)
            r.num_prompt_tokens = int(self.usage.get("prompt_tokens") or r.num_prompt_tokens)
        if self.error is not None:
            r.error = self.error
        elif not self.done:
            r.error = "no_done"
        elif self.usage is None:
            r.error = "no_usage"
        elif r.ttft is None and r.num_output_tokens > 0:
            r.error = "no_tokens"
        else:
            r.ok = True
        return r


def completion_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    return {
        "model": model, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


def http_client(base_url: str, n: int, timeout_s: float) -> httpx.AsyncClient:
    """Room for ``n`` connections at once: a pool smaller than the requests in flight would
    queue them in the client and charge the wait to the server's TTFT."""
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=max(n, 1), max_keepalive_connections=max(n, 1)),
        trust_env=False,  # an HTTP(S)_PROXY must not capture a local server
    )


async def stream_one(http: httpx.AsyncClient, model: str, spec: RequestSpec) -> RequestResult:
    sent_at = time.perf_counter()
    timer = SseTimer(sent_at, len(spec.prompt_token_ids))
    try:
        async with http.stream("POST", "/v1/completions", json=completion_body(model, spec)) as r:
            if r.status_code != 200:
                await r.aread()
                failed = timer.result(time.perf_counter())
                failed.ok, failed.error = False, f"http_{r.status_code}"
                return failed
            async for line in r.aiter_lines():
                timer.feed(line, time.perf_counter())
    except httpx.TimeoutException:
        timer.error = "client_timeout"
    except httpx.TransportError as exc:
        timer.error = f"transport:{type(exc).__name__}"
    return timer.result(time.perf_counter())


async def run_http_load(
    base_url: str, model: str, specs: list[RequestSpec], *, max_concurrency: int | None,
    timeout_s: float, label: str,
) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Send ``specs`` at their arrival times; (results in spec order, the run's duration: the
    first send to the last answer)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = [RequestResult(False, len(s.prompt_token_ids)) for s in specs]
    async with http_client(base_url, max_concurrency or len(specs), timeout_s) as http:
        bar = tqdm(total=len(specs), desc=label, unit="req", file=sys.stderr, mininterval=2.0)
        t0 = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
            async with limit or contextlib.nullcontext():
                results[i] = await stream_one(http, model, spec)
            bar.update(1)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration


async def wait_ready(
    base_url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float,
    tail: Callable[[], str] = lambda: "", name: str = "server",
) -> str:  # fmt: skip
    """Until ``GET /v1/models`` lists a model; returns its id. A server process that exits
    meanwhile fails at once, not at the timeout. A line every 30 s: a start can take minutes."""
    t0 = time.monotonic()
    deadline, next_note = t0 + timeout_s, t0 + 30.0
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0, trust_env=False) as http:
        while True:
            if time.monotonic() > next_note:
                print(f"{name}: still starting ({time.monotonic() - t0:.0f}s)", file=sys.stderr)
                next_note += 30.0
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail()}")
            with contextlib.suppress(httpx.TransportError, ValueError, KeyError, IndexError):
                r = await http.get("/v1/models")
                if r.status_code == 200:
                    return str(r.json()["data"][0]["id"])
            if time.monotonic() > deadline:
                raise TimeoutError(f"no model at {base_url}/v1/models after {timeout_s:g}s")
            await asyncio.sleep(1.0)


async def first_answer(
    base_url: str, model: str, spec: RequestSpec, proc: subprocess.Popen[bytes] | None,
    timeout_s: float,
) -> None:  # fmt: skip
    """Until one request is served in full: a gateway lists its model before the services
    behind it are up (it answers 503 until then)."""
    deadline = time.monotonic() + timeout_s
    async with http_client(base_url, 1, timeout_s) as http:
        while True:
            result = await stream_one(http, model, spec)
            if result.ok:
                return
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request served within {timeout_s:g}s ({result.error})")
            await asyncio.sleep(1.0)
