"""The length rules (derived once) and the one stop rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.config import BatonConfig
from shared.limits import Limits, StopRule
from shared.wire.sampling import SamplingParams

EOS = frozenset({2, 0})


def test_max_model_len_is_the_smallest_bound() -> None:
    config = BatonConfig(max_model_len=2048, max_prompt_tokens=1536, max_tokens_limit=4096)
    assert Limits.build(config, 4096) == Limits(2048, 1536)
    assert Limits.build(config, 1024).max_model_len == 1024  # the model's positions
    cache = Limits.build(config, 4096, num_cache_tokens=64)  # the engine's KV cache
    assert (cache.max_model_len, cache.max_prompt_tokens) == (64, 63)  # room for one output
    with pytest.raises(ValueError, match="no room"):
        Limits.build(config, 4096, num_cache_tokens=1)


def test_fits_leaves_room_for_one_more_token() -> None:
    limits = Limits(max_model_len=64, max_prompt_tokens=63)
    assert limits.fits(63) and not limits.fits(64)


def test_clamp_cuts_max_tokens_to_what_fits_after_the_prompt() -> None:
    limits = Limits(max_model_len=64, max_prompt_tokens=63)
    asked = SamplingParams(max_tokens=50, temperature=0.5, seed=3)
    assert limits.clamp(asked, 10) is asked  # fits: the very same object
    clamped = limits.clamp(asked, 40)
    assert clamped.max_tokens == 24 and (clamped.temperature, clamped.seed) == (0.5, 3)
    assert limits.clamp(asked, 63).max_tokens == 1
    assert limits.clamp(asked, 80).max_tokens == 1  # never below one


def test_stop_rule_eos_first_then_length() -> None:
    stop = StopRule(EOS, max_model_len=64)
    params = SamplingParams(max_tokens=3)
    assert stop(7, 11, 1, params) is None
    assert stop(2, 11, 1, params) == "stop"
    assert stop(0, 13, 3, params) == "stop"  # EOS wins over length on the last token
    assert stop(7, 13, 3, params) == "length"
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True)
    assert stop(2, 11, 1, ignoring) is None
    assert stop(2, 13, 3, ignoring) == "length"


def test_stop_token_ids_end_as_eos_does_but_not_before_min_tokens() -> None:
    stop = StopRule(EOS, max_model_len=64)
    params = SamplingParams(max_tokens=8, stop_token_ids=(9, 11), ignore_eos=True)
    assert stop(9, 11, 1, params) == stop(11, 11, 1, params) == "stop"
    assert stop(2, 11, 1, params) is None  # ignore_eos leaves the stop ids in force
    late = SamplingParams(max_tokens=8, stop_token_ids=(9,), min_tokens=3)
    assert stop(9, 11, 2, late) is None and stop(2, 11, 2, late) is None
    assert stop(9, 12, 3, late) == stop(2, 12, 3, late) == "stop"


def test_stop_rule_ends_at_max_model_len_whatever_max_tokens_asks() -> None:
    """Engines trust the tokenizer's clamp, yet never grow a sequence past their own length."""
    stop = StopRule(EOS, max_model_len=64)
    asked = SamplingParams(max_tokens=100)
    assert stop(7, 63, 23, asked) is None
    assert stop(7, 64, 24, asked) == "length"
    assert stop(0, 64, 24, asked) == "stop"


def test_for_model_dir_reads_only_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert Limits.for_model_dir(BatonConfig(), tmp_path).max_model_len == 512
