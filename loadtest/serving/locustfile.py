"""Locust users for Baton.

    locust -f loadtest/serving/locustfile.py --headless -u 8 -r 2 -t 60s --csv
    loadtest/results/locust

Locust runs on gevent, where aio-pika's asyncio does not, so each user holds a pika
BlockingConnection (gevent patches its sockets and select, so users wait cooperatively) with its
own exclusive reply queue. Each request fires three Locust request events, named by prompt
bucket: TTFT, TPOT (per token after the first) and E2E, in ms; error replies, unroutable publishes
(Baton not running) and timeouts are failures of E2E. The UI, --headless, --csv and percentiles all
work as usual. Locust rounds the response times it stores, so every sample is also kept raw and
written on test stop to ``<csv prefix>_raw.json`` (or ``BATON_LOCUST_RAW``), with exact p50/p99
and goodput printed.

Env: BATON_AMQP_URL, BATON_LOCUST_INPUT_LEN / _OUTPUT_LEN / _PRIORITIES (mixes such as
"32:0.5,512:0.5" or "0:0.8,5:0.2"), BATON_LOCUST_TIMEOUT_S (default 120), BATON_LOCUST_SLO_TTFT /
_SLO_TPOT (seconds, default 2 and 0.2), BATON_LOCUST_SEED, BATON_MODEL (for the vocabulary; prompts
are random token ids).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pika
import pika.exceptions
from locust import User, constant, events, task
from locust.env import Environment

from loadtest.serving.workload import LoadMix, Slo, Stat, random_token_ids, read_vocab, tpot
from shared.client.connection import split_urls
from shared.config import DEFAULT_AMQP_URL, REPO_ROOT, BatonConfig
from shared.models.catalog import resolve_model
from shared.wire.messages import (
    DoneReply,
    ErrorReply,
    ProtocolError,
    RequestMsg,
    SamplingParams,
    TokenReply,
    decode_reply,
)
from shared.wire.queues import REQUESTS_QUEUE

logging.getLogger("pika").setLevel(logging.WARNING)  # pika logs every connection step at INFO


class BatonError(Exception):
    """An error reply, an unroutable publish or a timeout, as a Locust failure."""


class _Exchange:
    """The replies of the one request a user has in flight (a user is sequential)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sent_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.terminal: DoneReply | ErrorReply | None = None
        self.terminal_at = 0.0
        self.bad_reply: str | None = None


class LoadUser(User):
    """The workload and the events both users share: a prompt drawn from the BATON_LOCUST_* mix,
    and per request TTFT, TPOT and E2E events (ms) named by prompt bucket."""

    abstract = True
    wait_time = constant(float(os.environ.get("BATON_LOCUST_WAIT_S", "0")))

    def on_start(self) -> None:
        env = os.environ
        self.mix = LoadMix.from_env(env)
        self.timeout_s = float(env.get("BATON_LOCUST_TIMEOUT_S", "120"))
        self.vocab_size, self.special = read_vocab(resolve_model(BatonConfig.from_env().model))
        seed = int(env.get("BATON_LOCUST_SEED", "0"))
        self.rng = np.random.default_rng([seed, id(self) & 0xFFFFFFFF])

    def draw(self) -> tuple[str, tuple[int, ...], int, int]:
        """(event name, prompt token ids, output tokens, priority) of the next request."""
        in_len, out_len, priority = self.mix.sample(self.rng)
        prompt = random_token_ids(self.rng, in_len, self.vocab_size, self.special)
        return f"prompt={in_len}", prompt, out_len, priority

    def fire(self, kind: str, name: str, ms: float, length: int = 0, **kw: Any) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=ms, response_length=length, **kw
        )

    def fail(self, name: str, sent_at: float, exc: BaseException, request_id: str = "") -> None:
        ms = 1000 * (time.perf_counter() - sent_at)
        self.fire("E2E", name, ms, exception=exc, context={"request_id": request_id})

    def completed(
        self, name: str, request_id: str, sent_at: float, first_at: float | None, end_at: float,
        n_out: int,
    ) -> None:  # fmt: skip
        e2e = end_at - sent_at
        ttft = (first_at or end_at) - sent_at
        per_token = tpot(ttft, e2e, n_out)
        ctx = {"request_id": request_id, "ttft_s": ttft, "tpot_s": per_token, "n_out": n_out}
        self.fire("TTFT", name, 1000 * ttft)
        if per_token is not None:
            self.fire("TPOT", name, 1000 * per_token)
        self.fire("E2E", name, 1000 * e2e, n_out, context=ctx)


class BatonUser(LoadUser):
    def on_start(self) -> None:
        super().on_start()
        self.url = os.environ.get("BATON_AMQP_URL") or DEFAULT_AMQP_URL
        self.current: _Exchange | None = None
        # Every address of a broker cluster's URL, tried in turn (shared/client/connection.py).
        addresses = [pika.URLParameters(url) for url in split_urls(self.url)]
        self.connection = pika.BlockingConnection(addresses)
        self.channel = self.connection.channel()
        self.channel.confirm_delivery()  # unroutable mandatory publishes raise UnroutableError
        # Named as the client library names its reply queues: a broker user of the client role
        # (Compose's baton-client) may declare and read baton.reply.* and nothing server-named.
        self.reply_queue = f"baton.reply.locust-{uuid.uuid4().hex}"
        self.channel.queue_declare(queue=self.reply_queue, exclusive=True, auto_delete=True)
        self.channel.basic_consume(self.reply_queue, self._on_reply, auto_ack=True)

    def on_stop(self) -> None:
        if self.connection.is_open:
            self.connection.close()

    def _on_reply(self, _ch: Any, _method: Any, props: pika.BasicProperties, body: bytes) -> None:
        now = time.perf_counter()
        ex = self.current
        if ex is None or props.correlation_id != ex.request_id:
            return  # a late reply of a request that already timed out
        try:
            reply = decode_reply(body, BatonConfig().max_message_bytes)
        except ProtocolError as exc:
            ex.bad_reply = str(exc)
            return
        if isinstance(reply, TokenReply):
            ex.first_token_at = ex.first_token_at or now
        else:
            ex.terminal, ex.terminal_at = reply, now

    @task
    def generate(self) -> None:
        name, prompt, out_len, priority = self.draw()
        ex = self.current = _Exchange(uuid.uuid4().hex)
        body = RequestMsg(
            request_id=ex.request_id,
            sampling=SamplingParams(max_tokens=out_len, ignore_eos=True),
            prompt_token_ids=prompt,
            priority=priority,
        ).encode()
        props = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent, correlation_id=ex.request_id,
            reply_to=self.reply_queue, priority=priority, content_type="application/msgpack",
        )  # fmt: skip
        ex.sent_at = time.perf_counter()
        try:
            self.channel.basic_publish("", REQUESTS_QUEUE, body, props, mandatory=True)
            deadline = ex.sent_at + self.timeout_s
            while ex.terminal is None and ex.bad_reply is None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise BatonError(f"no terminal reply within {self.timeout_s:g}s")
                self.connection.process_data_events(time_limit=min(left, 1.0))
            if ex.bad_reply is not None:
                raise BatonError(f"undecodable reply: {ex.bad_reply}")
        except pika.exceptions.UnroutableError:
            no_queue = BatonError(f"no queue {REQUESTS_QUEUE!r}: is Baton running?")
            self.fail(name, ex.sent_at, no_queue, ex.request_id)
            return
        except BatonError as exc:
            self.fail(name, ex.sent_at, exc, ex.request_id)
            return
        finally:
            self.current = None
        done = ex.terminal
        if not isinstance(done, DoneReply):
            error = BatonError(f"{done.code}: {done.message}") if done else BatonError("no reply")
            self.fail(name, ex.sent_at, error, ex.request_id)
            return
        n_out = int(done.usage.get("completion_tokens", len(done.token_ids)))
        self.completed(name, ex.request_id, ex.sent_at, ex.first_token_at, ex.terminal_at, n_out)


# --- exact percentiles on test stop ----------------------------------------------------------


class RawSamples:
    """Every request event as fired (unrounded), written out when the test stops."""

    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        self.samples: list[dict[str, Any]] = []

    def reset(self, **_: Any) -> None:
        self.samples.clear()

    def on_request(
        self, request_type: str, name: str, response_time: float, exception: Any = None,
        context: dict[str, Any] | None = None, **_: Any,
    ) -> None:  # fmt: skip
        sample = {"type": request_type, "name": name, "ms": response_time, "ok": exception is None,
                  "end": time.time()}  # fmt: skip
        if exception is not None:
            sample["error"] = str(exception)
        if context:
            sample.update({k: v for k, v in context.items() if k != "request_id"})
        self.samples.append(sample)

    def write(self, **_: Any) -> None:
        if not self.samples:
            return
        # the span of the requests themselves (first send to last reply), for goodput
        duration = max(s["end"] for s in self.samples) - min(
            s["end"] - s["ms"] / 1000 for s in self.samples
        )
        env = os.environ
        slo = Slo(float(env.get("BATON_LOCUST_SLO_TTFT", "2")),
                  float(env.get("BATON_LOCUST_SLO_TPOT", "0.2")))  # fmt: skip
        e2e = [s for s in self.samples if s["type"] == "E2E"]
        good = [
            s for s in e2e
            if s["ok"] and s["ttft_s"] <= slo.ttft_s
            and (s["tpot_s"] is None or s["tpot_s"] <= slo.tpot_s)
        ]  # fmt: skip
        print(f"\nBaton exact latencies over {duration:.1f}s (ms; from unrounded samples):")
        print(f"  {'type':<6}{'name':<16}{'count':>7}{'fail':>6}{'mean':>10}{'p50':>10}{'p99':>10}")
        names = sorted({s["name"] for s in self.samples}, key=lambda n: (len(n), n))
        for kind in ("TTFT", "TPOT", "E2E"):
            of_kind = [s for s in self.samples if s["type"] == kind]
            for name in [*names, "Aggregated"] if len(names) > 1 else names:
                rows = [s for s in of_kind if name in (s["name"], "Aggregated")]
                if not rows:
                    continue
                st = Stat.of([s["ms"] for s in rows if s["ok"]])
                fails = sum(not s["ok"] for s in rows)
                print(f"  {kind:<6}{name:<16}{st.count:>7}{fails:>6}{st.mean:>10.1f}"
                      f"{st.p50:>10.1f}{st.p99:>10.1f}")  # fmt: skip
        print(f"  goodput (TTFT<={slo.ttft_s:g}s, TPOT<={slo.tpot_s:g}s): "
              f"{len(good) / duration:.2f} req/s ({len(good)}/{len(e2e)} met both)")  # fmt: skip
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"duration_s": duration, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                "goodput": len(good) / duration}  # fmt: skip
        path.write_text(json.dumps({**meta, "samples": self.samples}) + "\n")
        print(f"  raw samples: {path}")

    def path(self) -> Path:
        if explicit := os.environ.get("BATON_LOCUST_RAW"):
            return Path(explicit)
        prefix = getattr(self.environment.parsed_options, "csv_prefix", None)
        if prefix:
            return Path(f"{prefix}_raw.json")
        return REPO_ROOT / "loadtest" / "results" / "locust_raw.json"


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    raw = RawSamples(environment)
    environment.events.request.add_listener(raw.on_request)
    environment.events.test_start.add_listener(raw.reset)
    environment.events.test_stop.add_listener(raw.write)
