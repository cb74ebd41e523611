"""The sampling defaults of the gateway's requests: the model's ``generation_config.json``, as
vLLM's ``--generation-config auto`` takes them.

A request that omits ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty``
gets the value the model's authors chose (vLLM's list); one that sets a field keeps its own.
``BATON_GENERATION_CONFIG=vllm`` turns this off (OpenAI's defaults: temperature 1, no cut, no
penalty), as vLLM's flag of the same value; a directory path reads that directory's file
instead. Only the gateway applies them: the wire
contract's defaults (greedy) keep their meaning for clients of the queue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

OPENAI_TEMPERATURE = 1.0
# Fields of generation_config.json that change sampling but that vLLM (and so this server) does
# not take as defaults.
_NOT_APPLIED = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = OPENAI_TEMPERATURE
    top_p: float | None = None  # None: the request's own, else the contract's default (off)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def load(cls, setting: str, model_dir: Path) -> SamplingDefaults:
        """``setting``: ``auto`` (the model directory's file), ``vllm`` (none) or a directory."""
        if setting == "vllm":
            return cls()
        folder = model_dir if setting == "auto" else Path(setting)
        path = folder / "generation_config.json"
        if not path.is_file():
            if setting != "auto":
                raise FileNotFoundError(
                    f"BATON_GENERATION_CONFIG: no generation_config.json in {folder}"
                )
            return cls()
        return cls.from_dict(json.loads(path.read_text()), str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "generation_config") -> SamplingDefaults:
        skipped = {k: raw[k] for k in _NOT_APPLIED if raw.get(k) not in (None, 0, 0.0, 1, 1.0)}
        if skipped:
            log.warning("generation config fields not applied", source=source, **skipped)
        temperature = raw.get("temperature")
        top_p = raw.get("top_p")
        top_k = raw.get("top_k")
        min_p = raw.get("min_p")
        repetition_penalty = raw.get("repetition_penalty")
        defaults = cls(
            temperature=OPENAI_TEMPERATURE if temperature is None else float(temperature),
            top_p=None if top_p is None else float(top_p),
            top_k=None if top_k is None else max(0, int(top_k)),  # -1, vLLM's "off", is 0
            min_p=None if min_p is None else float(min_p),
            repetition_penalty=None if repetition_penalty is None else float(repetition_penalty),
        )
        if defaults != cls():
            log.info("sampling defaults from the model", source=source, **defaults.fields())
        return defaults

    def fields(self) -> dict[str, float | int]:
        """The fields a request that omits them takes."""
        out: dict[str, float | int] = {"temperature": self.temperature}
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.min_p is not None:
            out["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            out["repetition_penalty"] = self.repetition_penalty
        return out


OPENAI_DEFAULTS = SamplingDefaults()
