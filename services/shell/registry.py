"""The service registry: every Baton service by name, in start order, and how to build it.

The one list that ``python -m services`` (one service, or ``up`` for all), the launcher
(``services/launcher.py``: tests, the benchmark) and the Compose files' service names follow.
Each service module exposes ``build(config)``; it is imported only when that service is built,
so a tokenizer process never loads the model stack and the gateway's HTTP stack stays out of the
workers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from services.shell.common import Service
from shared.config import BatonConfig

if TYPE_CHECKING:
    from shared.engine.cpu_share import CpuShareManager

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    module: str  # exposes build(config) -> Service
    summary: str
    pipeline: bool = True  # every request passes through it (the gateway is an optional front)
    # Serves /metrics, /health, /ready on BATON_METRICS_PORT (the gateway serves its own routes
    # on its HTTP port instead).
    metrics_endpoint: bool = True
    # Runs a model (prefill, decode): its intra-op thread count is BATON_<NAME>_TORCH_THREADS,
    # its CPUs BATON_<NAME>_CPUS (services/shell/cpus.py), and `up` keeps large freed buffers
    # in the process (see services/__main__.py).
    runs_model: bool = False
    optional: bool = False  # `up` skips it, with a log line, when its module cannot be imported

    def build(self, config: BatonConfig, cpu_share: CpuShareManager | None = None) -> Service:
        """``cpu_share``: an engine service's thread budget (services/__main__.py)."""
        module = importlib.import_module(self.module)
        service: Service = (
            module.build(config, cpu_share) if self.runs_model else module.build(config)
        )
        return service

    def available(self) -> bool:
        if not self.optional:
            return True
        try:
            importlib.import_module(self.module)
        except ImportError as exc:
            log.warning("service not available; skipped", service=self.name, error=str(exc))
            return False
        return True


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        "tokenizer",
        "services.tokenizer.service",
        "validate and tokenize client requests (baton.requests -> baton.prefill)",
    ),
    ServiceSpec(
        "prefill",
        "services.prefill.service",
        "batch prompts, first token, KV handoff (baton.prefill -> baton.decode)",
        runs_model=True,
    ),
    ServiceSpec(
        "decode",
        "services.decode.service",
        "continuous batching, one token per step (baton.decode -> baton.detok)",
        runs_model=True,
    ),
    ServiceSpec(
        "detokenizer",
        "services.detokenizer.service",
        "text, stop strings, deadlines, the one terminal reply (baton.detok -> clients)",
    ),
    ServiceSpec(
        "gateway",
        "services.gateway.service",
        "OpenAI-compatible HTTP API in front of baton.requests",
        pipeline=False,
        metrics_endpoint=False,
        optional=True,
    ),
)

NAMES: tuple[str, ...] = tuple(s.name for s in SERVICES)
PIPELINE: tuple[str, ...] = tuple(s.name for s in SERVICES if s.pipeline)


def spec(name: str) -> ServiceSpec:
    for s in SERVICES:
        if s.name == name:
            return s
    raise KeyError(f"unknown service {name!r}; services: {', '.join(NAMES)}")


def build(name: str, config: BatonConfig) -> Service:
    """Construct one service (not started)."""
    return spec(name).build(config)


METRICS_ENDPOINTS: tuple[str, ...] = tuple(s.name for s in SERVICES if s.metrics_endpoint)


def port_offset(name: str) -> int:
    """``up`` gives each service with a metrics endpoint ``BATON_METRICS_PORT`` + its offset:
    consecutive ports in registry order (tokenizer +0, prefill +1, decode +2, detokenizer +3)."""
    if name not in METRICS_ENDPOINTS:
        raise KeyError(f"{name} serves no metrics endpoint on BATON_METRICS_PORT")
    return METRICS_ENDPOINTS.index(name)
