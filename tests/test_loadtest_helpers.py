"""Workload generation, percentiles, goodput and FLOP counting of loadtest/workload.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from loadtest.workload import (
    LoadMix,
    RequestResult,
    RequestSpec,
    Slo,
    Stat,
    format_summary,
    make_workload,
    parse_mix,
    percentile,
    poisson_arrivals,
    read_vocab,
    sample_lengths,
    summarize,
    tpot,
    workload_flops,
)


def test_percentile_interpolates_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)  # 1 + 0.99 * 3
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_stat_of_values_and_empty() -> None:
    s = Stat.of([float(x) for x in range(1, 101)])
    assert (s.mean, s.p50, s.max, s.count) == (50.5, 50.5, 100.0, 100)
    assert s.p99 == pytest.approx(99.01)
    empty = Stat.of([])
    assert empty.count == 0 and math.isnan(empty.p50)


def test_tpot_definition() -> None:
    assert tpot(0.5, 2.5, 5) == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert tpot(0.5, 0.5, 1) is None  # one token: no time "per output token" after the first
    assert tpot(None, 2.0, 5) is None


def test_workload_is_deterministic_and_in_range() -> None:
    a = make_workload(50, 40, 10, vocab_size=30, seed=3, range_ratio=0.5, exclude_ids={0, 1, 2})
    b = make_workload(50, 40, 10, vocab_size=30, seed=3, range_ratio=0.5, exclude_ids={0, 1, 2})
    c = make_workload(50, 40, 10, vocab_size=30, seed=4, range_ratio=0.5)
    assert a == b and a != c
    for spec in a:
        assert 20 <= len(spec.prompt_token_ids) <= 60
        assert 5 <= spec.max_tokens <= 15
        assert all(3 <= t < 30 for t in spec.prompt_token_ids)
        assert spec.arrival_s == 0.0 and spec.priority is None
    assert len({len(s.prompt_token_ids) for s in a}) > 1


def test_fixed_lengths_and_prompts_shared_across_rates() -> None:
    at_once = make_workload(16, 128, 64, vocab_size=4096, seed=0)
    poisson = make_workload(16, 128, 64, vocab_size=4096, seed=0, rate=4.0)
    assert all(len(s.prompt_token_ids) == 128 and s.max_tokens == 64 for s in at_once)
    # the benchmark compares rates (and HF) on the same prompts: only arrivals differ
    assert [s.prompt_token_ids for s in at_once] == [s.prompt_token_ids for s in poisson]
    assert [s.arrival_s for s in poisson] != [0.0] * 16


def test_poisson_arrivals_have_the_requested_rate() -> None:
    arrivals = poisson_arrivals(np.random.default_rng(0), 20_000, rate=8.0)
    assert arrivals[0] == 0.0
    assert all(x <= y for x, y in zip(arrivals, arrivals[1:], strict=False))
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(8.0, rel=0.05)
    assert poisson_arrivals(np.random.default_rng(0), 3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(np.random.default_rng(0), 3, 0.0)


def test_sample_lengths_bounds() -> None:
    rng = np.random.default_rng(0)
    assert sample_lengths(rng, 5, 64, 0.0) == [64] * 5
    assert min(sample_lengths(rng, 200, 1, 0.9)) >= 1
    with pytest.raises(ValueError):
        sample_lengths(rng, 5, 64, 1.0)


def test_priority_mix() -> None:
    assert parse_mix("0:0.8,5:0.2") == [(0, 0.8), (5, 0.2)]
    assert parse_mix("128") == [(128, 1.0)]
    assert parse_mix("32:1, 512:3") == [(32, 0.25), (512, 0.75)]
    for bad in ("", "0:0", "5:-1", "x:1"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    specs = make_workload(2000, 4, 2, vocab_size=50, priorities=parse_mix("0:0.8,5:0.2"))
    prios = [s.priority for s in specs]
    assert set(prios) == {0, 5}
    assert prios.count(5) / len(prios) == pytest.approx(0.2, abs=0.03)


def _result(ttft: float, e2e: float, n_out: int, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, num_prompt_tokens=10, num_output_tokens=n_out, ttft=ttft, e2e=e2e)


def test_goodput_counts_requests_meeting_both_slos() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    results = [
        _result(0.5, 0.5 + 9 * 0.05, 10),  # meets both
        _result(0.5, 0.5 + 9 * 0.1, 10),  # TPOT exactly at the bound: meets
        _result(1.5, 1.5 + 9 * 0.05, 10),  # TTFT misses
        _result(0.5, 0.5 + 9 * 0.2, 10),  # TPOT misses
        _result(0.9, 0.9, 1),  # one token: judged on TTFT only
        RequestResult(ok=False, num_prompt_tokens=10, error="overloaded"),
    ]
    s = summarize(results, duration_s=2.0, slo=slo)
    assert s.completed == 5 and s.failed == 1 and s.errors == {"overloaded": 1}
    assert s.goodput == pytest.approx(3 / 2.0)
    assert s.slo_attainment == pytest.approx(3 / 6)
    assert s.request_throughput == pytest.approx(5 / 2.0)
    assert s.total_output_tokens == 41 and s.output_throughput == pytest.approx(41 / 2.0)
    assert s.tpot.count == 4  # the one-token request has no TPOT
    text = format_summary(s, "t", slo)
    assert "Goodput (req/s, TTFT<=1s, TPOT<=0.1s):" in text and "overloaded" in text


def test_workload_flops_by_hand() -> None:
    cfg = {
        "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 10,
    }  # fmt: skip
    # per layer: q 8x8, k/v 8x4 each, o 8x8, mlp 3x8x16 -> 64+32+32+64+384 = 576
    spec = RequestSpec(prompt_token_ids=(1, 2, 3), max_tokens=2)
    f = workload_flops(cfg, [spec])
    t = 3 + 2 - 1
    assert f["matmul_params"] == 2 * 576 + 80
    assert f["matmul"] == 2 * 1152 * t + 2 * 80 * 2
    assert f["attention"] == 4 * 2 * 2 * 4 * t * (t + 1) / 2
    assert f["total"] == f["matmul"] + f["attention"]


def test_read_vocab(tmp_path: Path) -> None:
    cfg = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_vocab(tmp_path) == (512, frozenset({1, 2, 3}))


def test_load_mix_from_env() -> None:
    default = LoadMix.from_env({})
    rng = np.random.default_rng(0)
    assert default.sample(rng) == (128, 64, 0)
    mix = LoadMix.from_env(
        {"BATON_LOCUST_INPUT_LEN": "32:1,512:1", "BATON_LOCUST_PRIORITIES": "0:0.8,5:0.2"}
    )
    draws = [mix.sample(rng) for _ in range(1000)]
    assert {d[0] for d in draws} == {32, 512} and {d[1] for d in draws} == {64}
    assert sum(d[2] == 5 for d in draws) == pytest.approx(200, abs=50)
