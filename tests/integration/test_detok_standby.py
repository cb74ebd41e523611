"""A lone detokenizer replica answers the requests of every shard from its start: a shard that
holds work and has no consumer is taken at once, not after the standby delay that lets replicas
started together each take their home shard first (services/detokenizer/service.py). Before,
the requests hashed to its second shard waited out the delay (1 s by default)."""

from __future__ import annotations

import time
import uuid

import pytest

from loadtest.faults.reply_log import ReplyLog
from shared.wire.messages import RequestMsg, SamplingParams
from shared.wire.queues import detok_queue_for
from tests.integration.conftest import running_system

pytestmark = pytest.mark.integration

STANDBY_DELAY_S = 120.0  # far longer than starting the system and answering takes


def on_shard(shard: int, count: int) -> list[str]:
    ids: list[str] = []
    while len(ids) < count:
        rid = f"standby-{uuid.uuid4().hex[:10]}"
        if detok_queue_for(rid, 2) == f"baton.detok.{shard}":
            ids.append(rid)
    return ids


async def test_a_lone_detokenizer_takes_its_unattended_shard_at_once() -> None:
    started = time.monotonic()
    env = {
        "BATON_DETOK_SHARDS": "2",
        "BATON_DETOK_HOME_SHARD": "0",
        "BATON_DETOK_STANDBY_DELAY_S": str(STANDBY_DELAY_S),
    }
    async with (
        running_system("shm", env=env, tag="-standby") as system,
        ReplyLog(system.amqp_url) as log,
    ):
        ids = await log.send(
            RequestMsg(
                request_id=rid,
                sampling=SamplingParams(max_tokens=4, ignore_eos=True),
                prompt_token_ids=(5, 6, 7, 8),
                stream=True,
            )
            for rid in on_shard(1, 3)
        )
        # Answered while the delay still runs: before its end, with a minute to spare.
        await log.wait(ids, timeout_s=started + STANDBY_DELAY_S - 60 - time.monotonic())
        for rid in ids:
            assert log.check_stream(rid).token_ids and len(log.terminals(rid)) == 1
