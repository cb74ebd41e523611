"""``python -m loadtest fuzz``: the fuzz (``loadtest/faults/fuzz/__init__.py``) against a Baton it
spawns in a fresh vhost, or a running one (``--url``); prints the outcome table."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import loadtest.faults.fuzz
from loadtest.faults.fuzz import Report, format_table, run_fuzz
from services.launcher import LocalSystem, fresh_vhost
from shared.client import default_amqp_url
from shared.config import BatonConfig


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


async def _run(args: argparse.Namespace, config: BatonConfig) -> tuple[Report, float]:
    """Against ``--url``, or a Baton spawned in a fresh vhost (its log lines checked too)."""
    with contextlib.ExitStack() as stack:
        url, read_log = args.url, None
        if url is None:
            log_path = Path(tempfile.mkstemp(prefix="baton-fuzz-", suffix=".log")[1])
            url = stack.enter_context(fresh_vhost(default_amqp_url(), prefix="baton-fuzz"))
            system = LocalSystem(url, log_path=log_path)
            system.start()
            stack.callback(system.stop, timeout_s=30)
            print(f"fuzz: spawned Baton on {url.split('@')[-1]}, log: {log_path}", flush=True)
            await system.wait_ready()
            read_log = lambda: log_path.read_text(errors="replace")  # noqa: E731
        t0 = time.monotonic()
        report = await run_fuzz(
            url, cases=args.cases, seed=args.seed, config=config, batch_size=args.batch,
            concurrency=args.concurrency, timeout_s=args.timeout, internal=not args.no_internal,
            leaf_types=args.internal_leaf_types,
            only={int(i) for i in args.only.split(",")} if args.only else None,
            read_log=read_log, progress=lambda line: print(line, flush=True),
        )  # fmt: skip
        return report, time.monotonic() - t0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest fuzz",
        description=loadtest.faults.fuzz.__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
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
    report, wall_s = asyncio.run(_run(args, config))
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
