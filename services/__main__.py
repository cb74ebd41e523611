"""Run Baton's services: ``python -m services up`` (all, as child processes) or one by name.

The services and their order come from the registry (``services/shell/registry.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import structlog

from kernels.cpu import cpu_isa, mkl_dispatch
from services.shell.cpus import split_engine_cpus
from services.shell.registry import NAMES, SERVICES, port_offset, spec
from shared.config import BatonConfig
from shared.observability.logging import configure_logging

log = structlog.get_logger("services")


def run_one(name: str, config: BatonConfig) -> None:
    from services.shell.common import run_until_signalled
    from shared.engine.cpu_share import CpuShareManager, table_path

    configure_logging(config.log_level, config.log_format, service=name)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if spec(name).runs_model:
        import torch

        from services.shell.cpus import pin_engine, yield_cpu

        cpus, threads = getattr(config, f"{name}_cpus"), getattr(config, f"{name}_torch_threads")
        torch.set_num_threads(pin_engine(cpus, threads))
        yield_cpu(getattr(config, f"{name}_nice"))
    cpu_share = None
    if spec(name).runs_model and _shares_cpus(config, name):
        cpus = frozenset(os.sched_getaffinity(0))
        prefill = name == "prefill"
        cpu_share = CpuShareManager(
            table_path(config.amqp_url, cpus),
            len(cpus),
            prefill=prefill,
            choose_threads=not prefill and config.decode_thread_choice,
        )
    service = spec(name).build(config, cpu_share)
    asyncio.run(run_until_signalled(service))


def run_all(config: BatonConfig, flags: list[str] | None = None) -> int:
    """Start every service as a child, with ``flags`` (default: this command line's own). Stop
    them all on Ctrl-C/SIGTERM or when one fails; one that exits 0 (drained) is let go, and
    ``up`` ends when none is left."""
    configure_logging(config.log_level, config.log_format, service="up")
    from services.shell.common import resolve_model_dir

    # Fetch or build the model once, before the services race for it.
    resolve_model_dir(config)
    children: dict[str, subprocess.Popen[bytes]] = {}
    engine_cpus = _engine_cpus(config)
    for s in SERVICES:
        if not s.available():
            continue
        env = dict(os.environ)
        if s.runs_model:
            # glibc returns big freed buffers to the OS and faults them back in on the next
            # forward, every forward; keep them in the process instead.
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
            env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
            # ...and allocate them where those thresholds apply: steps run on a thread of their
            # own, whose allocations glibc serves from a per-thread arena; an arena's heap tops
            # out at 64 MB, so larger tensors (a long prefill wave's MLP activations) would be
            # mmapped, zero-filled and unmapped on every forward. One arena: the event loop and
            # the step thread share its lock, held only briefly (docs/perf-log.md, "malloc").
            env.setdefault("MALLOC_ARENA_MAX", "1")
            if s.name in engine_cpus:  # an explicit list, even an empty one, is kept
                env.setdefault(f"BATON_{s.name.upper()}_CPUS", engine_cpus[s.name])
        # Each service as its own broker user when given one (deploy/permissions.py
        # apply prints these); otherwise every child shares BATON_AMQP_URL.
        own_url = os.environ.get(f"BATON_{s.name.upper()}_AMQP_URL")
        if own_url:
            env["BATON_AMQP_URL"] = own_url
        if config.metrics_port and s.metrics_endpoint:
            env["BATON_METRICS_PORT"] = str(config.metrics_port + port_offset(s.name))
        args = _passthrough_args() if flags is None else flags
        cmd = [sys.executable, "-m", "services", s.name, *args]
        children[s.name] = subprocess.Popen(cmd, env=env)
    log.info("services started", pids={n: p.pid for n, p in children.items()})
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    running = dict(children)
    while running and not stopping:
        for name, proc in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            if proc.returncode == 0:
                log.info("service finished", service=name)
            else:
                log.error("service exited; stopping the others", service=name, code=proc.returncode)
                stopping, code = True, 1
        time.sleep(0.2)
    for proc in running.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in running.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    log.info("services stopped")
    return code


def _shares_cpus(config: BatonConfig, name: str) -> bool:
    """Whether engine ``name`` takes its thread count from the shared budget: on a CPU device,
    unless its count is fixed (shared/engine/cpu_share.py)."""
    fixed = getattr(config, f"{name}_torch_threads", 0) > 0
    return _cpu_share_pays(config) and not fixed


def _cpu_share_pays(config: BatonConfig) -> bool:
    """Sharing is on (``BATON_CPU_SHARE``) on a CPU, for any model (shared/engine/cpu_share.py
    says why even a small one); otherwise the engines keep the split."""
    return config.cpu_share and config.device == "cpu"


def _engine_cpus(config: BatonConfig) -> dict[str, str]:
    """The engines' CPU lists when neither is configured (by a flag or the environment, even as
    an empty list) and they do not share the cores: the two halves of this process's CPUs
    (services/shell/cpus.py says why)."""
    given = {"BATON_PREFILL_CPUS", "BATON_DECODE_CPUS"} & os.environ.keys()
    if config.prefill_cpus or config.decode_cpus or given:
        return {}
    if _cpu_share_pays(config):
        log.info("engines share every CPU by who has work (BATON_CPU_SHARE)")
        return {}
    split = split_engine_cpus(frozenset(os.sched_getaffinity(0)))
    if split is None:
        return {}
    log.info("engines pinned to halves of the CPUs", prefill=split[0], decode=split[1])
    return {"prefill": split[0], "decode": split[1]}


def _passthrough_args() -> list[str]:
    return sys.argv[2:]


def main(argv: list[str] | None = None) -> int:
    services = "\n".join(f"  {s.name:<12} {s.summary}" for s in SERVICES)
    parser = argparse.ArgumentParser(
        prog="python -m services",
        description=__doc__,
        epilog=f"services, in start order:\n{services}\n  {'up':<12} all of them",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("service", choices=("up", *NAMES), help="a service, or up for all")
    BatonConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    return launch(args.service, BatonConfig.from_args(args))


def launch(service: str, config: BatonConfig, flags: list[str] | None = None) -> int:
    """Run ``service``, or ``up``: every service as a child started with ``flags`` (default:
    this process's own command line after the service name). The exit status."""
    # Idle OpenMP workers spin briefly, then sleep (read by the OpenMP runtime when torch
    # loads, so set before that). Spinning across the gap between two parallel regions of one
    # step keeps the team awake through the step; sleeping soon after it leaves the cores to the
    # broker and the other services. Fully passive workers would wake for every GEMM of a step
    # (docs/perf-log.md, "OpenMP"). KMP_BLOCKTIME is the same setting for Intel's runtime, in
    # ms.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
        os.environ.setdefault("KMP_BLOCKTIME", "1")
    # Before torch loads (may re-execute this process; `up`'s children inherit the result).
    cpu_isa.apply(config.cpu_isa)
    mkl_dispatch.ensure(config.mkl_dispatch)
    from shared.models.catalog import ModelUnavailable

    try:
        if service == "up":
            return run_all(config, flags)
        run_one(service, config)
    except ModelUnavailable as exc:  # one line that says what to do, not a traceback
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
