"""Every third-party import is declared in pyproject.toml, for where the code runs.

A fresh clone installs exactly what pyproject.toml declares (scripts/setup.sh: the project with
its ``test`` and ``loadtest`` extras; the image: the project with ``loadtest``), so a module that
is importable here only because something else put it on this machine breaks the next machine:
``hypothesis`` did, at collection, on a new virtualenv. Each folder is checked against what is
installed wherever it runs:

- ``services/``, ``shared/``, ``kernels/``: the dependencies alone (the services' image);
- ``loadtest/``: those and the ``loadtest`` extra (Locust in the image, the benchmarks);
- ``tests/``, ``scripts/``, ``deploy/``: every extra (``make test``, ``make compose-check``).

A module counts as declared when a distribution that provides it (``packages_distributions``) is
declared there or is a dependency, at any depth, of one that is (``requires``, markers and
extras evaluated here). Imports inside ``try: ... except ImportError`` and ``pytest.importorskip``
are optional by construction and left out; :data:`ELSEWHERE` lists the modules imported by code
that runs in another interpreter.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="stdlib from Python 3.11")

REPO = Path(__file__).resolve().parent.parent
OWN = {"services", "shared", "kernels", "loadtest", "tests", "deploy"}
# folder -> the extras installed wherever its code runs (beside the dependencies)
SCOPES = {
    "services": (),
    "shared": (),
    "kernels": (),
    "loadtest": ("loadtest",),
    "tests": ("test", "loadtest"),
    "scripts": ("test", "loadtest"),
    "deploy": ("test", "loadtest"),
}
# Imported by code that runs in another interpreter, never in Baton's environment.
ELSEWHERE = {
    "vllm": "loadtest/serving/vllm_baseline.py runs in vLLM's own virtualenv",
    "llama_cpp": "loadtest/serving/llamacpp_baseline.py runs in a virtualenv with llama-cpp-python",
}
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in IMPORT_ERRORS for k in kinds)


def _required_imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(top-level module, line) of every absolute import that is not guarded."""

    def walk(node: ast.AST, guarded: bool) -> Iterator[tuple[str, int]]:
        if isinstance(node, ast.Try) and any(map(_catches_import_error, node.handlers)):
            for child in node.body:
                yield from walk(child, True)
            for part in (node.handlers, node.orelse, node.finalbody):
                for child in part:
                    yield from walk(child, guarded)
            return
        if not guarded:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name.split(".")[0], node.lineno
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module.split(".")[0], node.lineno
        for child in ast.iter_child_nodes(node):
            yield from walk(child, guarded)

    yield from walk(tree, False)


def third_party_imports() -> dict[str, dict[str, list[str]]]:
    """folder -> module -> the places that import it."""
    found: dict[str, dict[str, list[str]]] = {}
    for folder in SCOPES:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for module, line in _required_imports(tree):
                if module in OWN or module in sys.stdlib_module_names or module == "__future__":
                    continue
                where = f"{path.relative_to(REPO)}:{line}"
                found.setdefault(folder, {}).setdefault(module, []).append(where)
    return found


@cache
def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _applies(req: Requirement, extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in extras or {""})


@cache
def provided_by(extras: tuple[str, ...]) -> frozenset[str]:
    """Normalized names of the declared distributions (with these extras) and, where installed,
    of everything they require, at any depth."""
    project = _pyproject()
    top = list(project["dependencies"])
    for extra in extras:
        top += project["optional-dependencies"][extra]
    todo = [(Requirement(r), frozenset()) for r in top]
    seen: set[tuple[str, frozenset[str]]] = set()
    names: set[str] = set()
    while todo:
        req, wanted_by = todo.pop()
        if not _applies(req, wanted_by):
            continue
        key = (_normalize(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue  # not installed: whatever it would import is reported as missing below
        todo += [(Requirement(r), key[1]) for r in requires]
    return frozenset(names)


def test_scan_finds_the_known_imports() -> None:
    """The scan itself: it sees plain and from-imports, skips guarded ones and the project."""
    found = third_party_imports()
    assert {"torch", "aio_pika", "msgpack"} <= set(found["shared"])
    assert {"locust", "pika"} <= set(found["loadtest"])
    assert "hypothesis" in found["tests"]
    assert "mooncake" not in found["shared"], "imported under try/except ImportError"
    guarded = ast.parse("try:\n    import a\nexcept (OSError, ImportError):\n    import b\n")
    assert [m for m, _ in _required_imports(guarded)] == ["b"]
    for module in ELSEWHERE:
        assert any(module in mods for mods in found.values()), f"stale ELSEWHERE entry {module}"


@pytest.mark.parametrize("folder", SCOPES)
def test_every_import_is_declared(folder: str) -> None:
    extras = SCOPES[folder]
    declared = provided_by(extras)
    distributions = md.packages_distributions()
    missing = []
    for module, places in sorted(third_party_imports().get(folder, {}).items()):
        if module in ELSEWHERE:
            continue
        dists = {_normalize(d) for d in distributions.get(module, [])}
        if not dists:
            missing.append(f"{module} (not installed) at {', '.join(places[:3])}")
        elif not dists & declared:
            missing.append(f"{module} (from {', '.join(sorted(dists))}) at {', '.join(places[:3])}")
    scope = "the dependencies" + "".join(f" + [{e}]" for e in extras)
    assert not missing, f"{folder}/ imports what {scope} of pyproject.toml do not provide:\n" + (
        "\n".join(missing)
    )
