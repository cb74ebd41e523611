"""The short chaos run, in CI: two processes of every service, a raw client (plain aio-pika, no
client library, no dedup) with 64 streams, and 20 SIGKILLs of random processes at random
moments, each restarted. Every request gets exactly one terminal reply, a ``done`` whose tokens
equal the undisturbed run's; no token position is repeated, missing or out of order; no KV block
or spill entry is left. Seeded (``BATON_CHAOS_SEED``): a failure names its seed and replays
with ``python -m loadtest chaos --minutes 0.75 --kills 20 --max-tokens 120 --requests 64
--seed <seed>``. The 10-minute run is the same module (loadtest/faults/chaos.py).
"""

from __future__ import annotations

import os

import pytest

from loadtest.faults.chaos import Plan, prompts, reference_tokens, replicated_system, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = int(os.environ.get("BATON_CHAOS_SEED", "29"))
NUM_STREAMS = 64
NUM_KILLS = 20
WINDOW_S = 45.0
MAX_TOKENS = 120


@pytest.mark.timeout(600)
async def test_64_streams_through_20_random_kills_at_the_raw_wire() -> None:
    work = prompts(NUM_STREAMS, MAX_TOKENS)
    with replicated_system() as system:
        await system.procs.wait_ready(300)
        reference = await reference_tokens(system, work)
        plan = Plan.draw(
            SEED,
            system.instances,
            num_requests=NUM_STREAMS,
            num_prompts=NUM_STREAMS,
            window_s=WINDOW_S,
            num_kills=NUM_KILLS,
        )
        assert {system.service[i] for _, i, _ in plan.kills} == set(system.service.values())
        counts = await run_chaos(system, plan, work, reference)
    assert counts.problems() == {}, (SEED, counts, plan.kills)
    assert counts.answered_once == NUM_STREAMS and counts.tokens == NUM_STREAMS * MAX_TOKENS
