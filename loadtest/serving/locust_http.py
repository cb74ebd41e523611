"""A Locust user that speaks the OpenAI API to Baton's HTTP gateway, streaming.

    locust -f loadtest/serving/locust_http.py --headless -u 8 -r 2 -t 60s --host
    http://127.0.0.1:8000 \
        --csv loadtest/results/locust_http

The HTTP twin of ``BatonUser`` in loadtest/serving/locustfile.py: same workload (random token-id
prompts
of ``BATON_LOCUST_INPUT_LEN``, ``ignore_eos`` outputs of ``BATON_LOCUST_OUTPUT_LEN``, priorities
of ``BATON_LOCUST_PRIORITIES``, sent as Baton's ``priority`` extension field), same events (TTFT,
TPOT per token after the first, E2E, in ms, named by prompt bucket), same exact-percentile report
on stop (``<csv prefix>_raw.json``). Run both users against one system to see what the gateway
adds under load.

Each request is ``POST /v1/completions`` with ``stream: true`` and
``stream_options.include_usage``: TTFT is the first event carrying text, the output length is the
final usage chunk's ``completion_tokens``. A non-200 status, an error event in the stream, a stream
without ``[DONE]`` and a timeout are failures of E2E.

Requests go through a plain ``requests.Session`` per user (gevent-patched by Locust, so users
wait cooperatively) rather than Locust's ``HttpSession``, which would fire one more event per
request, timed at the response headers, beside the three above.

Env: BATON_LOCUST_* as for the AMQP user, BATON_API_KEY (sent as a bearer token), BATON_MODEL
(for the vocabulary). ``--host`` defaults to BATON_GATEWAY_URL or http://127.0.0.1:8000.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import requests
from locust import task

from loadtest.serving.locustfile import LoadUser  # (and the exact-percentile report on test stop)


class GatewayError(Exception):
    """An HTTP error, an error event, a broken stream or a timeout, as a Locust failure."""


class OpenAIHttpUser(LoadUser):
    host = os.environ.get("BATON_GATEWAY_URL", "http://127.0.0.1:8000")

    def on_start(self) -> None:
        super().on_start()
        self.session = requests.Session()
        self.session.trust_env = False  # an HTTP(S)_PROXY must not capture a local gateway
        if key := os.environ.get("BATON_API_KEY"):
            self.session.headers["Authorization"] = f"Bearer {key}"
        base = (self.host or "").rstrip("/")
        self.url = base + "/v1/completions"
        models = self.session.get(base + "/v1/models", timeout=10)
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]

    def on_stop(self) -> None:
        self.session.close()

    @task
    def generate(self) -> None:
        name, prompt, out_len, priority = self.draw()
        body = {
            "model": self.model, "prompt": list(prompt), "max_tokens": out_len,
            "temperature": 0, "ignore_eos": True, "priority": priority, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        sent_at = time.perf_counter()
        try:
            first_at, n_out, request_id = self._stream(body, sent_at)
        except (GatewayError, requests.RequestException) as exc:
            self.fail(name, sent_at, exc)
            return
        self.completed(name, request_id, sent_at, first_at, time.perf_counter(), n_out)

    def _stream(self, body: dict[str, Any], sent_at: float) -> tuple[float | None, int, str]:
        """Read one SSE response: (first text at, completion tokens, request id)."""
        deadline = sent_at + self.timeout_s
        with self.session.post(self.url, json=body, stream=True, timeout=(5, self.timeout_s)) as r:
            if r.status_code != 200:
                raise GatewayError(f"HTTP {r.status_code}: {_error_message(r.text)}")
            first_at: float | None = None
            n_out: int | None = None
            for line in r.iter_lines():
                if time.perf_counter() > deadline:
                    raise GatewayError(f"no end of stream within {self.timeout_s:g}s")
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :]
                if data == b"[DONE]":
                    if n_out is None:
                        raise GatewayError("stream ended without a usage chunk")
                    return first_at, n_out, r.headers.get("x-request-id", "")
                event = json.loads(data)
                if "error" in event:
                    raise GatewayError(_error_message(json.dumps(event)))
                if first_at is None and event["choices"] and event["choices"][0]["text"]:
                    first_at = time.perf_counter()
                if event.get("usage"):
                    n_out = int(event["usage"]["completion_tokens"])
        raise GatewayError("stream ended without [DONE]")


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]
