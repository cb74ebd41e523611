"""Engine CPU pinning and priority (services/shell/cpus.py): the list syntax, a real pinned child,
a niced child and a niced decode service."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from services.__main__ import _engine_cpus
from services.shell.cpus import (
    MAX_NICE,
    parse_cpu_list,
    pin_engine,
    split_engine_cpus,
    yield_cpu,
    yield_thread_cpu,
)
from shared.config import REPO_ROOT, BatonConfig


@pytest.mark.parametrize(
    ("spec", "cpus"),
    [("", set()), ("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), (" 1 , 3-4 ", {1, 3, 4}), ("2-2", {2})],
)
def test_cpu_lists(spec: str, cpus: set[int]) -> None:
    assert parse_cpu_list(spec) == cpus


@pytest.mark.parametrize("spec", ["a", "1-", "3-1", "-1", "0-x", "1.5"])
def test_malformed_cpu_lists_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(spec)


def test_unpinned_threads_are_half_the_cores_or_as_given() -> None:
    assert pin_engine("", 3) == 3
    assert pin_engine("", 0) == max(1, (os.cpu_count() or 2) // 2)


def test_a_cpu_this_process_may_not_use_is_refused() -> None:
    with pytest.raises(ValueError, match="not available"):
        pin_engine(str(max(os.sched_getaffinity(0)) + 1), 0)


def test_a_pinned_engine_runs_only_on_its_cpus_with_one_thread_each() -> None:
    """In a child (pinning is per process): affinity and torch's thread count both follow."""
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, torch; from services.shell.cpus import pin_engine;"
        f"torch.set_num_threads(pin_engine('{cpu}', 0));"
        "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=120).stdout  # fmt: skip
    assert out.split() == [f"[{cpu}]", "1"]


@pytest.mark.parametrize("nice", [-1, MAX_NICE + 1])
def test_an_engine_never_raises_its_priority_or_leaves_the_range(nice: int) -> None:
    with pytest.raises(ValueError, match="nice"):
        yield_cpu(nice)


def test_a_niced_engine_runs_at_lower_priority() -> None:
    code = (
        "import os; from services.shell.cpus import yield_cpu;"
        "before = os.nice(0); yield_cpu(0); same = os.nice(0); yield_cpu(7);"
        "print(same - before, os.nice(0) - before)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=120).stdout  # fmt: skip
    assert out.split() == ["0", str(min(7, MAX_NICE - os.nice(0)))]


def test_a_forward_thread_yields_alone_and_passes_it_on() -> None:
    """BATON_STEP_NICE: the step thread and the threads it starts (OpenMP's team, the C
    kernels') run niced; the process's other threads (its event loop) keep their priority."""
    code = (
        "import os, threading; from services.shell.cpus import yield_thread_cpu\n"
        "get = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
        "seen = {}\n"
        "def child(): seen['child'] = get()\n"
        "def step():\n"
        "    yield_thread_cpu(6); seen['step'] = get()\n"
        "    t = threading.Thread(target=child); t.start(); t.join()\n"
        "t = threading.Thread(target=step); t.start(); t.join()\n"
        "print(seen['step'] - get(), seen['child'] - get())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True, timeout=120).stdout  # fmt: skip
    want = str(min(6, MAX_NICE - os.nice(0)))
    assert out.split() == [want, want]
    with pytest.raises(ValueError, match="nice"):
        yield_thread_cpu(MAX_NICE + 1)


def test_a_decode_service_runs_at_its_configured_nice() -> None:
    """``python -m services decode`` applies BATON_DECODE_NICE before it serves (an unreachable
    broker keeps it retrying, alive, meanwhile)."""
    env = {
        **os.environ,
        "BATON_DECODE_NICE": "7",
        "BATON_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
    }
    own = os.nice(0)
    proc = subprocess.Popen([sys.executable, "-m", "services", "decode"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while os.getpriority(os.PRIO_PROCESS, proc.pid) != min(own + 7, MAX_NICE):
            assert proc.poll() is None, "decode exited before it was niced"
            assert time.monotonic() < deadline, "decode was never niced"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("available", "split"),
    [
        ({0, 1}, ("0", "1")),
        ({0, 1, 2}, ("0", "1,2")),  # decode gets the odd one
        ({0, 2, 4, 6}, ("0,2", "4,6")),
        ({3}, None),
    ],
)
def test_services_up_splits_the_cpus_between_the_engines(
    available: set[int], split: tuple[str, str] | None
) -> None:
    assert split_engine_cpus(frozenset(available)) == split
    if split is not None:  # lists the engines accept, disjoint, covering every CPU
        prefill, decode = (parse_cpu_list(x) for x in split)
        assert prefill and decode and not prefill & decode and prefill | decode == available


def test_a_given_cpu_list_even_empty_leaves_both_engines_as_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BATON_PREFILL_CPUS", raising=False)
    monkeypatch.delenv("BATON_DECODE_CPUS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    unshared = BatonConfig(cpu_share=False)  # sharing engines are never split
    assert _engine_cpus(unshared) == {"prefill": "0,1", "decode": "2,3"}
    assert _engine_cpus(BatonConfig(cpu_share=False, decode_cpus="3")) == {}
    monkeypatch.setenv("BATON_DECODE_CPUS", "")  # explicitly unpinned
    assert _engine_cpus(unshared) == {}
