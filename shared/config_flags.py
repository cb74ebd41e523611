"""Command-line flags of :class:`~shared.config.BatonConfig`, with help from its source.

One source of truth: each field's help is the comment above it in shared/config.py, read once
from the class's source with ``ast``. A comment block describes the fields that follow it up to
the next comment or section line (``prefill_cpus`` / ``decode_cpus`` share theirs); a comment at
the end of a field's line is added to it. Every flag also names its ``BATON_*`` variable and its
default, so ``--help`` says everything the environment can.

Boolean fields are switches: ``--flag`` / ``--no-flag``, no value.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import tokenize
from collections.abc import Collection, Mapping, Sequence
from functools import cache
from io import StringIO
from typing import Any, get_args, get_type_hints

SECTION_MARK = "# ---"
TABLE_HEAD = "| variable | flag | default | what it sets |"


@cache
def field_help(cls: type) -> dict[str, str]:
    """Field name -> the comment that describes it ("" where none; a test keeps that empty)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source shipped: flags still work, without help
        return {}
    lines = source.splitlines()
    trailing = _trailing_comments(source)
    fields = [
        node
        for node in ast.parse(source).body[0].body  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]
    out: dict[str, str] = {}
    current = ""
    for node in fields:
        block = _comment_block(lines, node.lineno - 2)
        if block is not None:  # a comment or a section line above: a new group starts
            current = block
        text = " ".join(t for t in (current, trailing.get(node.lineno, "")) if t)
        out[node.target.id] = text  # type: ignore[union-attr]
    return out


def _comment_block(lines: list[str], last: int) -> str | None:
    """The comment lines ending at ``lines[last]`` joined, "" after a section line with no
    comment, None when ``lines[last]`` is code (the field continues the group above)."""
    block: list[str] = []
    i = last
    while i >= 0:
        line = lines[i].strip()
        if line.startswith(SECTION_MARK):
            break
        if not line.startswith("#"):
            return " ".join(block) if block else None
        block.insert(0, line[1:].strip())
        i -= 1
    return " ".join(block)


def _trailing_comments(source: str) -> dict[int, str]:
    """Line number -> the comment that ends a line of code."""
    out: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.start[0] in code_lines:
            out[tok.start[0]] = tok.string[1:].strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    return out


def add_arguments(
    cls: type,
    parser: argparse.ArgumentParser,
    aliases: Mapping[str, Sequence[str]] | None = None,
    exclude: Collection[str] = (),
) -> None:
    """Every field but ``exclude`` as ``--field-name`` (and its ``aliases``), default None: a
    flag left out leaves the environment's value."""
    helps = field_help(cls)
    hints = get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in exclude:
            continue
        names = [*(aliases or {}).get(f.name, ()), "--" + f.name.replace("_", "-")]
        env = "BATON_" + f.name.upper()
        shown = "(hidden)" if not f.repr else repr(getattr(defaults, f.name))
        text = helps.get(f.name, "")
        text = f"{text} [{env}; default {shown}]" if text else f"[{env}; default {shown}]"
        text = text.replace("%", "%%")  # argparse formats help with %
        if _is_bool(hints[f.name]):
            parser.add_argument(
                *names, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=text
            )
        else:
            parser.add_argument(*names, dest=f.name, default=None, metavar=_metavar(f), help=text)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields the command line set (a switch as a bool, the rest as the text given)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if getattr(args, f.name, None) is not None
    }


def as_flags(values: Mapping[str, Any]) -> list[str]:
    """``given``'s result as canonical flags again: what a child process is started with."""
    out: list[str] = []
    for name, value in values.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out


def field_sections(cls: type) -> dict[str, str]:
    """Field name -> the title of the section line above it (``# --- broker ---`` -> "broker"),
    "" before the first one."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            marks = [ln for ln in lines[: node.lineno - 1] if ln.strip().startswith(SECTION_MARK)]
            title = marks[-1].strip().removeprefix(SECTION_MARK).strip(" -") if marks else ""
            out[node.target.id] = title
    return out


def markdown_table(cls: type, env_prefix: str = "BATON_") -> str:
    """Every field of ``cls`` as markdown, from the same source as ``--help``: a table per section
    of the class, a row per field with its variable, its flag, its default and its help."""
    helps, sections = field_help(cls), field_sections(cls)
    hints = get_type_hints(cls)
    defaults = cls()
    out: list[str] = []
    section = None
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if sections.get(f.name, "") != section:
            section = sections.get(f.name, "")
            out += ["", f"## {section or 'general'}", "", TABLE_HEAD, "|---|---|---|---|"]
        flag = "--" + f.name.replace("_", "-")
        if _is_bool(hints[f.name]):
            flag = f"{flag} / --no-{f.name.replace('_', '-')}"
        value = getattr(defaults, f.name)
        shown = "(hidden)" if not f.repr else "unset" if value is None else f"`{json.dumps(value)}`"
        env = f"`{env_prefix}{f.name.upper()}`"
        out.append(f"| {env} | `{flag}` | {shown} | {_md_cell(helps.get(f.name, ''))} |")
    return "\n".join(out).lstrip("\n") + "\n"


def _md_cell(text: str) -> str:
    """Help text as one markdown table cell: pipes and emphasis marks escaped, ``<x>`` kept."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")


def _is_bool(hint: Any) -> bool:
    return hint is bool or (bool in get_args(hint) and len(get_args(hint)) == 2)


def _metavar(f: dataclasses.Field[Any]) -> str:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    return {"int": "N", "float": "X", "int | None": "N"}.get(kind, "TEXT")
