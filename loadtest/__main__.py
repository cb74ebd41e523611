"""Baton's benchmarks and load tools behind one command line.

    python -m loadtest                        # the list below, one line each
    python -m loadtest bench --spawn          # a tool, with its own options
    python -m loadtest longctx --help

One explicit table, by purpose: ``loadtest/serving/`` (a running Baton, through the broker or
HTTP), ``loadtest/engine/`` (in process: steps, profiles, memory, parity), ``loadtest/faults/``
(chaos, fuzz, burst onset). Each name runs a module's ``main`` (``python -m loadtest.<package>.
<module>`` works too); ``overhead`` and ``mixed`` are ``bench`` with ``--fixed-overhead`` /
``--mixed`` put first. A description is the first paragraph of the module's docstring, cut to a
line, read without importing the module (the list costs no torch import). Model shapes come from
``shared/models/tiny/builder.py``'s PRESETS (``loadtest/models.py``); request workloads and latency
statistics from
``loadtest/serving/workload.py``.
"""

from __future__ import annotations

import ast
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
PROG = "python -m loadtest"
ABOUT_WIDTH = 96


@dataclass(frozen=True)
class Command:
    module: str  # under loadtest/
    first_args: tuple[str, ...] = ()
    about: str | None = None  # None: the module docstring's first line


COMMANDS: dict[str, Command] = {
    # loadtest/serving/: a spawned or running Baton, through the broker or over HTTP
    "bench": Command("serving.bench"),
    "overhead": Command(
        "serving.bench",
        ("--fixed-overhead",),
        "bench --fixed-overhead: 1-token requests on an idle Baton",
    ),
    "mixed": Command(
        "serving.bench",
        ("--mixed",),
        "bench --mixed: short requests beside a burst of long prompts",
    ),
    "serve-bench": Command("serving.serve_bench"),
    "gateway-overhead": Command("serving.gateway_overhead"),
    "exactly-once": Command("serving.exactly_once_bench"),
    "pd-advice": Command("serving.pd_advice"),
    "step-trace": Command("serving.step_trace"),
    "locust": Command("", about="how to run the Locust users (AMQP and HTTP), which run on gevent"),
    # loadtest/engine/: in process, no broker
    "step-profile": Command("engine.step_profile"),
    "longctx": Command("engine.longctx"),
    "layerwise": Command("engine.layerwise_bench"),
    "kv-dtype": Command("engine.kv_cache_dtype"),
    "handoff": Command("engine.handoff_bench"),
    "host-tier": Command("engine.host_tier_bench"),
    "resume-stall": Command("engine.resume_stall"),
    "engine-memory": Command("engine.engine_memory"),
    "quant-linear": Command("engine.quant_linear_bench"),
    "dense-tiles": Command("engine.dense_tiles_bench"),
    "decode-attention": Command("engine.decode_attention_bench"),
    "gguf-variants": Command("engine.gguf_variants"),
    "real-model-parity": Command("engine.real_model_parity"),
    "bf16-agreement": Command("engine.bf16_agreement"),
    "packed-decode-agreement": Command("engine.packed_decode_agreement"),
    "logprobs-cost": Command("engine.logprobs_cost"),
    # loadtest/faults/
    "chaos": Command("faults.chaos"),
    "burst-onset": Command("faults.burst_onset"),
    "fuzz": Command("faults.fuzz.__main__", about="Bad-input fuzz of a running Baton"),
}
# Runnable modules that are not tools: the bench's child processes, or run in another
# virtualenv (llamacpp_baseline: llama-cpp-python's).
INTERNAL = frozenset({"serving.vllm_baseline", "serving.llamacpp_baseline"})

LOCUST = """The Locust users run under Locust's own command (gevent), not this one:

    locust -f loadtest/serving/locustfile.py --headless -u 8 -r 2 -t 60s --csv results/locust
    locust -f loadtest/serving/locust_http.py --headless -u 8 -t 60s --host http://127.0.0.1:8000
    locust -f loadtest/serving/locustfile.py,loadtest/serving/locust_http.py ...   # both

Workload: BATON_LOCUST_INPUT_LEN / _OUTPUT_LEN / _PRIORITIES (loadtest/serving/locustfile.py)."""


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None


def runnable(tree: ast.Module) -> bool:
    has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    guard = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    return has_main and guard


def commands() -> dict[str, Command]:
    """The table (explicit: a new tool gets a line here; tests check that every runnable module
    of loadtest/ has one, or is INTERNAL)."""
    return dict(COMMANDS)


def about(command: Command) -> str:
    if command.about is not None:
        return command.about
    path = HERE / (command.module.replace(".", "/") + ".py")
    tree = _parse(path)
    doc = ast.get_docstring(tree) if tree else None
    if not doc:
        return f"loadtest/{path.name}"
    first = " ".join(doc.split("\n\n")[0].split())  # the first paragraph, on one line
    if len(first) > ABOUT_WIDTH:
        first = first[: ABOUT_WIDTH - 3].rsplit(" ", 1)[0] + "..."
    return first


def listing() -> str:
    table = commands()
    width = max(map(len, table)) + 2
    lines = [f"usage: {PROG} <name> [args]    ({PROG} <name> --help: its options)", ""]
    lines += [f"  {name:<{width}}{about(c)}" for name, c in table.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    command = commands().get(name)
    if command is None:
        print(f"{PROG}: no tool named {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    if name == "locust":
        print(LOCUST)
        return 0
    from kernels.cpu import cpu_isa

    cpu_isa.apply(cpu_isa.current())  # BATON_CPU_ISA, before the tool loads torch
    module = importlib.import_module(f"loadtest.{command.module}")
    sys.argv = [f"{PROG} {name}", *command.first_args, *rest]  # argparse's prog and options
    code = module.main()
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
