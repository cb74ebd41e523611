"""Cores busy per process in each phase of a run: while prefill works, and decode-only after.

A sampler thread reads every profiled process's CPU seconds (``/proc/<pid>/stat``, as
``stage_profile.cpu_snapshot``) every ``interval_s``; each interval is classed by what the
engines did in it: "prefill busy" when the prefill service used at least ``busy_cores`` of a
core, else "decode only" when the decode service did, else "idle/other". Per phase the summary
gives its wall seconds and each process's mean cores busy (CPU seconds / wall seconds), so an
all-at-once run shows whether prefill and decode fill the machine's cores or wait on each other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.serving import stage_profile

PHASES = ("prefill busy", "decode only", "idle/other")


def classify(cores: Mapping[str, float], busy_cores: float = 0.25) -> str:
    """The phase of one interval from the cores each process used in it."""
    if cores.get("prefill", 0.0) >= busy_cores:
        return PHASES[0]
    if cores.get("decode", 0.0) >= busy_cores:
        return PHASES[1]
    return PHASES[2]


def summarize(
    samples: Sequence[tuple[float, Mapping[str, float]]], busy_cores: float = 0.25
) -> dict[str, dict[str, Any]]:
    """Phase -> {"wall_s", "cores": {process: mean cores busy}} from (time, CPU seconds so far)
    snapshots in time order; phases with no interval are left out."""
    out: dict[str, dict[str, Any]] = {}
    for (t0, a), (t1, b) in zip(samples, samples[1:], strict=False):
        dt = t1 - t0
        if dt <= 0:
            continue
        used = {k: b[k] - a.get(k, 0.0) for k in b}
        phase = classify({k: v / dt for k, v in used.items()}, busy_cores)
        acc = out.setdefault(phase, {"wall_s": 0.0, "cpu_s": {}})
        acc["wall_s"] += dt
        for k, v in used.items():
            acc["cpu_s"][k] = acc["cpu_s"].get(k, 0.0) + v
    return {
        p: {"wall_s": out[p]["wall_s"],
            "cores": {k: v / out[p]["wall_s"] for k, v in out[p]["cpu_s"].items()}}
        for p in PHASES if p in out
    }  # fmt: skip


class PhaseSampler:
    """Samples the CPU of ``procs`` (name -> pids) on a thread between :meth:`start` and
    :meth:`stop`."""

    def __init__(self, procs: Mapping[str, list[int]], interval_s: float = 0.2) -> None:
        self.procs, self.interval_s = dict(procs), interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phase-cpu", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), stage_profile.cpu_snapshot(self.procs)))
            if self._stop.wait(self.interval_s):
                break
        # The tail after the last full interval, unless too short to class (a stray sample of
        # the broker's bookkeeping would otherwise show as a phase of its own).
        if time.monotonic() - self.samples[-1][0] >= self.interval_s / 2:
            self.samples.append((time.monotonic(), stage_profile.cpu_snapshot(self.procs)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return summarize(self.samples)


def format_phases(phases: Mapping[str, Mapping[str, Any]], cores: int) -> str:
    """One line per phase: its wall seconds and the busiest processes' cores."""
    lines = [f"cores busy per process by phase ({cores} cores; a sample every 0.2 s):"]
    for name, p in phases.items():
        top = sorted(p["cores"].items(), key=lambda kv: -kv[1])
        busy = sum(v for _, v in top)
        each = ", ".join(f"{k} {v:.2f}" for k, v in top if v >= 0.01)
        lines.append(f"  {name:<13}{p['wall_s']:>7.2f} s  total {busy:.2f}: {each}")
    return "\n".join(lines)


def plot_phases(ax: Any, phases: Mapping[str, Mapping[str, Any]], cores: int) -> None:
    """Stacked bars per phase: mean cores busy by process, the machine's cores as a red line."""
    names = list(phases)
    procs = list(dict.fromkeys(k for p in phases.values() for k in p["cores"]))
    bottom = [0.0] * len(names)
    for proc in procs:
        h = [phases[n]["cores"].get(proc, 0.0) for n in names]
        ax.bar(names, h, bottom=bottom, label=proc, width=0.5)
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    ax.axhline(cores, color="red", ls=":", lw=1.0)
    ticks = [f"{n}\n{phases[n]['wall_s']:.1f} s" for n in names]
    ax.set_xticks(range(len(names)), ticks)
    ax.set(title=f"cores busy per process by phase (red: {cores} cores)", ylabel="cores")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
