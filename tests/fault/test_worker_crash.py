"""A worker killed mid-request loses nothing: its unacked work is redelivered and replayed.

Decode holds each handoff unacked while the sequence runs. SIGKILL the decode process in the
middle of generation, start a new one, and every request still ends with exactly one ``done``
whose tokens equal an undisturbed run's (sampling is a function of seed and position, and the
detokenizer drops replayed positions)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.client import BatonClient
from shared.wire.messages import DoneReply
from tests.fault.harness import service_processes, streamed_done

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = [f"request number {i} tells a long story" for i in range(6)]
MAX_TOKENS = 600


async def _run_all(client: BatonClient, seen: list[int]) -> list[DoneReply]:
    async def one(i: int, prompt: str) -> DoneReply:
        kw = dict(max_tokens=MAX_TOKENS, ignore_eos=True, wait_s=240)
        if i % 2:
            kw.update(temperature=0.8, seed=i)
        return await streamed_done(client.stream(prompt, **kw), seen, i)  # type: ignore[arg-type]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


async def test_decode_killed_mid_generation_loses_nothing() -> None:
    with service_processes() as procs:
        await procs.wait_ready()
        async with await BatonClient.connect(procs.amqp_url) as client:
            reference = await _run_all(client, [0] * len(PROMPTS))

            seen = [0] * len(PROMPTS)
            run = asyncio.create_task(_run_all(client, seen))
            deadline = time.monotonic() + 60
            while min(seen) < 20 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert min(seen) >= 20, "generation did not start"
            assert max(seen) < MAX_TOKENS, "finished before the crash: raise MAX_TOKENS"
            procs.kill("decode")
            await asyncio.sleep(0.5)
            procs.start("decode")
            crashed = await asyncio.wait_for(run, 240)
        log = procs.tail(400)

    # the new decode worker got the redelivered handoffs and rebuilt their KV itself
    assert "KV gone; recomputing" in log

    for ref, got in zip(reference, crashed, strict=True):
        assert got.finish_reason == "length"
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == ref.token_ids  # the replay regenerated the same tokens
