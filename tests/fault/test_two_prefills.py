"""Two prefill workers on one ``baton.prefill``: under load both take prompts, and when one is
SIGKILLed mid-load the other serves what it held (redelivered) — every request gets one
``done`` whose tokens equal an undisturbed run's, each stream position once, and no KV block or
spill entry is left (the survivors sweep the dead one's orphans and count them in
``baton:kv_orphans_reclaimed_total``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher import ServiceProcesses
from tests.fault.harness import (
    ReplyLog,
    batch,
    check,
    check_nothing_leaked,
    scrape,
    service_processes,
    start_replica,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = "baton:generation_tokens_total"  # prefill: one first token per prompt it finished


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[ServiceProcesses, int]]:
    env = {"BATON_SPILL_ORPHAN_TIMEOUT_S": "10", "BATON_PREFILL_MAX_NUM_SEQS": "4"}
    with service_processes(env, metrics=True) as procs:
        yield procs, start_replica(procs, "prefill", "prefill-2")


async def test_two_prefills_share_the_load_and_survive_a_kill(
    system: tuple[ServiceProcesses, int],
) -> None:
    procs, second_port = system
    await procs.wait_ready()
    first_port = procs.metrics_port("prefill")
    async with ReplyLog(procs.amqp_url) as log:
        reference = await log.reference_tokens(batch("reference"), 300)
        served = [scrape(port).get(PROMPTS, 0) for port in (first_port, second_port)]
        assert all(n > 0 for n in served), f"both prefills took prompts: {served}"

        ids = await log.send(batch("killed"))
        await log.wait_streaming(ids, min_tokens=1, timeout_s=120)
        procs.kill("prefill-2")  # while prompts are still queued and in its batches
        await log.wait(ids, 300)
        check(log, ids, reference)
        assert log.num_repeated(ids) == 0
    await check_nothing_leaked(procs)  # prefill-2 is dead: its blocks died with it
