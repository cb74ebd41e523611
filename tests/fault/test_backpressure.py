"""Admission by queue depth: with prefill down, the backlog fills to its limit, new requests are
refused with ``overloaded`` at once, and the accepted ones are served once prefill is back."""

from __future__ import annotations

import asyncio

import pytest

from shared.client import BatonClient
from shared.wire.messages import DoneReply, ErrorReply
from tests.fault.harness import service_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_overloaded_when_prefill_backlog_is_full_then_accepted_work_completes() -> None:
    with service_processes({"BATON_MAX_PREFILL_BACKLOG": "2"}) as procs:
        await procs.wait_ready()
        procs.kill("prefill")
        async with await BatonClient.connect(procs.amqp_url) as client:
            accepted = [
                asyncio.create_task(
                    client.generate(f"queued {i}", max_tokens=4, ignore_eos=True, wait_s=180)
                )
                for i in range(2)
            ]
            await asyncio.sleep(1.5)  # the tokenizer polls the backlog every 0.25 s
            refused = await client.generate("one too many", max_tokens=4, wait_s=30)
            assert isinstance(refused, ErrorReply) and refused.code == "overloaded"
            assert "backlog" in refused.message
            procs.start("prefill")
            done = await asyncio.gather(*accepted)
            assert all(isinstance(d, DoneReply) and len(d.token_ids) == 4 for d in done), done
            await asyncio.sleep(1.0)  # the backlog drained: admitted again
            again = await client.generate("room again", max_tokens=2, wait_s=120)
            assert isinstance(again, DoneReply)
