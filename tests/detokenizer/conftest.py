"""Fixtures of the detokenizer tests: the real tiny tokenizer, a harness around the core."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer

from services.shell.common import resolve_model_dir
from shared.config import BatonConfig
from tests.detokenizer.helpers import MULTIBYTE, Decode, Harness


@pytest.fixture(scope="module")
def decode() -> Decode:
    # Imported here: it loads transformers and torch, which must wait for the session's MKL
    # choice (tests/conftest.py), and this file is imported before that when pytest is given
    # this folder.
    from services.detokenizer.service import make_decoder

    return make_decoder(resolve_model_dir(BatonConfig.from_env()))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def encode() -> Callable[[str], list[int]]:
    tok = Tokenizer.from_file(str(resolve_model_dir(BatonConfig.from_env()) / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


@pytest.fixture
def h(decode: Decode) -> Harness:
    return Harness(decode)


@pytest.fixture(scope="module")
def eos() -> int:
    """An EOS id of the tiny model: what an engine's ``stop`` event ends with."""
    config = json.loads((resolve_model_dir(BatonConfig.from_env()) / "config.json").read_text())
    eos = config["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


@pytest.fixture
def ids(encode: Any) -> list[int]:
    ids = encode(MULTIBYTE)
    assert len(ids) >= 12  # the tests below slice it
    return ids  # type: ignore[no-any-return]
