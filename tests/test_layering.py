"""The import direction of docs/ARCHITECTURE.md holds: radix <- scheduler <- engine.api <-
engine.model <- engine.serving <- server <- cluster, and nothing below imports what sits above
it; engine.api (the seam's words) is a leaf of the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> our packages it must never import
FORBIDDEN = {
    "radix": ("scheduler", "engine", "server", "cluster", "workloads", "torch"),
    "scheduler": ("engine", "server", "cluster", "workloads", "torch"),
    # the seam's words: records and the handle, none of the engine's insides, no torch
    "engine/api": (
        "engine.model", "engine.serving", "engine.config", "server", "cluster", "workloads",
        "torch",
    ),
    "engine/model": ("engine.serving", "server", "cluster", "workloads"),
    "engine/serving": ("server", "cluster", "workloads"),
    # server sees only the engine (SamplingParams too comes from there); cluster reads radix's
    # KV events and page hashes by design, so it is not held to this.
    "server": ("cluster", "workloads", "scheduler", "radix"),
    "cluster": ("workloads",),
}
# The floors, bottom up: docs/ARCHITECTURE.md lists them top down (test_architecture_map).
FLOORS = tuple(FORBIDDEN)
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


def test_the_routing_core_runs_without_ray_or_torch() -> None:
    """Imported for real (the engine's and the server's configs are read there, through
    names that load nothing heavy): neither Ray nor torch may come in."""
    names = [path.removesuffix(".py").replace("/", ".") for path in PLAIN]
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {names!r}]; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


# server/, cluster/ and workloads/ reach the engine only through the names of engine/__init__.py
# (the engine, its config and commands) and engine.api (the seam's types: EngineClient and what
# it hands out), so what the engine keeps inside can move without them. The model bench
# measures engine internals (products, attention kernels, the runner) and is the one exception.
THROUGH_THE_FACE = {"server": (), "cluster": (), "workloads": ("workloads/model_bench",)}
FACE = ("engine", "engine.api")


@pytest.mark.parametrize("package", sorted(THROUGH_THE_FACE))
def test_packages_above_the_engine_use_only_its_top_level_names(package: str) -> None:
    exempt = [ROOT / folder for folder in THROUGH_THE_FACE[package]]
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if any(path.is_relative_to(folder) for folder in exempt):
            continue
        for module in imported_modules(path):
            if module.startswith("engine.") and module not in FACE:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_seams_words_load_without_the_engine() -> None:
    """``engine.api`` is what a front needs to speak to an engine: importing it loads no
    torch and no engine module outside it, and the engine's face stays small."""
    code = (
        "import sys, engine, engine.api; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or (m.startswith('engine.') and not m.startswith('engine.api'))); "
        "assert not heavy, heavy; "
        "plain = [n for n in engine.__all__ if n not in ('tools',)]; "
        "assert len(plain) < 20, plain"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
