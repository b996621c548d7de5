"""docs/ARCHITECTURE.md's module map moves with the tree: it names every package folder and
every module of the library, and every folder it names exists (as the README's example is
kept running by tests/test_readme.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("radix", "scheduler", "engine", "server", "cluster")


def _map() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Layout and the direction of dependencies") :]
    return section.split("```")[1]


def _packages(top: str) -> list[Path]:
    return sorted(p.parent for p in (ROOT / top).rglob("__init__.py"))


def test_the_map_names_every_module_of_the_library() -> None:
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", _map()))
    missing = [
        str(module.relative_to(ROOT))
        for top in LIBRARY
        for module in sorted((ROOT / top).rglob("*.py"))
        if module.stem not in ("__init__", "__main__") and module.stem not in words
    ]
    assert not missing, f"docs/ARCHITECTURE.md's layout does not name: {missing}"


def test_the_map_names_every_package_folder() -> None:
    block = _map()
    missing = []
    for top in (*LIBRARY, "workloads"):
        for package in _packages(top):
            path = package.relative_to(ROOT).as_posix()
            if f"{path}/" not in block and f"{package.name}/" not in block:
                missing.append(path)
    assert not missing, f"docs/ARCHITECTURE.md's layout does not name: {missing}"


def test_every_folder_the_map_heads_a_line_with_exists() -> None:
    heads = re.findall(r"^([a-z_]+(?:/[a-z_]+)*)/", _map(), flags=re.M)
    assert heads, "the layout block lost its left column"
    assert [h for h in heads if not (ROOT / h).is_dir()] == []
