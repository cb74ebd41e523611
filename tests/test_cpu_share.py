"""The engines' shared thread budget (shared/engine/cpu_share.py), on a real table file: alone an
engine takes every core, busy together they split them, a dead or silent engine is ignored, and two
deployments (or CPU sets) never see each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.__main__ import _engine_cpus
from shared.config import BatonConfig
from shared.engine.cpu_share import TTL_S, CpuShareManager, fair_share, table_path
from shared.engine.thread_choice import (
    EXPLORE_EVERY,
    FIRST_TRIES,
    HORIZON_S,
    TRY_RUN,
    WINDOW,
    ThreadChoice,
    bucket,
)

URL = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture
def table(tmp_path: Path) -> Path:
    return table_path(URL, frozenset({0, 1}), root=tmp_path)


def test_an_engine_alone_takes_every_core_and_busy_engines_split_them(table: Path) -> None:
    prefill, decode = CpuShareManager(table, 4), CpuShareManager(table, 4)
    assert decode.budget(busy=True) == 4  # prefill idle
    assert prefill.budget(busy=True) == 2  # decode busy: half
    assert decode.budget(busy=True) == 2
    prefill.idle()
    assert decode.budget(busy=True) == 4  # and back
    assert prefill.budget(busy=False) == 4  # an idle step holds no one back
    assert decode.budget(busy=True) == 4


def test_shares_round_down_but_never_to_zero() -> None:
    assert [fair_share(2, n) for n in range(4)] == [2, 1, 1, 1]
    assert fair_share(7, 1) == 3


def test_an_expired_heartbeat_is_ignored_and_its_slot_reused(table: Path) -> None:
    now = [1000.0]
    hung = CpuShareManager(table, 2, clock=lambda: now[0])
    decode = CpuShareManager(table, 2, clock=lambda: now[0])
    hung.budget(busy=True)
    assert decode.budget(busy=True) == 1
    now[0] += TTL_S + 1  # the hung engine never steps again
    assert decode.budget(busy=True) == 2
    assert CpuShareManager(table, 2, clock=lambda: now[0]).slot == hung.slot


def test_a_killed_engines_busy_slot_is_ignored(table: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from shared.engine.cpu_share import "
        "CpuShareManager; CpuShareManager(Path(sys.argv[1]), 2).budget(busy=True)"
    )
    subprocess.run([sys.executable, "-c", code, str(table)], check=True, timeout=60)
    decode = CpuShareManager(table, 2)  # the child exited busy, its heartbeat fresh
    assert decode.budget(busy=True) == 2


def test_two_deployments_and_disjoint_cpu_sets_never_mix(tmp_path: Path) -> None:
    cpus = frozenset({0, 1})
    a = CpuShareManager(table_path(URL, cpus, tmp_path), 2)
    b = CpuShareManager(table_path(URL + "other", cpus, tmp_path), 2)
    c = CpuShareManager(table_path(URL, frozenset({1}), tmp_path), 1)
    assert a.budget(busy=True) == 2 and b.budget(busy=True) == 2 and c.budget(busy=True) == 1
    # credentials are not part of the deployment: each service may log in as its own user
    other_user = "amqp://decode:secret@127.0.0.1:5672/"
    assert table_path(other_user, cpus, tmp_path) == table_path(URL, cpus, tmp_path)
    # A broker cluster's every address (compose.cluster.yaml's host list, or one URL each)
    hosts = table_path("amqp://p:s@rabbitmq:5672,rabbitmq-2:5672/", cpus, tmp_path)
    urls = "amqp://d:t@rabbitmq-2:5672/,amqp://d:t@rabbitmq:5672/"
    assert hosts == table_path(urls, cpus, tmp_path) != table_path(URL, cpus, tmp_path)


def test_a_closed_engine_gives_its_slot_back(table: Path) -> None:
    prefill, decode = CpuShareManager(table, 2), CpuShareManager(table, 2)
    prefill.budget(busy=True)
    prefill.close()
    assert decode.budget(busy=True) == 2


def test_the_step_runs_at_the_budget(table: Path) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        other, me = CpuShareManager(table, 2), CpuShareManager(table, 2)
        assert me.run_step(True, torch.get_num_threads) == 2
        other.budget(busy=True)
        assert me.run_step(True, torch.get_num_threads) == 1
        assert me.threads == 1  # what the engine reports (baton:engine_threads)
    finally:
        torch.set_num_threads(before)


def test_a_long_step_follows_the_other_engines_work_between_layers(table: Path) -> None:
    """A prefill forward that began alone on both cores drops to its share at the next layer
    once decode turns busy, and takes them back once decode is idle: the counts never sum past
    the cores for longer than a layer."""
    import torch

    from shared.runtime import BlockManager, SamplingParams, Sequence
    from tests.runtime.helpers import make_runner, tiny_model_dir

    before = torch.get_num_threads()
    runner = make_runner(tiny_model_dir("llama"), num_kv_blocks=16)
    other, me = CpuShareManager(table, 2), CpuShareManager(table, 2)
    seen: list[tuple[int, int]] = []

    def between_layers(done: int) -> None:
        me.rebalance(done)
        seen.append((done, torch.get_num_threads()))
        other.budget(busy=done == 1)  # decode turns busy after layer 1, idle after layer 2

    runner.between_layers = between_layers
    seq = Sequence("s", list(range(3, 19)), SamplingParams())
    BlockManager(runner.num_kv_blocks, runner.block_size).allocate(seq)
    try:
        me.run_step(True, lambda: runner.prefill([seq], [seq.num_tokens]))
        assert seen == [(1, 2), (2, 1)]  # the tiny model's two layers
        assert me.threads == 1  # the count the step ended with (baton:engine_threads)
        me.rebalance()  # a next layer, decode idle again (after layer 2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_decode_yields_to_a_busy_prefill_for_at_most_its_bound(table: Path) -> None:
    """A decode engine with work waits while a prefill engine computes a wave of more
    sequences than decode runs (and is idle while it waits, so prefill's budget is every core),
    but never longer than ``yield_s`` since its last step, never for a smaller wave (steady
    arrivals: one prompt at a time beside a full decode batch) and never for another decode."""
    prefill = CpuShareManager(table, 2, prefill=True)
    decode, other_decode = CpuShareManager(table, 2), CpuShareManager(table, 2)
    assert not decode.decode_yields(0.1, 0.5, running=1)  # nobody busy
    other_decode.budget(busy=True, seqs=40)
    assert not decode.decode_yields(0.1, 0.5, running=1)  # a busy decode replica: no reason
    other_decode.idle()
    prefill.budget(busy=True, seqs=15)  # a burst's wave
    decode.budget(busy=True, seqs=1)
    assert prefill.budget(busy=True, seqs=15) == 1  # both busy: a core each
    assert decode.decode_yields(0.1, 0.5, running=1)
    assert prefill.budget(busy=True, seqs=15) == 2  # decode waits idle: prefill takes both
    assert not decode.decode_yields(0.5, 0.5, running=1)  # its bound reached: it steps
    assert not decode.decode_yields(0.1, 0.0, running=1)  # BATON_DECODE_YIELD_S=0: never
    assert not decode.decode_yields(0.1, 0.5, running=15)  # as many running as in the wave
    # a stream already at its TPOT objective: no slack to lend the wave
    assert not decode.decode_yields(0.1, 0.5, running=1, slack_s=lambda: -0.01)
    assert decode.decode_yields(0.1, 0.5, running=1, slack_s=lambda: 0.05)
    prefill.budget(busy=True, seqs=2)  # arrivals: a small wave beside a large batch
    assert not decode.decode_yields(0.1, 0.5, running=30)
    prefill.idle()
    assert not decode.decode_yields(0.1, 0.5, running=1)


def test_services_up_leaves_sharing_engines_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_PREFILL_CPUS", raising=False)
    monkeypatch.delenv("BATON_DECODE_CPUS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    split = {"prefill": "0,1", "decode": "2,3"}
    assert _engine_cpus(BatonConfig()) == {}  # any model shares, the tiny one too
    assert _engine_cpus(BatonConfig(cpu_share=False)) == split
    assert _engine_cpus(BatonConfig(device="cuda")) == split  # only CPU engines share


def _runs(options: list[bool]) -> list[tuple[bool, int]]:
    """(option, steps in a row) of a sequence of options."""
    runs: list[tuple[bool, int]] = []
    for o in options:
        if runs and runs[-1][0] == o:
            runs[-1] = (o, runs[-1][1] + 1)
        else:
            runs.append((o, 1))
    return runs


def test_thread_choice_runs_the_faster_option_per_batch_and_keeps_trying_the_other() -> None:
    choice = ThreadChoice(clock=lambda: 0.0)
    seconds = {False: 0.004, True: 0.002}
    first: list[bool] = []
    while len(first) < 4 * TRY_RUN:  # each option in runs, alternately, every core first
        leave = choice.leave(2 + len(first) % 2)  # 2 and 3 sequences share a bucket
        choice.record(2, leave, seconds[leave])
        first.append(leave)
    assert _runs(first) == [(False, TRY_RUN), (True, TRY_RUN)] * 2
    assert 2 * TRY_RUN >= FIRST_TRIES
    after = [choice.leave(2) for _ in range(2 * EXPLORE_EVERY + 2 * TRY_RUN)]
    # the faster, but every EXPLORE_EVERY-th step a run of the other
    assert after.count(False) == 2 * TRY_RUN and (False, TRY_RUN) in _runs(after)
    for _ in range(WINDOW):  # the load changes: leaving a core turns slower
        choice.record(2, True, 0.006)
    later = [choice.leave(2) for _ in range(EXPLORE_EVERY + TRY_RUN)]
    assert later.count(True) == TRY_RUN
    assert choice.leave(64) is False and bucket(64) != bucket(2)  # a new bucket starts over


def test_thread_choice_measures_both_options_again_after_a_pause() -> None:
    """A decode running beside a burst's prefill found one core fewer faster; alone after it,
    every core is: old measurements do not decide, the option not chosen is tried again."""
    now = [0.0]
    choice = ThreadChoice(clock=lambda: now[0])

    def measured(seqs: int, seconds: dict[bool, float], steps: int) -> list[bool]:
        runs = []
        for _ in range(steps):
            leave = choice.leave(seqs)
            choice.record(seqs, leave, seconds[leave])
            now[0] += seconds[leave]
            runs.append(leave)
        return runs

    beside_prefill = {False: 0.060, True: 0.040}
    first = 4 * TRY_RUN
    runs = measured(64, beside_prefill, first + EXPLORE_EVERY)
    assert runs[first:].count(True) == EXPLORE_EVERY - TRY_RUN
    now[0] += HORIZON_S + 0.5  # prefill's wave held the cores meanwhile: no steps chosen
    alone = {False: 0.030, True: 0.045}
    # each option's newest too old: both tried again, in runs
    assert measured(64, alone, 2 * TRY_RUN) == [False] * TRY_RUN + [True] * TRY_RUN
    assert measured(64, alone, EXPLORE_EVERY).count(False) >= EXPLORE_EVERY - TRY_RUN
    # Steps as long as the horizon: it is counted in steps instead (HORIZON_STEPS of them), so
    # a pause of a few steps leaves the option not chosen measured recently enough; in seconds
    # alone it would be tried again every other step.
    slow = {False: HORIZON_S, True: 2 * HORIZON_S}
    measured(1, slow, first)
    now[0] += 3 * HORIZON_S
    assert measured(1, slow, EXPLORE_EVERY - 1).count(True) <= TRY_RUN


def test_a_step_after_a_change_of_thread_count_is_not_measured(table: Path) -> None:
    """The first step after the team's size changes is slow whichever the option (it re-forms):
    counted, a lone try of the option not chosen measured the switch, not the option."""
    import torch

    before = torch.get_num_threads()
    try:
        decode = CpuShareManager(table, 2, choose_threads=True)
        choice = decode.choice
        assert choice is not None
        recorded: list[tuple[bool, int]] = []
        record = choice.record

        def counted(seqs: int, leave: bool, seconds: float) -> None:
            recorded.append((leave, torch.get_num_threads()))
            record(seqs, leave, seconds)

        choice.record = counted  # type: ignore[method-assign]
        options = []
        for _ in range(4 * TRY_RUN):
            decode.run_step(True, lambda: None, seqs=4)
            options.append(decode._leave)
        assert _runs(options) == [(False, TRY_RUN), (True, TRY_RUN)] * 2
        # every run's first step is a switch (the very first has no step before it)
        assert len(recorded) == 4 * (TRY_RUN - 1)
        assert all(threads == (1 if leave else 2) for leave, threads in recorded)
    finally:
        torch.set_num_threads(before)


def test_a_decode_step_leaves_a_core_only_where_that_was_faster(table: Path) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        decode = CpuShareManager(table, 2, choose_threads=True)
        assert decode.choice is not None
        for _ in range(FIRST_TRIES):
            decode.choice.record(1, False, 1.0)  # every core: slow
            decode.choice.record(1, True, 0.001)
        assert decode.run_step(True, torch.get_num_threads, seqs=1) == 1
        assert decode.budget(busy=True, seqs=1) == 1  # between layers: the step's choice holds
        prefill = CpuShareManager(table, 2, prefill=True)
        prefill.budget(busy=True)
        assert prefill.budget(busy=True) == 1  # and prefill sees decode busy, as ever
        assert decode.run_step(True, torch.get_num_threads, seqs=1) == 1  # no choice: halves
        prefill.idle()
        assert CpuShareManager(table, 2).choice is None  # prefill, the default: no choice
    finally:
        torch.set_num_threads(before)
