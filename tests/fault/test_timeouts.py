"""Timeouts by prompt length, end to end: a request whose deadline passes while it waits in a queue
is answered ``timeout`` at its deadline and never computed; one with a longer prompt, hence a
longer default deadline, waits out the same outage and is served.

The server's default deadline is base + per prompt token + per output token
(``BATON_DEFAULT_TIMEOUT_*``), shortened by a client's ``timeout_s``. With prefill down, the
detokenizer answers each request at its deadline; when prefill comes back it takes the expired
requests off its queue without prefilling them (the engine refuses them as stale), which its
metrics show: one prompt prefilled, the one still in time.
"""

from __future__ import annotations

import time
import uuid

import aio_pika
import pytest

from shared.wire.messages import DoneReply, ErrorReply, RequestMsg, SamplingParams
from shared.wire.queues import PREFILL_QUEUE
from tests.fault.harness import ReplyLog, scrape, service_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {
    "BATON_DEFAULT_TIMEOUT_BASE_S": "1.0",
    "BATON_DEFAULT_TIMEOUT_PER_PROMPT_TOKEN_S": "0.05",
    "BATON_DEFAULT_TIMEOUT_PER_OUTPUT_TOKEN_S": "0.05",
}


def request(num_prompt_tokens: int, timeout_s: float | None = None) -> RequestMsg:
    return RequestMsg(
        request_id=f"t{num_prompt_tokens}-{uuid.uuid4().hex[:8]}",
        sampling=SamplingParams(max_tokens=4, ignore_eos=True),
        prompt_token_ids=tuple(3 + i % 400 for i in range(num_prompt_tokens)),
        timeout_s=timeout_s,
    )


async def test_a_request_past_its_deadline_is_answered_timeout_and_never_computed() -> None:
    with service_processes(ENV, metrics=True) as procs:
        await procs.wait_ready()
        tokenizer = procs.metrics_port("tokenizer")
        before = scrape(tokenizer)
        procs.kill("prefill")
        async with ReplyLog(procs.amqp_url) as log:
            short = request(10)  # default deadline 1 + 0.5 + 0.2 = 1.7 s
            shortened = request(300, timeout_s=1.0)  # the client's 1 s beats 16.2 s
            long = request(300)  # 1 + 15 + 0.2 = 16.2 s: outlives the outage
            t0 = time.monotonic()
            await log.send([short, shortened, long])
            await log.wait([short.request_id, shortened.request_id], timeout_s=15)
            waited = time.monotonic() - t0
            for rid in (short.request_id, shortened.request_id):
                [reply] = log.terminals(rid)
                assert isinstance(reply, ErrorReply) and reply.code == "timeout", reply
            assert not log.terminals(long.request_id)
            assert waited < 5, waited  # answered at the deadline, not at some later sweep

            procs.start("prefill")  # its counters start at zero
            await log.wait([long.request_id], timeout_s=60)
            [done] = log.terminals(long.request_id)
            assert isinstance(done, DoneReply) and len(done.token_ids) == 4, done

        prefill = scrape(procs.metrics_port("prefill"))
        after = scrape(tokenizer)
        connection = await aio_pika.connect(procs.amqp_url)
        async with connection:
            queue = await (await connection.channel()).declare_queue(PREFILL_QUEUE, passive=True)
            left = queue.declaration_result.message_count
    # Prefill took all three off its queue and computed only the one still in time.
    assert left == 0
    assert prefill["baton:generation_tokens_total"] == 1  # first tokens: one per prompt
    assert prefill["baton:batch_size_sum"] == 1  # sequences in forwards
    # The tokenizer gave two default deadlines (by length) and took one client timeout.
    source = "baton:request_deadlines_total{source=%s}"
    assert after[source % "default"] - before.get(source % "default", 0.0) == 2
    assert after[source % "client"] - before.get(source % "client", 0.0) == 1
