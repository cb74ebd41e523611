"""The gateway's sampling defaults come from the model's generation_config.json (as vLLM's
``--generation-config auto``); a request's own values win, and ``vllm`` turns it off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gateway.api_requests import parse_chat, parse_completion
from services.gateway.sampling_defaults import SamplingDefaults
from shared.config import BatonConfig
from shared.limits import Limits

CONFIG = BatonConfig()
LIMITS = Limits.build(CONFIG, max_position_embeddings=4096)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _model_dir(tmp_path: Path, generation: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_omitted_fields_take_the_models_values(tmp_path: Path) -> None:
    model_dir = _model_dir(
        tmp_path, {"eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.8,
                   "top_k": 20},
    )  # fmt: skip
    defaults = SamplingDefaults.load("auto", model_dir)
    chat = parse_chat(CHAT, CONFIG, LIMITS, defaults).baton
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.7, 0.8, 20)
    body = {"prompt": "hi", "top_p": 1.0, "temperature": 0}
    completion = parse_completion(body, CONFIG, defaults)
    assert (completion.baton["temperature"], completion.baton["top_p"]) == (0.0, 1.0)
    assert completion.baton["top_k"] == 20  # still omitted: the model's


def test_vllm_setting_and_a_missing_file_keep_openais_defaults(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, {"temperature": 0.6, "top_k": -1})
    assert SamplingDefaults.load("auto", model_dir) == SamplingDefaults(temperature=0.6, top_k=0)
    for defaults in (SamplingDefaults.load("vllm", model_dir),
                     SamplingDefaults.load("auto", tmp_path / "elsewhere")):  # fmt: skip
        baton = parse_chat(CHAT, CONFIG, LIMITS, defaults).baton
        assert baton["temperature"] == 1.0 and "top_p" not in baton and "top_k" not in baton


def test_a_named_directory_must_hold_the_file(tmp_path: Path) -> None:
    other = _model_dir(tmp_path, {"temperature": 0.3})
    assert SamplingDefaults.load(str(other), tmp_path / "model").temperature == 0.3
    with pytest.raises(FileNotFoundError, match="BATON_GENERATION_CONFIG"):
        SamplingDefaults.load(str(tmp_path / "missing"), tmp_path)
