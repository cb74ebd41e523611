"""The bad-input fuzz (``loadtest/faults/fuzz``) in CI: a fixed seed, 150 client cases and every
internal-queue case against the services as separate processes, with zero violations — each
case answered once, with a contract error or a well-formed completion, or dead-lettered with a
log line, and a known-good request served after every batch. ``-s`` shows the outcome table.
The full run is ``python -m loadtest fuzz --cases 1000``
(docs/reliability.md, "What the fault tests check")."""

from __future__ import annotations

import pytest

from loadtest.faults.fuzz import format_table, run_fuzz
from tests.fault.harness import service_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 7
CASES = 150


async def test_fuzz_finds_no_violation() -> None:
    with service_processes() as procs:
        await procs.wait_ready()
        report = await run_fuzz(
            procs.amqp_url,
            cases=CASES,
            seed=SEED,
            config=procs.config(),  # the parser's verdicts under the services' own limits
            batch_size=50,
            timeout_s=20.0,
            read_log=lambda: procs.tail(1 << 30),
        )
    print(f"\nfuzz: {report.cases} client cases, seed {SEED}\n{format_table(report)}")
    assert not report.violations, "\n".join(report.violations[:20])
    assert report.cases == CASES
    assert any(k.startswith("internal ") for k in report.outcomes)
