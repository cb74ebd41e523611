"""Bad-input fuzz of a running Baton: every case gets the contract's answer, nothing crashes.

    python -m loadtest.fuzz --cases 1000 --seed 0            # spawns Baton in a fresh vhost
    python -m loadtest.fuzz --cases 1000 --url amqp://...    # against a running Baton
    python -m loadtest.fuzz --cases 0                        # internal-queue cases only

Client cases (``fuzz_cases``, drawn by Hypothesis from ``--seed``): request maps with valid,
invalid and junk field values, raw and truncated bodies, msgpack bombs, bodies over the size
limit, and AMQP oddities (no correlation id, another one, header priorities up to 255, no
reply_to, reply_to an internal queue). Each must get exactly one terminal reply, well formed
(``fuzz_checks``), with the error code the parser predicts for a body it refuses; one without
reply_to must be dead-lettered instead. After each batch a known-good request must be served.
Internal cases (``fuzz_internal``): malformed messages on the queues between the services, each
dead-lettered with a log line. Prints the count and an outcome table; exits 1 on any violation.

The parser's verdict uses this process's ``BATON_*`` settings: against a running Baton, run with
the settings its services use. Log lines are checked only when this process spawned the services.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from loadtest.fuzz_cases import canary_case, client_cases
from loadtest.fuzz_client import ClientFuzzer, Report
from loadtest.fuzz_internal import internal_cases, run_internal
from services.launcher import LocalSystem, fresh_vhost
from shared.client import default_amqp_url
from shared.config import BatonConfig

__all__ = ["Report", "format_table", "main", "run_fuzz"]


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


def print_report(report: Report, wall_s: float, max_violations: int = 50) -> None:
    print(f"\nfuzz: {report.cases} client cases in {wall_s:.1f}s")
    print(format_table(report))
    if report.violations:
        print(f"\n{len(report.violations)} VIOLATIONS:")
        for v in report.violations[:max_violations]:
            print(f"  - {v}")
        if len(report.violations) > max_violations:
            print(f"  ... and {len(report.violations) - max_violations} more (--json has them all)")
    else:
        print("no violations")


async def _spawned(args: argparse.Namespace, config: BatonConfig) -> tuple[Report, float]:
    log_path = Path(tempfile.mkstemp(prefix="baton-fuzz-", suffix=".log")[1])
    with fresh_vhost(default_amqp_url(), prefix="baton-fuzz") as url:
        system = LocalSystem(url, log_path=log_path)
        system.start()
        print(f"fuzz: spawned Baton on {url.split('@')[-1]}, log: {log_path}", flush=True)
        try:
            await system.wait_ready()
            t0 = time.monotonic()
            report = await _run(args, url, config, lambda: log_path.read_text(errors="replace"))
            return report, time.monotonic() - t0
        finally:
            system.stop(timeout_s=30)


async def _run(
    args: argparse.Namespace,
    url: str,
    config: BatonConfig,
    read_log: Callable[[], str] | None,
) -> Report:
    only = {int(i) for i in args.only.split(",")} if args.only else None
    return await run_fuzz(
        url,
        cases=args.cases,
        seed=args.seed,
        config=config,
        batch_size=args.batch,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        internal=not args.no_internal,
        leaf_types=args.internal_leaf_types,
        only=only,
        read_log=read_log,
        progress=lambda line: print(line, flush=True),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", type=int, default=1000, help="client cases (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the same seed and --cases: same cases")
    p.add_argument("--url", default=None, help="a running Baton's AMQP URL (default: spawn one)")
    p.add_argument("--batch", type=int, default=100, help="cases between known-good requests")
    p.add_argument("--concurrency", type=int, default=32, help="cases in flight")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a case may wait")
    p.add_argument("--no-internal", action="store_true", help="skip the internal-queue cases")
    p.add_argument(
        "--internal-leaf-types",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="internal messages of the right shape with wrong leaf types (default: on)",
    )
    p.add_argument("--only", default="", help="of those cases, only these (e.g. 17,42)")
    p.add_argument("--json", default=None, help="write the outcome table and violations here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = BatonConfig.from_env()
    if args.url is None:
        report, wall_s = asyncio.run(_spawned(args, config))
    else:
        t0 = time.monotonic()
        report = asyncio.run(_run(args, args.url, config, None))
        wall_s = time.monotonic() - t0
    print_report(report, wall_s)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "seed": args.seed,
            "cases": report.cases,
            "wall_s": round(wall_s, 1),
            "outcomes": dict(sorted(report.outcomes.items())),
            "violations": report.violations,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
