"""The import direction of docs/ARCHITECTURE.md holds: radix <- scheduler <- engine.api <-
engine.model <- engine.serving <- server <- cluster, and nothing below imports what sits above
it; engine.api (the seam's words) is a leaf of the engine. Inside engine.model the core sees
neither platform (cpu, cuda) nor the bring-up, the platforms see neither each other nor the
bring-up, and the model side has no import cycle."""

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
    # the model core runs on any device: what differs is asked of the platform interface,
    # and values from above (the config) are passed in
    "engine/model": (
        "engine.model.cpu", "engine.model.cuda", "engine.model.bringup", "engine.serving",
        "engine.config", "server", "cluster", "workloads",
    ),
    # the platforms: each over the core alone
    "engine/model/cpu": (
        "engine.model.cuda", "engine.model.bringup", "engine.serving", "engine.config", "server",
        "cluster", "workloads",
    ),
    "engine/model/cuda": (
        "engine.model.cpu", "engine.model.bringup", "engine.serving", "engine.config", "server",
        "cluster", "workloads",
    ),
    # the bring-up: the one place that knows both platforms, below the serving side
    "engine/model/bringup": ("engine.serving", "server", "cluster", "workloads"),
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


def floor_files(floor: str) -> list[Path]:
    """The floor's modules, without those of the floors inside its folder (engine/model's
    platforms and bring-up are floors of their own)."""
    inner = [ROOT / other for other in FORBIDDEN if other.startswith(floor + "/")]
    return [
        path for path in sorted((ROOT / floor).rglob("*.py"))
        if not any(path.is_relative_to(folder) for folder in inner)
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_sits_below_them(package: str) -> None:
    bad = []
    for path in floor_files(package):
        for module in imported_modules(path):
            for banned in FORBIDDEN[package]:
                if module == banned or module.startswith(banned + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_model_side_has_no_import_cycle() -> None:
    """engine/model's modules, type-only imports included: a module reached again on the way
    from itself is a cycle (the step buffers and the forward batch were one)."""
    folder = ROOT / "engine" / "model"
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in folder.rglob("*.py")
    }

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def deps(name: str, path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        # a module itself and its own package (its __init__) are no edge back to it
        return {
            d for m in found if (d := ours(m)) and d != name and not name.startswith(d + ".")
        }

    graph = {name: deps(name, path) for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for dep in sorted(graph[name]):
            cycle = visit(dep, path + [name])
            if cycle:
                return cycle
        done.add(name)
        return None

    cycles = [c for name in sorted(graph) if (c := visit(name, []))]
    assert not cycles, " -> ".join(cycles[0])


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
