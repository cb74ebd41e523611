"""Baton's benchmarks and load tools behind one command line.

    python -m loadtest                        # the list below, one line each
    python -m loadtest bench --spawn          # a tool, with its own options
    python -m loadtest longctx --help

Each name runs a module's ``main`` (``python -m loadtest.<module>`` still works); ``overhead`` and
``mixed`` are ``bench`` with ``--fixed-overhead`` / ``--mixed`` put first. A description is the
first paragraph of the module's docstring, cut to a line, read without importing the module (the
list costs no torch import). A module of ``loadtest/`` with a ``main`` and a ``__main__`` guard that
the table does not name is listed under its own name, ``_`` as ``-`` (a new bench needs no entry
here). Model shapes come from ``shared/models/tiny/builder.py``'s PRESETS (``loadtest/models.py``);
request workloads and latency statistics from ``loadtest/workload.py``.
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
    # Serving benchmarks (a spawned or running Baton)
    "bench": Command("bench"),
    "overhead": Command(
        "bench", ("--fixed-overhead",), "bench --fixed-overhead: 1-token requests on an idle Baton"
    ),
    "mixed": Command(
        "bench", ("--mixed",), "bench --mixed: short requests beside a burst of long prompts"
    ),
    "gateway-overhead": Command("gateway_overhead"),
    "exactly-once": Command("exactly_once_bench"),
    "serve-bench": Command("serve_bench"),
    # Engine and transport benchmarks (in process, no broker)
    "longctx": Command("longctx"),
    "layerwise": Command("layerwise_bench"),
    "kv-dtype": Command("kv_cache_dtype"),
    "handoff": Command("handoff_bench"),
    "host-tier": Command("host_tier_bench"),
    # Faults, advice, load generators
    "chaos": Command("chaos"),
    "fuzz": Command("fuzz.__main__", about="Bad-input fuzz of a running Baton (loadtest/fuzz/)"),
    "pd-advice": Command("pd_advice"),
    "locust": Command("", about="how to run the Locust users (AMQP and HTTP), which run on gevent"),
}
# Runnable modules that are not tools: child processes of ``bench``.
# Run by the bench, or in another virtualenv (llamacpp_baseline: llama-cpp-python's).
INTERNAL = frozenset({"baselines", "vllm_baseline", "llamacpp_baseline"})

LOCUST = """The Locust users run under Locust's own command (gevent), not this one:

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --csv loadtest/results/locust
    locust -f loadtest/locust_http.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000
    locust -f loadtest/locustfile.py,loadtest/locust_http.py ...   # both, side by side

Workload: BATON_LOCUST_INPUT_LEN / _OUTPUT_LEN / _PRIORITIES (see loadtest/locustfile.py)."""


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None


def _runnable(tree: ast.Module) -> bool:
    has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    guard = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    return has_main and guard


def commands() -> dict[str, Command]:
    """The table, plus every runnable module it does not name."""
    out = dict(COMMANDS)
    named = {c.module for c in COMMANDS.values()} | INTERNAL
    for path in sorted(HERE.glob("*.py")):
        tree = _parse(path)
        if path.stem not in named and not path.stem.startswith("_") and tree and _runnable(tree):
            out[path.stem.replace("_", "-")] = Command(path.stem)
    return out


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
    from shared.native import cpu_isa

    cpu_isa.apply(cpu_isa.current())  # BATON_CPU_ISA, before the tool loads torch
    module = importlib.import_module(f"loadtest.{command.module}")
    sys.argv = [f"{PROG} {name}", *command.first_args, *rest]  # argparse's prog and options
    code = module.main()
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
