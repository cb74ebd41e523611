"""The one configuration object: frozen, read from ``BATON_*`` env vars and CLI flags.

Values discovered at run time (number of KV blocks that fit, the model's vocab size, ...) live in
run-time objects such as :class:`shared.engine.model_runner.ModelRunner`, never in here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
REPO_ROOT = Path(__file__).resolve().parent.parent
# The built-in tiny model is built on first use into this folder (deterministic, see
# shared/tiny_model.py); BATON_MODEL points anywhere else at a local Hugging Face directory.
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tiny"


@dataclass(frozen=True)
class BatonConfig:
    # --- broker -------------------------------------------------------------------------------
    amqp_url: str = DEFAULT_AMQP_URL
    # Largest message body any service will unpack; everything bigger is refused unread.
    max_message_bytes: int = 1 << 20
    # --- model --------------------------------------------------------------------------------
    model: str = ""  # "" = the built-in tiny model (built on first use)
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    # torch intra-op threads of each engine service; 0 = auto: half the cores each (prefill and
    # decode usually share one machine with the broker). Measured on 2 cores: one thread each gives
    # ~20% more end-to-end throughput than two each, which mostly spin against each other.
    prefill_torch_threads: int = 0
    decode_torch_threads: int = 0
    # --- limits -------------------------------------------------------------------------------
    max_model_len: int = 2048
    max_prompt_tokens: int = 1536
    max_tokens_limit: int = 4096
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    # The tokenizer answers ``overloaded`` while baton.prefill holds this many requests.
    max_prefill_backlog: int = 10_000
    # --- paged KV cache -----------------------------------------------------------------------
    block_size: int = 16
    # 0 = derive from kv_cache_mb; otherwise an exact count.
    num_kv_blocks: int = 0
    kv_cache_mb: int = 256
    enable_prefix_caching: bool = True
    # --- prefill scheduling -------------------------------------------------------------------
    # Token budget of one prefill forward (short prompts batched, long ones chunked to fit).
    max_num_batched_tokens: int = 2048
    prefill_max_num_seqs: int = 64
    # How long prefill waits to fill a batch once it has one request (seconds).
    prefill_batch_wait_s: float = 0.004
    # --- decode scheduling --------------------------------------------------------------------
    max_num_seqs: int = 128
    # Decode stops taking handoffs when its waiting queue holds this many.
    decode_max_waiting: int = 256
    # --- streaming -----------------------------------------------------------------------------
    # A streaming request gets at most one ``token`` reply per interval (its first token and its
    # terminal reply are never delayed). 0 = a reply per decode step. Why not 0 by default: every
    # reply is a broker message, and on a small machine the broker's message rate, not the
    # model, caps throughput (64 streams at 40 steps/s is 2,560 replies/s); 50 ms is below what
    # a reader notices and cuts that several-fold. TPOT and TTFT are unaffected.
    stream_interval_s: float = 0.05
    # --- KV transport -------------------------------------------------------------------------
    kv_transport: str = "shm"  # "shm" | "cuda-ipc"
    spill_dir: str = "/dev/shm/baton"
    spill_max_bytes: int = 4 << 30
    # An entry nobody loaded within this time belonged to a request that died: reclaimed.
    spill_orphan_timeout_s: float = 300.0
    # --- observability ------------------------------------------------------------------------
    log_format: str = "auto"  # "auto" (json unless a tty) | "json" | "console"
    log_level: str = "info"
    # 0 = no metrics server. Each service adds its own offset (see services/__main__.py).
    metrics_port: int = 0

    @property
    def model_dir(self) -> Path:
        return Path(self.model) if self.model else DEFAULT_MODEL_DIR

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> BatonConfig:
        """Build from ``BATON_<FIELD>`` variables; explicit ``overrides`` win."""
        env = dict(os.environ if env is None else env)
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("BATON_" + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(hints[f.name], raw, f.name)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Expose every field as ``--field-name`` (env remains the default source)."""
        for f in fields(cls):
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatonConfig:
        hints = get_type_hints(cls)
        overrides = {
            f.name: _parse(hints[f.name], getattr(args, f.name), f.name)
            for f in fields(cls)
            if getattr(args, f.name, None) is not None
        }
        return cls.from_env(**overrides)

    def replace(self, **changes: Any) -> BatonConfig:
        return dataclasses.replace(self, **changes)


def _parse(kind: Any, raw: str, name: str) -> Any:
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"BATON_{name.upper()}: expected a boolean, got {raw!r}")
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError as exc:
            raise ValueError(f"BATON_{name.upper()}: {exc}") from None
    raise TypeError(f"unsupported config type {kind!r} for {name}")
