"""Real text for the traces, offline: docstrings of the Python standard library.

The sources are parsed (never imported) from a fixed list of modules, in a fixed order, so a
given Python version always yields the same corpus.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

import msgspec

# Modules with rich docstrings that exist from Python 3.10 to 3.13 (as a file or a package).
MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "bisect", "calendar", "codecs", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "dis", "doctest", "enum",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "heapq", "hmac", "inspect", "ipaddress", "json", "json.decoder", "json.encoder",
    "locale", "logging", "mailbox", "mimetypes", "netrc", "numbers", "operator", "optparse",
    "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "posixpath",
    "pprint", "pstats", "queue", "random", "reprlib", "sched", "secrets", "selectors", "shlex",
    "shutil", "smtplib", "socket", "socketserver", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types",
    "typing", "uuid", "warnings", "weakref", "zipfile", "email.message", "http.client",
    "http.server", "urllib.parse", "urllib.request", "unittest.case", "asyncio.events",
    "asyncio.tasks", "concurrent.futures._base", "importlib.metadata", "xml.dom.minidom",
)

MIN_PARAGRAPH_CHARS = 80


class Entry(msgspec.Struct, frozen=True):
    """One documented object: ``module.qualname`` and its cleaned docstring."""

    module: str
    qualname: str
    doc: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module

    @property
    def summary(self) -> str:
        """The docstring's first line: what the object does, in one sentence."""
        return self.doc.split("\n", 1)[0].strip()

    @property
    def paragraphs(self) -> list[str]:
        """Prose paragraphs long enough to read as text (code examples are dropped)."""
        out = []
        for block in self.doc.split("\n\n"):
            text = " ".join(line.strip() for line in block.splitlines()).strip()
            if len(text) >= MIN_PARAGRAPH_CHARS and ">>>" not in text:
                out.append(text)
        return out


def _module_file(stdlib: Path, module: str) -> Path | None:
    base = stdlib.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _entries_of(module: str, source: str) -> list[Entry]:
    tree = ast.parse(source)
    out: list[Entry] = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(Entry(module, "", doc))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name.startswith("_"):
                    continue
                qualname = f"{prefix}{child.name}"
                child_doc = ast.get_docstring(child)
                if child_doc:
                    out.append(Entry(module, qualname, child_doc))
                if isinstance(child, ast.ClassDef):
                    visit(child, qualname + ".")

    visit(tree, "")
    return out


@functools.lru_cache(maxsize=1)
def load_entries() -> tuple[Entry, ...]:
    """Every public docstring of :data:`MODULES`, in module order then source order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    entries: list[Entry] = []
    for module in MODULES:
        path = _module_file(stdlib, module)
        if path is not None:
            entries.extend(_entries_of(module, path.read_text(encoding="utf-8")))
    if not entries:
        raise ValueError(f"corpus: no docstrings found under the standard library at {stdlib}")
    return tuple(entries)


class Corpus:
    """Views of the docstring corpus that the generators draw from."""

    def __init__(self, entries: tuple[Entry, ...] | None = None) -> None:
        self.entries: tuple[Entry, ...] = entries if entries is not None else load_entries()
        self.paragraphs: tuple[str, ...] = tuple(p for e in self.entries for p in e.paragraphs)
        self.documented: tuple[Entry, ...] = tuple(
            e for e in self.entries if e.qualname and len(e.summary) >= 20
        )
        by_module: dict[str, list[Entry]] = {}
        for entry in self.entries:
            by_module.setdefault(entry.module, []).append(entry)
        self.by_module: dict[str, tuple[Entry, ...]] = {m: tuple(v) for m, v in by_module.items()}

    def text(self) -> str:
        """All paragraphs as one long text (for slicing fixed-length token windows)."""
        return "\n\n".join(self.paragraphs)

    def module_document(self, module: str) -> str:
        """A module's documentation as one reference document: the kind of text RAG retrieves."""
        parts = []
        for entry in self.by_module[module]:
            body = "\n".join(entry.paragraphs) or entry.summary
            parts.append(f"{entry.name}\n{body}" if entry.qualname else body)
        return "\n\n".join(p for p in parts if p.strip())
