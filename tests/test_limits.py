"""The length rules (derived once) and the one stop rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.config import BatonConfig
from shared.limits import Limits, check_stop
from shared.wire.sampling import SamplingParams

EOS = frozenset({2, 0})


def test_max_model_len_is_the_smallest_bound() -> None:
    config = BatonConfig(max_model_len=2048, max_prompt_tokens=1536, max_tokens_limit=4096)
    assert Limits.build(config, 4096) == Limits(2048, 1536, 4096)
    assert Limits.build(config, 1024).max_model_len == 1024  # the model's positions
    cache = Limits.build(config, 4096, num_cache_tokens=64)  # the engine's KV cache
    assert (cache.max_model_len, cache.max_prompt_tokens) == (64, 63)  # room for one output
    with pytest.raises(ValueError, match="no room"):
        Limits.build(config, 4096, num_cache_tokens=1)


def test_fits_leaves_room_for_one_more_token() -> None:
    limits = Limits(max_model_len=64, max_prompt_tokens=63, max_tokens=100)
    assert limits.fits(63) and not limits.fits(64)


def test_clamp_cuts_max_tokens_to_what_fits_after_the_prompt() -> None:
    limits = Limits(max_model_len=64, max_prompt_tokens=63, max_tokens=100)
    asked = SamplingParams(max_tokens=50, temperature=0.5, seed=3)
    assert limits.clamp(asked, 10) is asked  # fits: the very same object
    clamped = limits.clamp(asked, 40)
    assert clamped.max_tokens == 24 and (clamped.temperature, clamped.seed) == (0.5, 3)
    assert limits.clamp(asked, 63).max_tokens == 1
    assert limits.clamp(asked, 80).max_tokens == 1  # never below one


def test_check_stop_eos_first_then_length() -> None:
    params = SamplingParams(max_tokens=3)
    assert check_stop(7, 1, params, EOS) is None
    assert check_stop(2, 1, params, EOS) == "stop"
    assert check_stop(0, 3, params, EOS) == "stop"  # EOS wins over length on the last token
    assert check_stop(7, 3, params, EOS) == "length"
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True)
    assert check_stop(2, 1, ignoring, EOS) is None
    assert check_stop(2, 3, ignoring, EOS) == "length"


def test_for_model_dir_reads_only_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert Limits.for_model_dir(BatonConfig(), tmp_path).max_model_len == 512
