"""``python -m services up`` (all four as child processes) or ``python -m services <name>``."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import structlog

from shared.config import BatonConfig
from shared.logging import configure_logging

SERVICES = ("tokenizer", "prefill", "decode", "detokenizer")
log = structlog.get_logger("services")


def build(name: str, config: BatonConfig):  # type: ignore[no-untyped-def]
    """Construct one service (imports are local: a tokenizer process never loads torch)."""
    from services.common import resolve_model_dir

    model_dir = resolve_model_dir(config)
    if name == "tokenizer":
        from services.tokenizer.core import PromptEncoder
        from services.tokenizer.service import TokenizerService

        return TokenizerService(config, PromptEncoder(model_dir, config))
    if name == "detokenizer":
        from services.detokenizer.service import DetokenizerService

        return DetokenizerService(config, model_dir)
    import torch

    from shared.engine.model_runner import ModelRunner
    from shared.kv_transport import make_transport

    threads = config.prefill_torch_threads if name == "prefill" else config.decode_torch_threads
    torch.set_num_threads(threads if threads > 0 else max(1, (os.cpu_count() or 2) // 2))
    runner = ModelRunner(config, model_dir)
    transport = make_transport(config)
    if name == "prefill":
        from services.prefill.service import PrefillService

        return PrefillService(config, runner, transport)
    from services.decode.service import DecodeService

    return DecodeService(config, runner, transport)


def run_one(name: str, config: BatonConfig) -> None:
    from services.common import run_until_signalled

    configure_logging(config.log_level, config.log_format, service=name)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    service = build(name, config)
    asyncio.run(run_until_signalled(service))


def run_all(config: BatonConfig) -> int:
    """Start the four services as children; stop them all on Ctrl-C/SIGTERM or if one dies."""
    configure_logging(config.log_level, config.log_format, service="up")
    from services.common import resolve_model_dir

    resolve_model_dir(config)  # build the tiny model once, before four processes race for it
    children: dict[str, subprocess.Popen[bytes]] = {}
    for offset, name in enumerate(SERVICES):
        env = dict(os.environ)
        if name in ("prefill", "decode"):
            # glibc returns big freed buffers to the OS and faults them back in on the next
            # forward (10-40 ms per prefill batch here); keep them in the process instead.
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
            env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
        if config.metrics_port:
            env["BATON_METRICS_PORT"] = str(config.metrics_port + offset)
        cmd = [sys.executable, "-m", "services", name, *_passthrough_args()]
        children[name] = subprocess.Popen(cmd, env=env)
    log.info("services started", pids={n: p.pid for n, p in children.items()})
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    while not stopping:
        for name, proc in children.items():
            if proc.poll() is not None:
                log.error("service exited; stopping the others", service=name, code=proc.returncode)
                stopping, code = True, 1
        time.sleep(0.2)
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in children.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    log.info("services stopped")
    return code


def _passthrough_args() -> list[str]:
    return sys.argv[2:]


def main(argv: list[str] | None = None) -> int:
    # Idle OpenMP workers must sleep, not spin: four services and the broker share the cores.
    # (Read by the OpenMP runtime when torch loads, so it must be set before that.)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argparse.ArgumentParser(prog="python -m services", description=__doc__)
    parser.add_argument("service", choices=("up", *SERVICES))
    BatonConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    config = BatonConfig.from_args(args)
    if args.service == "up":
        return run_all(config)
    run_one(args.service, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
