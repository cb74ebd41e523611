"""Building an engine from the configuration: connector first, since it may own the KV cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kernels.cpu import omp_team
from shared.config import BatonConfig
from shared.engine.decode import DecodeEngine
from shared.engine.prefill import PrefillEngine
from shared.kv_transfer import ShmConnector, make_connector
from shared.kv_transfer.connector import KVConnector
from shared.runtime.model_runner import ModelRunner

PREEMPTION_MODES = ("swap", "recompute")


def build_prefill_engine(
    config: BatonConfig,
    model_dir: Path | None = None,
    between_layers: Callable[[int], None] | None = None,
) -> PrefillEngine:
    """``between_layers``: ModelRunner's hook between the layers of a forward."""
    connector, runner = _connector_and_runner(config, "prefill", model_dir, None, between_layers)
    # A pooled transport maps the device pool only: prompts holding host blocks go by copy.
    copies = runner.host_tier is None or isinstance(connector, ShmConnector)
    return PrefillEngine(config, runner, connector, None if copies else spill_store(config))


def build_decode_engine(
    config: BatonConfig,
    model_dir: Path | None = None,
    kv_host_cache_bytes: int | None = None,
    between_layers: Callable[[int], None] | None = None,
) -> DecodeEngine:
    """``kv_host_cache_bytes``: the host tier's size, exact (default ``kv_host_cache_mb``);
    ``between_layers``: ModelRunner's hook between the layers of a forward."""
    swap = make_swap_connector(config)  # before the model loads: a bad setting fails at once
    connector, runner = _connector_and_runner(
        config, "decode", model_dir, kv_host_cache_bytes, between_layers
    )
    return DecodeEngine(config, runner, connector, swap)


def _connector_and_runner(
    config: BatonConfig,
    role: str,
    model_dir: Path | None,
    kv_host_cache_bytes: int | None,
    between_layers: Callable[[int], None] | None,
) -> tuple[KVConnector, ModelRunner]:
    connector = make_connector(config, role=role)
    if kv_host_cache_bytes is None:
        kv_host_cache_bytes = config.kv_host_cache_mb << 20
    # The model loads on a thread that ends: the OpenMP team its parallel work opens must not
    # outlive it beside the step thread's (kernels/cpu/omp_team.py).
    runner = omp_team.in_passing_thread(
        lambda: ModelRunner(
            config,
            model_dir,
            allocate_kv_cache=connector.allocate_kv_cache,
            kv_host_cache_bytes=kv_host_cache_bytes,
            role=role,
            between_layers=between_layers,
        )
    )
    return connector, runner


def make_swap_connector(config: BatonConfig) -> KVConnector | None:
    """Where decode swaps preempted sequences out: the spill store every decode worker on the
    node reads (None: ``BATON_DECODE_PREEMPTION=recompute``)."""
    if config.decode_preemption not in PREEMPTION_MODES:
        raise ValueError(
            f"BATON_DECODE_PREEMPTION={config.decode_preemption!r}: one of {PREEMPTION_MODES}"
        )
    if config.decode_preemption == "recompute":
        return None
    return spill_store(config)


def spill_store(config: BatonConfig) -> ShmConnector:
    return ShmConnector(config.spill_dir, config.spill_max_bytes, config.spill_orphan_timeout_s)
