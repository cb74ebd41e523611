"""The services as separate processes in a fresh vhost, so a fault test can kill one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.launcher import ServiceProcesses, fresh_vhost

ALL_SERVICES = ("tokenizer", "prefill", "decode", "detokenizer")
FAULT_ENV = {"BATON_KV_CACHE_MB": "32", "BATON_METRICS_PORT": "0"}


@contextmanager
def service_processes(
    env: dict[str, str] | None = None, start: tuple[str, ...] = ALL_SERVICES
) -> Iterator[ServiceProcesses]:
    with fresh_vhost(prefix="baton-fault") as url:
        procs = ServiceProcesses(url, env={**FAULT_ENV, **(env or {})})
        for name in start:
            procs.start(name)
        try:
            yield procs
        finally:
            procs.stop()
