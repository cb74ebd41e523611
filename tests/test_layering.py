"""The layering as a test: no module imports from a package on a floor above its own.

Floors, lowest first. A unit (``shared.<pkg>``, ``services.<pkg>``, or a top-level package) may
import itself and anything on a lower floor, never a peer on its own floor nor anything above.
Run it alone to see the whole map: ``python -m pytest tests/test_layering.py -q``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("shared", "services", "kernels", "loadtest", "deploy")

FLOORS: list[set[str]] = [
    {"shared.config_flags"},  # the config's command-line flags, built from its source
    {"shared.config"},
    # The wire contract and leaf utilities: they know nothing of engines or services.
    {"shared.wire", "kernels.cpu", "shared.observability", "shared.models", "kernels"},
    {"shared.limits"},  # the length and stop rules, applied by tokenizer, schedulers and engines
    {"shared.kv_transfer", "shared.client"},
    {"shared.runtime"},  # model execution: runner, attention, block manager, sampler
    {"shared.scheduling"},  # in-engine batch scheduling: waiting queues, budgets, preemption
    {"shared.engine"},  # the engine core both engine services drive
    {"shared.flow_control"},  # admission, prefetch windows, intake pause: between the services
    {"services.shell"},
    {"services.tokenizer", "services.prefill", "services.decode", "services.detokenizer"},
    # The optional HTTP front: its /tokenize is the tokenizer service's own PromptEncoder.
    {"services.gateway"},
    {"services.launcher", "services.__main__"},
    {"loadtest"},
    {"services.cli"},  # `baton serve` (services.__main__) and `baton bench` (loadtest)
    {"deploy"},  # make compose-check: drives the whole stack from outside, as a user would
]
FLOOR_OF = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("shared", "services") and len(parts) > 1:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute first-party import, wherever it sits in the file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in FIRST_PARTY]
    return found


def source_files() -> list[Path]:
    """Every first-party module but the (empty) roots of the two namespaces."""
    roots = {ROOT / "shared" / "__init__.py", ROOT / "services" / "__init__.py"}
    return sorted(p for top in FIRST_PARTY for p in (ROOT / top).rglob("*.py") if p not in roots)


def violations() -> list[str]:
    out = []
    for path in source_files():
        src = unit_of(module_name(path))
        for line, target in imports_of(path):
            dst = unit_of(target)
            if dst == src:
                continue
            if FLOOR_OF.get(dst, len(FLOORS)) >= FLOOR_OF[src]:
                where = f"{path.relative_to(ROOT)}:{line}"
                out.append(
                    f"{where}: {src} (floor {FLOOR_OF[src]}) imports {target} "
                    f"(floor {FLOOR_OF[dst]})"
                )
    return out


def test_every_unit_has_a_floor() -> None:
    units = {unit_of(module_name(p)) for p in source_files()}
    assert units - FLOOR_OF.keys() == set(), "place the new package in FLOORS"


def test_no_import_runs_up_or_sideways() -> None:
    assert violations() == []


def import_graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (``from pkg import submodule`` names the
    submodule, not the package)."""
    files = {module_name(p): p for p in source_files()}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [n for n in subs if n in files] or [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            graph[module] |= {n for n in names if n in files and n != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles() -> None:
    """Modules import each other in no circle, lazy imports included (a circle is what made
    the attention modules import each other inside functions)."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The walker finds imports inside functions too (a lazy import is still a dependency)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from shared.engine.engine import EngineCore\n")
    assert imports_of(probe) == [(2, "shared.engine.engine")]
    assert FLOOR_OF[unit_of("shared.engine.engine")] > FLOOR_OF[unit_of("shared.runtime.model")]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
