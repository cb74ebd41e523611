"""Locust, headless for a few seconds, against the real system: the queue user
(loadtest/serving/locustfile.py, straight to ``baton.requests``) and the HTTP user
(loadtest/serving/locust_http.py, through the gateway). Each run must send requests and fail none: a
locustfile that no longer speaks the contract, or a system that drops requests under a handful of
concurrent users, fails here instead of in someone's load test.

Locust runs as its own process (it monkeypatches everything with gevent) under this interpreter,
so a virtualenv without its ``bin/`` on PATH works too.
"""

from __future__ import annotations

import asyncio
import csv
import os
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import Live

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILES = {"queue": "loadtest/serving/locustfile.py", "http": "loadtest/serving/locust_http.py"}
USERS, RUN_S = 4, 5


async def _locust(live: Live, locustfile: str, prefix: Path) -> tuple[int, str]:
    env = {
        **os.environ,
        "BATON_AMQP_URL": live.system.amqp_url,
        "BATON_LOCUST_INPUT_LEN": "16:0.5,48:0.5",
        "BATON_LOCUST_OUTPUT_LEN": "8",
        "BATON_LOCUST_TIMEOUT_S": "60",
    }
    argv = [
        sys.executable, "-m", "locust", "-f", locustfile, "--headless", "--host", live.url,
        "-u", str(USERS), "-r", str(USERS), "-t", f"{RUN_S}s", "--csv", str(prefix),
        # Users finish the request in flight at the end instead of being cut off: each one
        # started is counted, as a success or a failure.
        "--stop-timeout", "60", "--loglevel", "WARNING",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=180)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.parametrize("user", LOCUSTFILES)
async def test_locust_headless_runs_without_failures(live: Live, user: str, tmp_path: Path) -> None:
    prefix = tmp_path / user
    code, out = await _locust(live, LOCUSTFILES[user], prefix)
    stats_path = Path(f"{prefix}_stats.csv")
    assert stats_path.exists(), f"locust wrote no stats (exit {code}):\n{out[-3000:]}"
    with stats_path.open() as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    e2e = [r for (kind, name), r in rows.items() if kind == "E2E"]
    sent = sum(int(r["Request Count"]) for r in e2e)
    failed = sum(int(r["Failure Count"]) for r in rows.values() if r["Name"] != "Aggregated")
    failures = Path(f"{prefix}_failures.csv").read_text()
    assert sent > 0, f"no request completed in {RUN_S}s:\n{out[-3000:]}"
    assert failed == 0, f"{failed} failures:\n{failures}\n{out[-3000:]}"
    assert code == 0, out[-3000:]
    # Every request fired its first-token time: the stream was read, not only the final reply.
    assert sum(int(rows[k]["Request Count"]) for k in rows if k[0] == "TTFT") == sent
    assert Path(f"{prefix}_raw.json").exists(), "the exact-percentile report was written"
