"""Workload generation, percentiles, goodput and FLOP counting of loadtest/serving/workload.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from loadtest.faults.reply_log import ReplyLog
from loadtest.serving import stage_profile as sp
from loadtest.serving.driver import metrics_ports
from loadtest.serving.overhead import format_overhead
from loadtest.serving.vllm_baseline import parse_result, run_vllm_baseline
from loadtest.serving.workload import (
    LoadMix,
    RequestResult,
    RequestSpec,
    Slo,
    Stat,
    format_summary,
    greedy_agreement,
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
from shared.wire.messages import DoneReply, TokenReply


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
    # one decode step (the second output token): the layers and the head once
    assert f["decode_matmul"] == 2 * (1152 + 80) * 1
    # the prompt through the layers (its first token's head is prefill's, not counted here)
    assert f["prefill_body_matmul"] == 2 * 1152 * 3


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


# --- greedy agreement, vLLM baseline plumbing ----------------------------------------------------


def test_greedy_agreement() -> None:
    a = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 9, 9]])
    assert a == {"exact": 0.5, "prefix": pytest.approx((1.0 + 0.5) / 2), "requests": 2}
    assert greedy_agreement([[1]], [[2]])["prefix"] == 0.0
    assert greedy_agreement([[1, 2]], [[1, 2, 3]])["exact"] == 0.0  # shorter output: not equal
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [])


def test_vllm_result_line_is_found_among_log_lines() -> None:
    out = "INFO 12-03 loading\n{not json\n" + json.dumps({"vllm_output_throughput": 5.0}) + "\n"
    assert parse_result(out) == {"vllm_output_throughput": 5.0}
    assert parse_result('INFO done\n{"other": 1}\n') is None


def test_vllm_baseline_skips_without_a_virtualenv(tmp_path: Path) -> None:
    assert "skipped" in run_vllm_baseline(None, tmp_path, [([1], 1)], max_model_len=8)
    missing = run_vllm_baseline(tmp_path / "nope", tmp_path, [([1], 1)], max_model_len=8)
    assert "does not exist" in missing["skipped"]


# --- profile helpers -------------------------------------------------------------------------


def test_parse_proc_stat_handles_odd_process_names() -> None:
    fields = ["S", "42"] + ["0"] * 9 + ["250", "50"] + ["0"] * 30
    comm, ppid, cpu = sp.parse_proc_stat("123 (we (ird) name) " + " ".join(fields))
    assert (comm, ppid) == ("we (ird) name", 42)
    assert cpu == pytest.approx(300 / sp.CLK_TCK)
    own = sp.cpu_snapshot({"me": [__import__("os").getpid()], "gone": [2**22 + 7]})
    assert own["me"] > 0 and own["gone"] == 0.0
    assert sp.diff({"a": 1.0}, {"a": 3.5, "b": 1.0}) == {"a": 2.5, "b": 1.0}


def test_service_name_from_cmdline() -> None:
    assert sp.service_name(["/usr/bin/python", "-m", "services", "decode", ""]) == "decode"
    assert sp.service_name(["python", "-m", "services"]) is None
    assert sp.service_name(["python", "-m", "loadtest.serving.bench"]) is None


METRICS_BEFORE = """# TYPE baton:forward_seconds histogram
baton:forward_seconds_bucket{le="+Inf"} 2.0
baton:forward_seconds_sum 0.5
baton:forward_seconds_count 2.0
# TYPE baton:handoff_seconds histogram
baton:handoff_seconds_sum{transport="shm"} 0.25
baton:handoff_seconds_count{transport="shm"} 1.0
"""
METRICS_AFTER = """# TYPE baton:forward_seconds histogram
baton:forward_seconds_bucket{le="+Inf"} 5.0
baton:forward_seconds_sum 2.0
baton:forward_seconds_count 5.0
# TYPE baton:handoff_seconds histogram
baton:handoff_seconds_sum{transport="shm"} 0.75
baton:handoff_seconds_count{transport="shm"} 3.0
baton:handoff_seconds_sum{transport="pool"} 0.5
baton:handoff_seconds_count{transport="pool"} 1.0
"""


def test_metric_deltas() -> None:
    before, after = sp.parse_metrics(METRICS_BEFORE), sp.parse_metrics(METRICS_AFTER)
    assert sp.hist_delta(before, after, "baton:forward_seconds") == (1.5, 3.0)
    assert sp.hist_delta(before, after, "baton:handoff_seconds") == (1.0, 3.0)  # all transports
    assert sp.hist_delta(before, after, "baton:handoff_seconds", transport="shm") == (0.5, 2.0)
    assert sp.metric(after, "baton:absent_total") == 0.0


def test_classify_py_spy_stacks() -> None:
    raw = "\n".join([
        "Runner.run (/a/asyncio/runners.py:118);encode (/r/services/tokenizer/core.py:9) 4",
        "Runner.run (/a/runners.py:1);publish (/s/aio_pika/exchange.py:5) 3",
        "Runner.run (/a/runners.py:1);_reader (/s/aiormq/connection.py:7) 2",
        "Runner.run (/a/asyncio/runners.py:118) 5",
        "Runner.run (/a/asyncio/runners.py:118);mystery (/x.py:1) 1",
        "garbage line",
    ])  # fmt: skip
    counts, other = sp.classify_collapsed(raw)
    assert counts == {"tokenize": 4, "publish": 3, "amqp": 2, "event loop": 5, "other": 1}
    assert other == {"mystery (/x.py:1)": 1}


def _scrapes() -> dict[str, tuple[sp.Samples, sp.Samples]]:
    before, after = sp.parse_metrics(METRICS_BEFORE), sp.parse_metrics(METRICS_AFTER)
    return {"prefill": (before, after), "decode": (before, after)}


def test_build_stages_and_format() -> None:
    pyspy = {"detokenizer": {"samples": {"detokenize": 1, "publish": 3}}}
    cpu = {"detokenizer": 2.0, "decode": 1.0, "rabbitmq (beam.smp)": 0.5}
    rows = {r["stage"]: r for r in sp.build_stages(_scrapes(), pyspy, cpu)}
    assert rows["prefill forward (+sampling)"]["seconds"] == 1.5
    assert rows["handoff read"]["count"] == 3.0
    assert rows["detokenize"]["seconds"] == pytest.approx(0.5)  # 1/4 of the detokenizer's CPU
    assert rows["reply publish"]["seconds"] == pytest.approx(1.5)
    assert rows["sampling"]["seconds"] is None
    assert rows["queue wait (arrival->prefill)"]["seconds"] is None  # no detokenizer scrape
    assert [r["stage"] for r in sp.build_stages({}, None, {})][:3] == [
        "tokenize", "queue wait (arrival->prefill)", "prefill forward (+sampling)",
    ]  # fmt: skip
    no_spy = {r["stage"]: r for r in sp.build_stages(_scrapes(), None, cpu)}
    assert (
        no_spy["tokenize"]["seconds"] is None and "not instrumented" in no_spy["tokenize"]["source"]
    )
    broker = sp.broker_delta(
        {"vhost": "v", "published": 10.0, "delivered": 9.0, "bytes_in": 100.0, "bytes_out": 50.0,
         "queues": {"baton.prefill": 1.0}},
        {"vhost": "v", "published": 30.0, "delivered": 29.0, "bytes_in": 2148.0, "bytes_out": 50.0,
         "queues": {"baton.prefill": 5.0, "baton.reply.*": 2.0}},
    )  # fmt: skip
    assert broker["published"] == 20.0 and broker["queues"] == {"baton.prefill": 4.0,
                                                               "baton.reply.*": 2.0}  # fmt: skip
    profile = {"label": "run", "num_requests": 4, "wall_s": 2.0, "cores": 2, "cpu_s": cpu,
               "stages": list(rows.values()), "broker": broker}  # fmt: skip
    text = sp.format_profile(profile)
    assert "decode" in text and "total" in text and "5.0 messages published" in text
    assert "0.5 KiB in" in text  # 2048 bytes / 4 requests
    assert "not measured" in sp.format_profile({**profile, "broker": {"skipped": "no API"}})


def test_queue_group() -> None:
    assert sp.queue_group("baton.reply.0123456789abcdef0123") == "baton.reply.*"
    assert sp.queue_group("amq.gen-XyZ") == "amq.* (server-named)"
    assert sp.queue_group("baton.decode") == "baton.decode"


def test_plot_profile(tmp_path: Path) -> None:
    rows = sp.build_stages(_scrapes(), None, {})
    profile = {"label": "run", "num_requests": 4, "wall_s": 2.0, "cores": 2,
               "cpu_s": {"decode": 1.0, "prefill": 0.5}, "stages": rows}  # fmt: skip
    sp.plot_profile(tmp_path / "p.png", [profile])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_format_overhead_and_ports() -> None:
    fig = {"requests": 100, "client_e2e_p50_s": 0.016, "client_e2e_p99_s": 0.02,
           "client_ttft_p50_s": 0.015, "prefill_forward_per_request_s": 0.004,
           "prefill_forward_count": 100.0}  # fmt: skip
    text = format_overhead(fig)
    assert "12.00" in text  # 16 ms end to end - 4 ms forward
    no_scrape = {k: v for k, v in fig.items() if not k.startswith("prefill")}
    assert "no /metrics" in format_overhead(no_scrape)
    ports = metrics_ports(9000)
    assert ports["tokenizer"] == 9000 and ports["detokenizer"] == 9003


def test_mixed_workload_phases_and_report(tmp_path: Path) -> None:
    """loadtest/serving/mixed.py: the burst phase is the steady one plus 10% long prompts arriving
    together; only short requests count; the report prints both ratios and plots."""
    from loadtest.serving import mixed

    specs = mixed.phases(40, 8.0, 4096, frozenset({0, 1}), seed=3)
    steady, burst = specs["steady"], specs["burst"]
    longs = [s for s in burst if len(s.prompt_token_ids) == mixed.LONG_PROMPT]
    assert len(steady) == 40 and len(longs) == 4 and len(burst) == 44
    assert all(s in burst for s in steady)
    assert max(s.arrival_s for s in longs) - min(s.arrival_s for s in longs) <= 0.2
    assert [s.arrival_s for s in burst] == sorted(s.arrival_s for s in burst)

    def result(prompt: int, ttft: float, e2e: float, n: int) -> RequestResult:
        return RequestResult(True, prompt, n, ttft, e2e)

    stats = mixed.short_stats([result(64, 0.1, 0.1 + 63 * 0.02, 64),
                               result(1500, 5.0, 6.0, 16)])  # fmt: skip
    assert stats["num_short"] == 1 and stats["ttft_p99"] == pytest.approx(0.1)
    assert stats["tpot_p99"] == pytest.approx(0.02)
    phase = {"steady": stats, "burst": {**stats, "tpot_p99": 0.03, "ttft_p99": 0.2}}
    report = {"rate": 8.0, "configs": {"chunked": phase, "unchunked": phase}}
    text = mixed.format_mixed(report)
    assert "burst / steady = 1.50x" in text and "chunked / unchunked = 1.00x" in text
    mixed.plot_mixed(tmp_path / "m.png", report)
    assert (tmp_path / "m.png").stat().st_size > 0


# --- ReplyLog.check_stream: the raw stream, strictly ------------------------------------------


def _done(text: str, e2e_s: float) -> DoneReply:
    usage = {"prompt_tokens": 2, "completion_tokens": 2}
    return DoneReply("r", text, [5, 6], "length", usage, {"e2e_s": e2e_s})


def test_check_stream_allows_one_terminal_and_each_position_once() -> None:
    log = ReplyLog("amqp://unused/")
    log.replies["r"] = [TokenReply("r", "a", [5], 0, 0), TokenReply("r", "b", [6], 1, 1)]
    log.replies["r"].append(_done("ab", 1.0))
    assert log.check_stream("r").text == "ab" and log.num_repeated(["r"]) == 0
    log.replies["r"].append(_done("ab", 2.5))  # a repeated answer: never, even an equal one
    with pytest.raises(AssertionError):
        log.check_stream("r")
    log.replies["r"] = [TokenReply("r", "ab", [5, 6], 0, 0), TokenReply("r", "b", [6], 1, 1)]
    log.replies["r"].append(_done("ab", 1.0))  # position 1 twice: a replayed stream
    assert log.num_repeated(["r"]) == 1
    with pytest.raises(AssertionError, match="expected 2/2"):
        log.check_stream("r")


def test_loadtest_command_line_lists_and_finds_every_tool(capsys: pytest.CaptureFixture) -> None:
    """``python -m loadtest``: every name it lists runs a module's ``main``; an unknown name is
    an error that prints the list; ``overhead`` is ``bench --fixed-overhead``."""
    import importlib

    from loadtest import __main__ as cli

    table = cli.commands()
    modules = {c.module for c in table.values()} | cli.INTERNAL
    for path in sorted(cli.HERE.rglob("*.py")):  # every runnable module has its line
        tree = cli._parse(path)
        name = ".".join(path.relative_to(cli.HERE).with_suffix("").parts)
        if tree and cli.runnable(tree) and name != "__main__":
            assert name in modules, f"loadtest/{name}: add it to loadtest/__main__.py's COMMANDS"
    assert cli.main([]) == 0
    listed = capsys.readouterr().out
    for name, command in table.items():
        assert f"  {name} " in listed and cli.about(command)
        if name != "locust":
            assert callable(importlib.import_module(f"loadtest.{command.module}").main)
    assert not {"baselines", "vllm-baseline", "models", "plots"} & set(table)
    overhead = table["overhead"]
    assert overhead == cli.Command("serving.bench", ("--fixed-overhead",), overhead.about)
    assert cli.main(["no-such-tool"]) == 2
    assert "no tool named" in capsys.readouterr().err


def test_hf_baseline_ignores_eos_as_baton_and_vllm_do() -> None:
    """HF's baseline generates past an EOS id without masking it (``ignore_eos``), so its
    greedy outputs are comparable with Baton's: equal, request by request, to transformers'
    unbatched greedy with ``eos_token_id=None``. The two requests are ones whose greedy output
    on the bench model emits an EOS id (checked below); with EOS suppressed (the baseline's old
    ``min_new_tokens``) HF took the runner-up there and disagreed with Baton and vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    from loadtest.serving.baselines import hf_baseline
    from tests.runtime.helpers import greedy, hf_greedy, tiny_model_dir, torch_threads

    model_dir = tiny_model_dir("llama", "bench")
    specs = make_workload(64, 128, 16, 4096, seed=0, exclude_ids=frozenset({0, 1, 2}))
    chosen = [specs[32], specs[63]]
    with torch_threads(1):
        got = hf_baseline(model_dir, chosen, batch_size=2)["token_ids"]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = [
            hf_greedy(model, list(s.prompt_token_ids), greedy(16, ignore_eos=True)) for s in chosen
        ]
    assert got == want
    eos_ids = {0, 2}  # the bench model's generation_config.eos_token_id
    assert all(eos_ids & set(ids) for ids in got)  # the case this is about: an EOS id emitted
