"""The import direction of docs/ARCHITECTURE.md holds: radix <- scheduler <- engine.model <-
engine.serving <- server <- cluster, and nothing below imports what sits above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> our packages it must never import
FORBIDDEN = {
    "radix": ("scheduler", "engine", "server", "cluster", "workloads", "torch"),
    "scheduler": ("engine", "server", "cluster", "workloads", "torch"),
    "engine/model": ("engine.serving", "server", "cluster", "workloads"),
    "engine/serving": ("server", "cluster", "workloads"),
    "server": ("cluster", "workloads"),
    "cluster": ("workloads",),
}
# Modules the simulator runs as they are: no Ray, no torch.
PLAIN = (
    "cluster/events.py", "cluster/index.py", "cluster/policy.py", "cluster/hub.py",
    "cluster/config.py",
)


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_sits_below_them(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in imported_modules(path):
            for banned in FORBIDDEN[package]:
                if module == banned or module.startswith(banned + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", PLAIN)
def test_the_routing_core_runs_without_ray_or_torch(module: str) -> None:
    imported = imported_modules(ROOT / module)
    bad = [m for m in imported if m.split(".")[0] in ("ray", "torch", "engine", "server")]
    assert not bad, f"{module} imports {bad}"
