"""Griffe extension for the docs build: render the reStructuredText markup of lightning_fp8's docstrings as Markdown.

The package's docstrings use Google-style sections (which mkdocstrings parses) plus a little reST markup
that Markdown does not know. This extension rewrites it, at docs-build time only, before mkdocstrings
renders the docstrings (the source files are not touched):

* cross-reference roles (``:class:`FP8Linear```, ``:func:`~lightning_fp8.fp8_autocast```, ``:mod:``,
  ``:meth:``, ``:data:``, ...) become mkdocs-autorefs links. The name is resolved in the scope of the
  docstring's object (as Sphinx does); objects re-exported by ``lightning_fp8`` are linked under their
  public path (``lightning_fp8.FP8Linear``). A name that cannot be resolved is logged as a warning, and
  a resolved name whose page does not exist is reported by autorefs, so ``mkdocs build --strict`` fails
  on a broken reference either way;
* literal blocks introduced by ``::`` become fenced code blocks;
* section titles underlined with ``----`` become bold lines (a heading would break the page's outline);
* simple tables (``====  ====`` borders) become Markdown tables;
* definition lists (a term line, then its definition indented by four spaces) use the ``def_list``
  Markdown extension.

Configured in ``mkdocs.yml`` under the mkdocstrings Python handler's ``extensions``.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

_logger = griffe.get_logger("lightning_fp8.docs")

_ROLE = re.compile(r":(?:py:)?(class|func|mod|data|meth|attr|obj|exc|const):`(~?)([^`<>]+?)`")
_TABLE_BORDER = re.compile(r"^(\s*)=+(?:\s+=+)+\s*$")
_UNDERLINE = re.compile(r"^\s*([-=~^])\1{2,}\s*$")
_SECTION_WORD = re.compile(r"^\s*(Example|Examples|Note|Notes|Warning|Warnings)::\s*$")
_LIST_MARKER = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def convert_tables(lines: list[str]) -> list[str]:
    """reST simple tables -> Markdown pipe tables."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _TABLE_BORDER.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        border = lines[i]
        starts = [m.start() for m in re.finditer(r"=+", border)]
        rows: list[list[str]] = []
        header_rows = 0
        borders_seen = 1
        i += 1
        while i < len(lines) and borders_seen < 3:
            line = lines[i]
            if _TABLE_BORDER.match(line):
                borders_seen += 1
                if borders_seen == 2:
                    header_rows = len(rows)
                i += 1
                continue
            if not line.strip():
                i += 1
                continue
            bounds = starts[1:] + [None]
            cells = [line[start:end].strip() for start, end in zip(starts, bounds)]
            if rows and not cells[0] and borders_seen == 2:
                rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
            else:
                rows.append(cells)
            i += 1
        indent = match.group(1)
        header = rows[:header_rows] or [[""] * len(starts)]
        body = rows[header_rows:]

        def row(cells: list[str]) -> str:
            return indent + "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

        out.append("")
        out.append(row([" ".join(parts).strip() for parts in zip(*header)]))
        out.append(indent + "|" + "|".join(["---"] * len(starts)) + "|")
        out.extend(row(cells) for cells in body)
        out.append("")
    return out


def convert_literal_blocks(lines: list[str]) -> list[str]:
    """``text::`` + indented block -> ``text:`` + fenced code block."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if not stripped.endswith("::"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        section = _SECTION_WORD.match(stripped)
        if stripped.strip() == "::":
            pass  # the marker alone: no paragraph to keep
        elif stripped.endswith(" ::"):
            out.append(stripped[:-3])
        else:
            out.append(stripped[:-1])
        fence_indent = base + 4 if section else base
        i += 1
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            i -= 1
            block.pop()
        code = textwrap.dedent("\n".join(block)).strip("\n").split("\n")
        pad = " " * fence_indent
        if not section:  # a Google-style section title must be followed directly by its content
            out.append("")
        out.append(pad + ("```python" if section else "```text"))
        out.extend(pad + c if c.strip() else "" for c in code)
        out.append(pad + "```")
        if i < len(lines) and lines[i].strip():
            out.append("")
    return out


def convert_underlined_titles(lines: list[str]) -> list[str]:
    """reST section titles (a line underlined with ``---``) -> a bold line."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        title = line.strip()
        if title and not title.startswith("```") and _UNDERLINE.match(nxt) and len(nxt.strip()) >= len(title):
            out.append(" " * _indent(line) + f"**{line.strip()}**")
            out.append("")
            i += 2
            continue
        out.append(line)
        i += 1
    return out


def convert_definition_lists(lines: list[str]) -> list[str]:
    """Top-level reST definition lists -> Markdown ``def_list`` syntax."""
    out: list[str] = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        is_term = (
            not in_fence
            and line.strip()
            and _indent(line) == 0
            and not line.rstrip().endswith(":")
            and not _LIST_MARKER.match(line)
            and not line.startswith("|")
            and nxt.strip()
            and _indent(nxt) == 4
            and (not out or not out[-1].strip() or out[-1].startswith("    ") or out[-1].startswith(":   "))
        )
        if not is_term:
            out.append(line)
            i += 1
            continue
        if out and out[-1].strip():
            out.append("")
        out.append(line)
        i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) >= 4):
            body.append(lines[i])
            i += 1
        trailing = 0
        while body and not body[-1].strip():
            body.pop()
            trailing += 1
        for k, text in enumerate(body):
            text = text[4:] if text.strip() else ""
            out.append((":   " if k == 0 else "    ") + text if text or k == 0 else "")
        out.extend([""] * trailing)
    return out


class _Resolver:
    def __init__(self, package: griffe.Module) -> None:
        self.package = package
        # canonical path -> public path, for the names that the package's root re-exports
        self.public: dict[str, str] = {}
        for name, member in package.members.items():
            if member.is_alias and not name.startswith("_"):
                self.public[member.target_path] = f"{package.path}.{name}"

    def lookup(self, path: str) -> str | None:
        parts = path.split(".")
        if parts[0] != self.package.name:
            return None
        obj: Any = self.package
        for part in parts[1:]:
            try:
                obj = obj.members[part]
            except (KeyError, AttributeError):
                return None
        return obj.target_path if getattr(obj, "is_alias", False) else obj.path

    def resolve(self, obj: griffe.Object, name: str) -> str | None:
        if name == self.package.name or name.startswith(self.package.name + "."):
            found = self.lookup(name)
        else:
            head, _, rest = name.partition(".")
            try:
                found = obj.resolve(head)
            except griffe.NameResolutionError:
                found = None
            if found is not None and rest:
                found = self.lookup(f"{found}.{rest}")
        if found is None:
            return None
        # Link the public spelling when the object is re-exported by the package root.
        owner, _, tail = found, "", ""
        while owner and owner not in self.public and "." in owner:
            owner, _, last = owner.rpartition(".")
            tail = f".{last}{tail}"
        return self.public[owner] + tail if owner in self.public else found


def convert_roles(text: str, obj: griffe.Object, resolver: _Resolver) -> str:
    def replace(match: re.Match) -> str:
        short, target = match.group(2), match.group(3).strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        identifier = resolver.resolve(obj, target)
        if identifier is None:
            _logger.warning(f"{obj.path}: cannot resolve the cross-reference {match.group(0)!r}")
            return f"`{shown}`"
        return f"[`{shown}`][{identifier}]"

    return _ROLE.sub(replace, text)


def rst_to_markdown(text: str, obj: griffe.Object, resolver: _Resolver) -> str:
    lines = text.split("\n")
    for convert in (convert_tables, convert_literal_blocks, convert_underlined_titles, convert_definition_lists):
        lines = convert(lines)
    return convert_roles("\n".join(lines), obj, resolver)


def _lookup_object(package: griffe.Module, path: str) -> Any:
    obj: Any = package
    for part in path.split(".")[1:]:
        obj = obj.members[part]
    return obj.final_target if getattr(obj, "is_alias", False) else obj


def borrow_assigned_init(cls: griffe.Class, package: griffe.Module) -> None:
    """``__init__ = Other.__init__`` in a class body: give the class ``Other.__init__``'s signature.

    Static analysis sees an attribute there, so the class would be documented as taking no arguments
    (the Trainer's ``FP8Precision`` shares the Fabric plugin's ``__init__`` this way).
    """
    init = cls.members.get("__init__")
    if init is None or not init.is_attribute or init.value is None:
        return
    owner, _, attr = str(init.value).rpartition(".")
    if attr != "__init__" or not owner:
        return
    try:
        target = _lookup_object(package, cls.resolve(owner)).members["__init__"]
    except (griffe.NameResolutionError, KeyError, AttributeError):
        return
    if getattr(target, "is_function", False):
        cls.set_member("__init__", griffe.Alias("__init__", target, parent=cls))


class RstMarkup(griffe.Extension):
    """Rewrite the reST markup of every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        resolver = _Resolver(pkg)
        seen: set[int] = set()

        def visit(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = rst_to_markdown(obj.docstring.value, obj, resolver)
            if obj.is_class:
                borrow_assigned_init(obj, pkg)  # type: ignore[arg-type]
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)

        visit(pkg)
