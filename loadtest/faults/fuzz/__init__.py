"""Bad-input fuzz of a running Baton: every case gets the contract's answer, nothing crashes.

    python -m loadtest fuzz --cases 1000 --seed 0            # spawns Baton in a fresh vhost
    python -m loadtest fuzz --cases 1000 --url amqp://...    # against a running Baton
    python -m loadtest fuzz --cases 0                        # internal-queue cases only

Client cases (``cases``, drawn by Hypothesis from ``--seed``): request maps with valid,
invalid and junk field values, raw and truncated bodies, msgpack bombs, bodies over the size
limit, and AMQP oddities (no correlation id, another one, header priorities up to 255, no
reply_to, reply_to an internal queue). Each must get exactly one terminal reply, well formed
(``checks``), with the error code the parser predicts for a body it refuses; one without
reply_to must be dead-lettered instead. After each batch a known-good request must be served.
Internal cases (``internal``): malformed messages on the queues between the services, each
dead-lettered with a log line. Prints the count and an outcome table; exits 1 on any violation.

The parser's verdict uses this process's ``BATON_*`` settings: against a running Baton, run with
the settings its services use. Log lines are checked only when this process spawned the services.

Layout: ``strategies`` (Hypothesis drafts, also the parser's property tests:
tests/test_fuzz_parse.py) -> ``cases`` (bodies and the parser's verdict) -> ``client`` (publish,
collect, judge with ``checks``) and ``internal``; ``__main__`` is the command line.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from loadtest.faults.fuzz.cases import canary_case, client_cases
from loadtest.faults.fuzz.client import ClientFuzzer, Report
from loadtest.faults.fuzz.internal import internal_cases, run_internal
from shared.config import BatonConfig

__all__ = ["Report", "format_table", "run_fuzz"]


async def run_fuzz(
    url: str,
    *,
    cases: int,
    seed: int,
    config: BatonConfig | None = None,
    batch_size: int = 100,
    concurrency: int = 32,
    timeout_s: float = 60.0,
    internal: bool = True,
    leaf_types: bool = True,
    only: set[int] | None = None,
    read_log: Callable[[], str] | None = None,
    progress: Callable[[str], None] = print,
) -> Report:
    """The whole fuzz against the Baton at ``url``; the report holds every violation."""
    config = config or BatonConfig.from_env()
    t0 = time.monotonic()
    run = uuid.uuid4().hex[:6]
    todo = client_cases(cases, seed, config, run)  # Hypothesis' draws depend on the count too
    if only:
        todo = [c for c in todo if c.index in only]
    progress(
        f"fuzz: {len(todo)} client cases generated from seed {seed} in {time.monotonic() - t0:.1f}s"
    )
    async with ClientFuzzer(
        url, concurrency=concurrency, timeout_s=timeout_s, read_log=read_log
    ) as fuzzer:
        report = fuzzer.report
        for n, start in enumerate(range(0, len(todo), batch_size)):
            canary = canary_case(n, seed, config, run)
            served = await fuzzer.run_batch(todo[start : start + batch_size], canary)
            progress(
                f"fuzz: {report.cases}/{len(todo)} cases, {len(report.violations)} violations, "
                f"{time.monotonic() - t0:.0f}s"
            )
            if not served:  # every later case would only wait out its timeout
                progress("fuzz: a known-good request was not served; stopping here")
                return report
        if internal or leaf_types:
            inner = internal_cases(seed, config, run, leaf_types=leaf_types)
            await run_internal(fuzzer, inner, read_log)
            await fuzzer.check_canary(canary_case(len(todo) // batch_size + 1, seed, config, run))
            progress(
                f"fuzz: {len(inner)} internal-queue cases, {len(report.violations)} "
                f"violations in all, {time.monotonic() - t0:.0f}s"
            )
        return report


def format_table(report: Report) -> str:
    rows = sorted(report.outcomes.items())
    width = max([len(k) for k, _ in rows] + [7])
    lines = [f"{'outcome':<{width}}  count", f"{'-' * width}  -----"]
    lines += [f"{k:<{width}}  {v:>5}" for k, v in rows]
    lines.append(f"{'total':<{width}}  {sum(report.outcomes.values()):>5}")
    return "\n".join(lines)
