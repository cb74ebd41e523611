"""Where a benchmark run's wall time goes: CPU seconds per process, time per pipeline stage,
broker messages and bytes per request. Used by ``loadtest/serving/bench.py`` around each measured
run.

Sources, each read before and after the run (the figures are the differences):
- CPU: ``utime + stime`` from ``/proc/<pid>/stat`` of every service (children of
  ``services up``, named by their ``-m services NAME`` command line), the supervisor, RabbitMQ's
  ``beam.smp`` (shared with anything else on the broker), the bench itself and py-spy.
- Stages: each service's Prometheus ``/metrics`` (histogram ``_sum``/``_count``): forwards,
  handoff writes/reads (wall time in the stage), queue wait, TTFT, E2E (per-request latencies).
  Stages no metric covers (tokenize, detokenize, publishes, AMQP framing, wire encode/decode,
  the event loop) are the owning process's CPU seconds split by the share of its py-spy samples
  (:data:`PYSPY_RULES`) when py-spy is installed, else marked "not instrumented". Sampling
  happens inside the forward and is not separated from it.
- Broker: the RabbitMQ management API (``rabbitmq-plugins enable rabbitmq_management``) for the
  run's vhost: messages published/delivered, bytes received/sent. Its statistics lag up to 5 s,
  so they are read after a settle wait.

(Named ``stage_profile`` rather than ``profile``: a script run from loadtest/, such as the
locustfile, would otherwise shadow the standard library's ``profile`` module.)
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# --- per-process CPU ---------------------------------------------------------------------------


def parse_proc_stat(text: str) -> tuple[str, int, float]:
    """(comm, ppid, utime + stime in seconds) from one ``/proc/<pid>/stat`` line.

    ``comm`` sits in parentheses and may itself hold spaces or ')', so split at the last ')'."""
    left, right = text.index("("), text.rindex(")")
    fields = text[right + 2 :].split()  # fields[0] is field 3 (state)
    return text[left + 1 : right], int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def _stat(pid: int) -> tuple[str, int, float] | None:
    try:
        return parse_proc_stat(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def service_name(cmdline: list[str]) -> str | None:
    """``NAME`` of a ``python -m services NAME ...`` command line."""
    for i, arg in enumerate(cmdline[:-2]):
        if arg == "-m" and cmdline[i + 1] == "services":
            return cmdline[i + 2]
    return None


def find_processes(up_pid: int | None, extra: Mapping[str, int] = {}) -> dict[str, list[int]]:
    """Process name -> pids: the services under ``up_pid`` (and it, as "supervisor"), RabbitMQ
    ("rabbitmq (beam.smp)"), the bench ("bench client") and ``extra``."""
    out: dict[str, list[int]] = {"bench client": [os.getpid()]}
    if up_pid is not None:
        out["supervisor (services up)"] = [up_pid]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        st = _stat(pid)
        if st is None:
            continue
        comm, ppid, _ = st
        if comm == "beam.smp":
            out.setdefault("rabbitmq (beam.smp)", []).append(pid)
        elif up_pid is not None and ppid == up_pid:
            name = service_name(_cmdline(pid)) or f"child {pid}"
            out.setdefault(name, []).append(pid)
    for name, pid in extra.items():
        out.setdefault(name, []).append(pid)
    return out


def cpu_snapshot(procs: Mapping[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each named group of pids (a process that is gone counts 0)."""
    return {n: sum((st[2] if (st := _stat(p)) else 0.0) for p in pids) for n, pids in procs.items()}


def diff(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# --- Prometheus metrics -----------------------------------------------------------------------


def parse_metrics(text: str) -> Samples:
    """Prometheus text format -> {(sample name, labels): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def metric(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every label set that contains ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def hist_delta(before: Samples, after: Samples, name: str, **labels: str) -> tuple[float, float]:
    """(sum, count) a histogram gained between two scrapes."""
    return tuple(  # type: ignore[return-value]
        metric(after, name + sfx, **labels) - metric(before, name + sfx, **labels)
        for sfx in ("_sum", "_count")
    )


def scrape(port: int, timeout_s: float = 5.0) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
        return parse_metrics(r.read().decode())


# --- py-spy ------------------------------------------------------------------------------------

# First match wins, tested against every frame of a sample ("function (path:line)"), or only the
# innermost one for a "leaf:" pattern. A Python-level leaf of ``Runner.run`` is the event loop's
# own C code (uvloop: socket I/O, callback dispatch).
PYSPY_RULES: tuple[tuple[str, str], ...] = (
    ("tokenize", r"/services/tokenizer/core\.py|/tokenizers/|/transformers/tokenization"),
    ("detokenize", r"/services/detokenizer/(core|incremental)\.py"),
    ("publish", r"^\S*publish\S* \("),
    ("wire", r"/shared/wire/|msgpack"),
    ("amqp", r"/(aiormq|aio_pika|pamqp)/"),
    ("engine", r"/shared/(engine|runtime|models|kv_transfer)/|/torch/"),
    ("event loop", r"leaf:^Runner\.run \("),
    ("thread pool", r"leaf:^_worker \(.*/concurrent/futures/thread\.py"),
)


def classify_collapsed(
    text: str, rules: Iterable[tuple[str, str]] = PYSPY_RULES
) -> tuple[dict[str, int], dict[str, int]]:
    """Samples per category from py-spy's ``--format raw`` (collapsed stacks, "a;b;c N"), and
    the innermost frames of the samples no rule claimed ("other")."""
    compiled = [
        (c, rx.startswith("leaf:"), re.compile(rx.removeprefix("leaf:"))) for c, rx in rules
    ]
    out: dict[str, int] = {}
    other: dict[str, int] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        cat = next(
            (c for c, leaf, rx in compiled if any(rx.search(f) for f in frames[-1:] if leaf)
             or not leaf and any(rx.search(f) for f in frames)),
            "other",
        )  # fmt: skip
        out[cat] = out.get(cat, 0) + int(count)
        if cat == "other":
            other[frames[-1]] = other.get(frames[-1], 0) + int(count)
    return out, other


class PySpy:
    """``py-spy record`` on each service for the length of a run (SIGINT makes it write)."""

    RATE = 25  # samples/s: py-spy's own CPU stays a few % of a 2-core machine

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.exe = shutil.which("py-spy")
        self.pids = dict(pids)
        self.dir = Path(tempfile.mkdtemp(prefix="baton-pyspy-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        for name, pid in self.pids.items():
            cmd = [str(self.exe), "record", "--pid", str(pid), "--rate", str(self.RATE),
                   "--nonblocking", "--full-filenames", "--format", "raw",
                   "--output", str(self.dir / f"{name}.txt")]  # fmt: skip
            self.procs[name] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )

    def pids_of(self) -> list[int]:
        """py-spy's own pids (its CPU is part of the run's too)."""
        return [p.pid for p in self.procs.values()]

    def stop(self) -> dict[str, dict[str, Any]]:
        """Per service: samples per category and the most frequent unclaimed frames.

        A sample is taken whenever the thread is not sleeping, which on a busy machine includes
        waiting for a core: use the categories' shares, not samples / rate, as time."""
        for p in self.procs.values():
            p.send_signal(signal.SIGINT)
        out: dict[str, dict[str, Any]] = {}
        for name, p in self.procs.items():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
            path = self.dir / f"{name}.txt"
            if path.exists():
                counts, other = classify_collapsed(path.read_text())
                top = sorted(other.items(), key=lambda kv: -kv[1])[:5]
                out[name] = {"samples": counts, "top_other": top}
        shutil.rmtree(self.dir, ignore_errors=True)
        return out


# --- RabbitMQ management API ------------------------------------------------------------------


def broker_stats(amqp_url: str, api_port: int = 15672, timeout_s: float = 5.0) -> dict[str, Any]:
    """Counters of the URL's vhost: published, delivered, bytes in/out, per-queue publishes.

    Raises OSError (or ValueError) when the management API does not answer."""
    parts = urllib.parse.urlsplit(amqp_url)
    vhost = urllib.parse.unquote(parts.path[1:]) or "/"
    user, password = parts.username or "guest", parts.password or "guest"
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    base = f"http://{parts.hostname or '127.0.0.1'}:{api_port}/api"
    quoted = urllib.parse.quote(vhost, safe="")

    def get(path: str) -> Any:
        req = urllib.request.Request(base + path, headers={"Authorization": "Basic " + token})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    vh = get(f"/vhosts/{quoted}")
    ms = vh.get("message_stats") or {}
    queues: dict[str, float] = {}
    for q in get(f"/queues/{quoted}?columns=name,message_stats.publish"):
        key = queue_group(q["name"])
        queues[key] = queues.get(key, 0.0) + (q.get("message_stats") or {}).get("publish", 0)
    return {
        "vhost": vhost,
        "published": float(ms.get("publish", 0)),
        "delivered": float(ms.get("deliver_get", 0)),
        "bytes_in": float(vh.get("recv_oct") or 0),
        "bytes_out": float(vh.get("send_oct") or 0),
        "queues": queues,
    }


def queue_group(name: str) -> str:
    """Per-client and server-named queues as one row each (``baton.reply.<hex>`` -> ``.*``)."""
    name = re.sub(r"\.[0-9a-f]{16,}$", ".*", name)
    return re.sub(r"^amq[._].*", "amq.* (server-named)", name)


def broker_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: after[k] - before[k] for k in after if k not in ("vhost", "queues")}
    qb = before["queues"]
    out["queues"] = {q: n - qb.get(q, 0.0) for q, n in after["queues"].items()}
    out["vhost"] = after["vhost"]
    return out


# --- the stage table ----------------------------------------------------------------------------

NOT_INSTRUMENTED = "not instrumented"
SERVICES = ("tokenizer", "prefill", "decode", "detokenizer")
# (stage, services, how, what), in pipeline order. how: "metric" (histogram seconds a process
# spent on it), "latency" (per-request wall time, overlapping across requests: shown as a mean,
# never stacked), "py-spy" (on-CPU samples of a PYSPY_RULES category), "none".
STAGES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("tokenize", ("tokenizer",), "py-spy", "tokenize"),
    ("queue wait (arrival->prefill)", ("detokenizer",), "latency", "request_queue_time_seconds"),
    ("prefill forward (+sampling)", ("prefill",), "metric", "forward_seconds"),
    ("handoff write", ("prefill",), "metric", "handoff_seconds"),
    ("handoff read", ("decode",), "metric", "handoff_seconds"),
    ("decode forward (+sampling)", ("decode",), "metric", "forward_seconds"),
    ("sampling", ("prefill", "decode"), "none", "inside the forward"),
    ("event publish", ("tokenizer", "prefill", "decode"), "py-spy", "publish"),
    ("detokenize", ("detokenizer",), "py-spy", "detokenize"),
    ("reply publish", ("detokenizer",), "py-spy", "publish"),
    ("AMQP receive/framing", SERVICES, "py-spy", "amqp"),
    ("wire encode/decode", SERVICES, "py-spy", "wire"),
    ("event loop (uvloop, I/O)", SERVICES, "py-spy", "event loop"),
    ("unattributed", SERVICES, "py-spy", "other"),
    ("TTFT (server view)", ("detokenizer",), "latency", "pipeline_time_to_first_token_seconds"),
    ("E2E (server view)", ("detokenizer",), "latency", "pipeline_e2e_request_latency_seconds"),
)


def pyspy_share(
    pyspy: Mapping[str, Any], cpu_s: Mapping[str, float], service: str, cat: str
) -> float:
    """CPU seconds of ``service`` attributed to py-spy category ``cat`` (its share of samples)."""
    samples = (pyspy.get(service) or {}).get("samples") or {}
    total = sum(samples.values())
    return cpu_s.get(service, 0.0) * samples.get(cat, 0) / total if total else 0.0


def build_stages(
    scrapes: Mapping[str, tuple[Samples, Samples]],
    pyspy: Mapping[str, Any] | None,
    cpu_s: Mapping[str, float],
) -> list[dict[str, Any]]:
    """One row per stage: seconds (None: not measured), count, kind, process, source."""
    rows: list[dict[str, Any]] = []
    for stage, services, how, what in STAGES:
        row: dict[str, Any] = {"stage": stage, "process": ", ".join(services), "count": None,
                               "kind": "latency" if how == "latency" else "busy"}  # fmt: skip
        if how in ("metric", "latency") and services[0] in scrapes:
            total, count = hist_delta(*scrapes[services[0]], "baton:" + what)
            row.update(seconds=total, count=count, source="baton:" + what)
        elif how == "py-spy" and pyspy:
            secs = sum(pyspy_share(pyspy, cpu_s, s, what) for s in services)
            row.update(seconds=secs, source=f"CPU x py-spy share ({what}), estimate")
        else:
            why = {"none": f"{what}: {NOT_INSTRUMENTED}", "py-spy": f"{NOT_INSTRUMENTED} "
                   "(py-spy off)"}.get(how, f"baton:{what}: no scrape")  # fmt: skip
            row.update(seconds=None, source=why)
        rows.append(row)
    return rows


def format_profile(p: Mapping[str, Any]) -> str:
    """The profile as a text table (CPU per process, stages, broker traffic)."""
    n, wall, cores = p["num_requests"], p["wall_s"], p["cores"]
    width = 92
    lines = [f" Profile: {p['label']} ".center(width, "=")]
    lines.append(f"wall {wall:.2f} s, {n} requests, {cores} cores = {cores * wall:.2f} core-s")
    lines.append(f"{'process':<32}{'CPU s':>10}{'% of core-s':>13}{'ms/request':>12}")
    total = 0.0
    for name, secs in sorted(p["cpu_s"].items(), key=lambda kv: -kv[1]):
        total += secs
        lines.append(f"{name:<32}{secs:>10.2f}{100 * secs / (cores * wall):>12.1f}%"
                     f"{1000 * secs / n:>12.2f}")  # fmt: skip
    lines.append(f"{'total':<32}{total:>10.2f}{100 * total / (cores * wall):>12.1f}%"
                 f"{1000 * total / n:>12.2f}")  # fmt: skip
    idle = cores * wall - total
    lines.append(
        f"{'idle or other processes':<32}{idle:>10.2f}{100 * idle / (cores * wall):>12.1f}%"
    )
    lines.append("-" * width)
    lines.append(f"{'stage':<34}{'process':<16}{'seconds':>9}{'ms/request':>12}  source")
    for r in p["stages"]:
        if r["seconds"] is None:
            secs = per = "-"
        elif r["kind"] == "latency":  # a per-request mean, not a share of the run
            secs, per = "(latency)", f"{1000 * r['seconds'] / max(r['count'] or 0, 1):.2f}"
        else:
            secs, per = f"{r['seconds']:.3f}", f"{1000 * r['seconds'] / n:.2f}"
        proc = r["process"] if len(r["process"]) <= 15 else r["process"][:14] + "~"
        lines.append(f"{r['stage']:<34}{proc:<16}{secs:>9}{per:>12}  {r['source']}")
    lines.append("-" * width)
    b = p.get("broker") or {}
    if "skipped" in b or not b:
        lines.append(f"broker traffic: not measured ({b.get('skipped', 'no broker stats')})")
    else:
        lines.append(f"broker (vhost {b['vhost']}), per request: "
                     f"{b['published'] / n:.1f} messages published, "
                     f"{b['delivered'] / n:.1f} delivered, {b['bytes_in'] / n / 1024:.1f} KiB in, "
                     f"{b['bytes_out'] / n / 1024:.1f} KiB out")  # fmt: skip
        queues = ", ".join(f"{q} {v / n:.2f}" for q, v in sorted(b["queues"].items()) if v)
        rest = b["published"] - sum(b["queues"].values())
        lines.append(f"  published per request by queue: {queues or '-'}, other {rest / n:.2f} "
                     "(reply queues, gone with the client; fanouts count once)")  # fmt: skip
    lines.append("=" * width)
    return "\n".join(lines)


def plot_profile(
    path: Path, profiles: list[Mapping[str, Any]], extra: Callable[[Any], None] | None = None
) -> None:
    """Stacked bars per run: CPU seconds by process (left), busy seconds by stage; ``extra``
    draws a third panel (the bench's cores per phase) on the axis it is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if extra else 2, figsize=(21 if extra else 14, 5))
    if extra:
        extra(axes[2])
    labels = [p["label"] for p in profiles]
    xs = list(range(len(profiles)))
    parts: list[tuple[Any, list[dict[str, float]], str]] = [
        (axes[0], [dict(p["cpu_s"]) for p in profiles], "CPU seconds by process"),
        (axes[1], [{r["stage"]: r["seconds"] for r in p["stages"]
                    if r["kind"] == "busy" and r["seconds"]} for p in profiles],
         "by stage: metrics = wall in stage, py-spy = CPU"),
    ]  # fmt: skip
    for ax, values, title in parts:
        keys = list(dict.fromkeys(k for v in values for k in v))
        bottom = [0.0] * len(profiles)
        for k in keys:
            h = [v.get(k, 0.0) for v in values]
            ax.bar(xs, h, bottom=bottom, label=k, width=0.5)
            bottom = [b + x for b, x in zip(bottom, h, strict=True)]
        for x, p in zip(xs, profiles, strict=True):
            ref = p["cores"] * p["wall_s"] if ax is axes[0] else p["wall_s"]
            ax.hlines(ref, x - 0.3, x + 0.3, colors="red", linestyles=":")
        ax.set(title=title + (" (red: cores x wall)" if ax is axes[0] else " (red: wall)"),
               ylabel="seconds")  # fmt: skip
        ax.set_xticks(xs, labels)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Baton benchmark: where the wall time goes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- one measured run ---------------------------------------------------------------------------


class RunProfiler:
    """Snapshots around one measured run of a spawned Baton: :meth:`begin` right before the
    load, :meth:`end` right after it."""

    def __init__(
        self,
        amqp_url: str,
        up_pid: int | None,
        metrics_ports: Mapping[str, int],
        *,
        use_pyspy: bool = True,
        broker_api_port: int = 15672,
        broker_wait_s: float = 5.5,
    ) -> None:
        self.url, self.ports = amqp_url, dict(metrics_ports)
        self.procs = find_processes(up_pid)
        self.broker_api_port, self.broker_wait_s = broker_api_port, broker_wait_s
        self.pyspy_note = None if shutil.which("py-spy") else "py-spy not installed"
        if not use_pyspy:
            self.pyspy_note = "py-spy off (--no-py-spy)"
        self._spy: PySpy | None = None
        self._before: dict[str, Any] = {}

    def _broker(self) -> dict[str, Any]:
        try:
            return broker_stats(self.url, self.broker_api_port)
        except (OSError, ValueError, KeyError) as exc:
            return {"skipped": f"RabbitMQ management API: {exc} (rabbitmq-plugins enable "
                    "rabbitmq_management)"}  # fmt: skip

    def _scrape(self) -> dict[str, Samples]:
        out = {}
        for name, port in self.ports.items():
            try:
                out[name] = scrape(port)
            except OSError:
                pass
        return out

    def begin(self) -> None:
        time.sleep(self.broker_wait_s)  # the broker's statistics catch up with the warm-up
        self._before = {"broker": self._broker(), "metrics": self._scrape()}
        self._before["cpu"] = cpu_snapshot(self.procs)
        if self.pyspy_note is None:
            self._spy = PySpy({n: p[0] for n, p in self.procs.items() if n in SERVICES})
            self._spy.start()
            time.sleep(0.5)  # py-spy attaches

    def end(self, label: str, num_requests: int, wall_s: float) -> dict[str, Any]:
        cpu = diff(self._before["cpu"], cpu_snapshot(self.procs))
        pyspy = None
        if self._spy is not None:
            cpu["py-spy (profiler)"] = sum(cpu_snapshot({"": list(self._spy.pids_of())}).values())
            pyspy = self._spy.stop()
        metrics = self._scrape()
        scrapes = {n: (self._before["metrics"][n], m) for n, m in metrics.items()
                   if n in self._before["metrics"]}  # fmt: skip
        time.sleep(self.broker_wait_s)
        broker = self._broker()
        if "skipped" not in broker and "skipped" not in self._before["broker"]:
            broker = broker_delta(self._before["broker"], broker)
        return {
            "label": label, "num_requests": num_requests, "wall_s": wall_s,
            "cores": os.cpu_count() or 1, "cpu_s": cpu, "stages": build_stages(scrapes, pyspy, cpu),
            "broker": broker, "pyspy": pyspy if pyspy is not None else {"skipped": self.pyspy_note},
        }  # fmt: skip
