"""Every repository path the docs and the code's comments cite exists, and no machine path does.

A cited path is a token with a slash whose first part names something in the repository: a
top-level entry anywhere (``shared/config.py``, ``docs/engine.md``), any folder of it inside
backticks, a markdown link or a comment (``csrc/rope.c`` beside ``shared/runtime/``). It must
exist relative to the repository root or to the citing file's folder or one above it (a comment in
``shared/config.py`` may say ``kv_transfer/layerwise.py``); a ``#anchor`` on a markdown file must
name one of its headings, and a section cited by its title after the file (``docs/engine.md,
"CPUs"``) must be in one of them. Placeholders (``<name>``, ``$VAR``, ``{x}``) are skipped,
globs must match. Code is read in its comments and docstrings only; markdown whole.

A machine path (``/tmp/…``, ``/work/…``, ``/root/…``, ``/home/…``) names one machine's files: it
must not appear in the docs or in product code, where a default belongs in ``BATON_CACHE_DIR``,
the working directory or a flag. ``/dev/shm`` and ``/proc`` are system interfaces, not machine
paths, and are not matched.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "models", "out", "build", ".gl", ".notes"}
SKIP_DIRS |= {".pytest_cache", ".mypy_cache", ".ruff_cache"}
# Outputs the code writes (ignored by git, so absent from a clone): a citation of one is fine.
GENERATED = ("models/", "loadtest/results/", "deploy/local/", "out/", "build/")
CODE_SUFFIXES = {".py", ".c", ".h", ".sh", ".yaml", ".toml", ".conf", ".cfg"}
HASH_COMMENTED = {"Makefile", "Dockerfile", "run"}  # no suffix (.ci/run is a shell script)
# Where machine paths are refused: the docs and what ships or runs the system.
PRODUCT = ("services", "shared", "kernels", "deploy", "loadtest", "scripts", ".ci")
PRODUCT_FILES = ("Makefile", "pyproject.toml", "README.md")
# The one allowance: a Dockerfile's paths are inside the image it builds, not on a machine.
IN_IMAGE = {"Dockerfile"}

PART = r"[A-Za-z0-9_.<>{}$*-]"
PATH_TOKEN = re.compile(rf"(?<![\w./:~$@<>{{}}-])((?:{PART}+/)+{PART}*(?:#[\w-]+)?)")
BACKTICKED = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MACHINE = re.compile(r"(?<![\w.~$-])/(?:tmp|work|root|home)(?=/|\b)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def repo_files() -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        if rel.parts[:2] == ("loadtest", "results"):
            dirnames[:] = []
            continue
        out += [Path(dirpath) / f for f in filenames]
    return out


@cache
def folder_names() -> frozenset[str]:
    return frozenset(p.parent.name for p in repo_files() if p.parent != ROOT)


@cache
def top_level() -> frozenset[str]:
    return frozenset(p.name for p in ROOT.iterdir() if p.name not in SKIP_DIRS)


def commented_text(path: Path, text: str) -> str:
    """A code file's comments and docstrings (triple-quoted strings), joined by newlines."""
    parts: list[str] = []
    if path.suffix in (".c", ".h"):
        parts += re.findall(r"/\*.*?\*/", text, re.S) + re.findall(r"//[^\n]*", text)
        return "\n".join(parts)
    parts += [m for line in text.splitlines() if "#" in line for m in [line[line.index("#") :]]]
    if path.suffix == ".py":
        parts += re.findall(r'"""(.*?)"""', text, re.S)
    return "\n".join(parts)


@cache
def anchors(md: Path) -> frozenset[str]:
    """GitHub's ids of a markdown file's headings."""
    text = FENCE.sub("", md.read_text())
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return frozenset(out)


def resolve(cited: str, source: Path) -> str | None:
    """None if ``cited`` exists (or is a placeholder, a glob that matches, a generated output),
    else what is wrong with it."""
    path, _, anchor = cited.partition("#")
    path = path.rstrip(".,:;")
    if not path or path.startswith(GENERATED) or any(c in path for c in "<>{}$…"):
        return None
    bases = [ROOT, *[p for p in source.parents if ROOT in (p, *p.parents)]]
    for base in bases:
        target = base / path
        if "*" in path:
            if any(base.glob(path)):
                return None
            continue
        if target.exists():
            if anchor and target.suffix == ".md" and anchor not in anchors(target):
                return f"{path}: no heading #{anchor}"
            return None
    return f"{path}: no such file"


def candidates(text: str, loose: bool) -> set[str]:
    """Path tokens of ``text``: those whose first part is a top-level entry, and where ``loose``
    (backticks, links, comments) files and folders whose first part is any folder of the
    repository."""
    tops = top_level() | {g.split("/")[0] for g in GENERATED}
    out = set()
    for token in PATH_TOKEN.findall(text):
        first, last = token.split("/")[0], token.split("#")[0].rstrip(".,:;").split("/")[-1]
        # Below the top level a path names a file (a suffix) or a folder (a trailing slash):
        # "prefill/decode" in prose is two words.
        if first in tops or (loose and first in folder_names() and (last == "" or "." in last)):
            out.add(token)
    return out


def cited_paths(path: Path) -> set[str]:
    text = path.read_text(errors="replace")
    if path.suffix == ".md":
        loose = "\n".join(BACKTICKED.findall(text) + LINK.findall(FENCE.sub("", text)))
        found = candidates(text, loose=False) | candidates(loose, loose=True)
        return found | {t for t in LINK.findall(text) if not re.match(r"\w+:|#", t)}
    return candidates(commented_text(path, text), loose=True)


def is_cited_in(path: Path) -> bool:
    return path.suffix in CODE_SUFFIXES | {".md"} or path.name in HASH_COMMENTED


# A section cited by its title after the file: docs/engine.md, "CPUs" or engine.md ("CPUs", "X").
SECTION_REF = re.compile(r'((?:docs/)?[\w-]+\.md)\)?(?:,| \(| —) ?\(?((?:"[^"\n]{2,80}"(?:, )?)+)')


def headings(md: Path) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in FENCE.sub("", md.read_text()).splitlines()
            if line.startswith("#")]  # fmt: skip


def missing_sections(path: Path, text: str) -> list[str]:
    """Titles cited after a markdown file that no heading of that file holds."""
    out = []
    for name, titles in SECTION_REF.findall(text):
        found = [b / name for b in (ROOT, path.parent, ROOT / "docs") if (b / name).is_file()]
        md = found[0] if found else None
        if md is None:
            continue  # a missing file is the path check's to report
        for title in re.findall(r'"([^"]+)"', titles):
            if not any(title.lower() in h for h in headings(md)):
                out.append(f'{name}: no section "{title}"')
    return out


def missing_paths() -> list[str]:
    out = []
    for path in repo_files():
        if path.name == Path(__file__).name or not is_cited_in(path):
            continue
        problems = [resolve(cited, path) for cited in sorted(cited_paths(path))]
        text = path.read_text(errors="replace")
        prose = text if path.suffix == ".md" else commented_text(path, text)
        problems += missing_sections(path, prose)
        out += [f"{path.relative_to(ROOT)}: {p}" for p in problems if p]
    return out


def machine_paths() -> list[str]:
    out = []
    for path in repo_files():
        rel = path.relative_to(ROOT)
        shipped = rel.parts[0] in PRODUCT or str(rel) in PRODUCT_FILES or rel.parts[0] == "docs"
        if not shipped or path.name in IN_IMAGE or not is_cited_in(path):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if MACHINE.search(line):
                out.append(f"{rel}:{n}: {line.strip()[:100]}")
    return out


def test_every_cited_repository_path_exists() -> None:
    assert missing_paths() == []


def test_no_machine_paths_in_docs_or_product_code() -> None:
    assert machine_paths() == []


def test_the_checks_see_what_they_should(tmp_path: Path) -> None:
    """A missing path in a comment and in backticks is found; a URL, a placeholder, another
    project's path and a generated output are not; a missing anchor is."""
    text = (
        "# see shared/config.py and shared/nope.py, https://x.org/shared/a.py\n"
        '"""`csrc/rope.c`, `shared/kv_transfer/<name>.py`, vllm/v1/core.py, models/x/"""\n'
    )
    found = candidates(commented_text(ROOT / "kernels/cpu/x.py", text), loose=True)
    assert found == {"shared/config.py", "shared/nope.py", "csrc/rope.c",
                     "shared/kv_transfer/<name>.py", "models/x/"}  # fmt: skip
    problems = {c: resolve(c, ROOT / "kernels/cpu/x.py") for c in found}
    assert [c for c, p in problems.items() if p] == ["shared/nope.py"]
    assert resolve("csrc/rope.c", ROOT / "docs/engine.md") is not None  # not from docs/
    assert resolve("docs/architecture.md#no-such-heading", ROOT / "README.md") is not None
    assert MACHINE.search('default=Path("/tmp/x")') and not MACHINE.search("/dev/shm/baton")
