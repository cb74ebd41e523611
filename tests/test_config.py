"""BatonConfig: BATON_* env parsing, overrides, CLI flags, immutability."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from shared.config import BatonConfig


def test_defaults_from_an_empty_env() -> None:
    config = BatonConfig.from_env({})
    assert config == BatonConfig()
    assert config.model == "" and config.dtype == "auto" and config.weight_format == "auto"


def test_unrelated_env_is_ignored() -> None:
    env = {"PATH": "/bin", "BATON_NOT_A_FIELD": "1", "baton_block_size": "8"}
    assert BatonConfig.from_env(env) == BatonConfig()


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_BLOCK_SIZE", "32")
    assert BatonConfig.from_env().block_size == 32


@pytest.mark.parametrize(
    "name, raw, value",
    [
        ("block_size", "8", 8),
        ("block_size", " 8 ", 8),
        ("num_kv_blocks", "0", 0),
        ("spill_max_bytes", "1_000", 1000),
        ("prefill_batch_wait_s", "0.25", 0.25),
        ("prefill_batch_wait_s", "1e-3", 0.001),
        ("spill_orphan_timeout_s", "7", 7.0),
        ("amqp_url", "amqp://u:p@h:1/v", "amqp://u:p@h:1/v"),
        ("model", "/models/x", "/models/x"),
        ("dtype", "bfloat16", "bfloat16"),
    ],
)
def test_typed_values(name: str, raw: str, value: object) -> None:
    config = BatonConfig.from_env({"BATON_" + name.upper(): raw})
    assert getattr(config, name) == value
    assert type(getattr(config, name)) is type(value)


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " true "])
def test_bool_true(raw: str) -> None:
    assert BatonConfig.from_env({"BATON_ENABLE_PREFIX_CACHING": raw}).enable_prefix_caching is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_bool_false(raw: str) -> None:
    config = BatonConfig.from_env({"BATON_ENABLE_PREFIX_CACHING": raw})
    assert config.enable_prefix_caching is False


@pytest.mark.parametrize(
    "name, raw",
    [
        ("enable_prefix_caching", "maybe"),
        ("enable_prefix_caching", ""),
        ("enable_prefix_caching", "2"),
        ("block_size", "16.0"),
        ("block_size", "sixteen"),
        ("block_size", ""),
        ("max_num_batched_tokens", "0x100"),
        ("prefill_batch_wait_s", "fast"),
        ("prefill_batch_wait_s", ""),
    ],
)
def test_bad_values_name_the_variable(name: str, raw: str) -> None:
    var = "BATON_" + name.upper()
    with pytest.raises(ValueError) as err:
        BatonConfig.from_env({var: raw})
    message = str(err.value)
    assert message.startswith(var + ":")
    assert repr(raw) in message or raw in message


def test_overrides_win_over_env() -> None:
    env = {"BATON_BLOCK_SIZE": "8", "BATON_MAX_NUM_SEQS": "4"}
    config = BatonConfig.from_env(env, block_size=32, device="cuda")
    assert (config.block_size, config.max_num_seqs, config.device) == (32, 4, "cuda")


def test_none_overrides_are_ignored() -> None:
    config = BatonConfig.from_env({"BATON_BLOCK_SIZE": "8"}, block_size=None, model=None)
    assert config.block_size == 8 and config.model == ""


def test_unknown_override_is_refused() -> None:
    with pytest.raises(TypeError):
        BatonConfig.from_env({}, no_such_field=1)


def test_frozen() -> None:
    config = BatonConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 1  # type: ignore[misc]
    changed = config.replace(block_size=1)
    assert changed.block_size == 1 and config.block_size == 16
    assert hash(config) == hash(BatonConfig())  # frozen dataclasses hash by value


def test_cli_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("BATON_BLOCK_SIZE", "8")
    parser = argparse.ArgumentParser()
    BatonConfig.add_arguments(parser)
    args = parser.parse_args(
        ["--block-size", "64", "--no-enable-prefix-caching", "--prefill-batch-wait-s", "0.5"]
    )
    config = BatonConfig.from_args(args)
    assert config.block_size == 64  # the flag wins over the env
    assert config.max_num_seqs == 3  # the env fills what the flags leave out
    assert config.enable_prefix_caching is False and config.prefill_batch_wait_s == 0.5


def test_cli_flag_bad_value() -> None:
    parser = argparse.ArgumentParser()
    BatonConfig.add_arguments(parser)
    args = parser.parse_args(["--max-num-seqs", "many"])
    with pytest.raises(ValueError, match="BATON_MAX_NUM_SEQS"):
        BatonConfig.from_args(args)


def test_every_field_has_an_env_var_and_a_flag() -> None:
    parser = argparse.ArgumentParser()
    BatonConfig.add_arguments(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(BatonConfig)}
    defaults = BatonConfig()
    env = {}
    for f in dataclasses.fields(BatonConfig):
        value = getattr(defaults, f.name)
        if value is None:  # an optional setting left unset: an empty variable
            env["BATON_" + f.name.upper()] = ""
            continue
        env["BATON_" + f.name.upper()] = (
            ("true" if value else "false") if isinstance(value, bool) else str(value)
        )
    assert BatonConfig.from_env(env) == defaults  # every default survives a text round trip
