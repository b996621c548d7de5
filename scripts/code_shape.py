"""The code's shape in numbers, for a refactor's before/after: lines per part, the file-level
import cycles among our modules, which engine internals the packages above it import, the
model core's imports of a platform folder (``engine/model/cpu``, ``engine/model/cuda``), of the
bring-up above them (``engine/model/bringup``) or of a floor above it, the branches on a
device's type outside the platform folders, and the size of the serving core's biggest objects.

    python scripts/code_shape.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LIBRARY = ("radix", "scheduler", "engine", "server", "cluster", "workloads")
PACKAGES = LIBRARY + ("tests",)
ABOVE_ENGINE = ("server", "cluster", "workloads")


def is_bench(path: Path) -> bool:
    """Benchmarks, traces, simulators and their reports (all of workloads/, and any bench
    module elsewhere): code that measures the library, not the library."""
    return path.parts[0] == "workloads" or any("bench" in part for part in path.parts)


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path, modules: set[str], types_too: bool) -> set[str]:
    """Our modules that ``path`` imports at module level or inside functions; those under
    TYPE_CHECKING (which never run) only with ``types_too``."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not types_too and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    me = module_name(root, path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(root: Path) -> None:
    files = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    lines = {"library": 0, "benches": 0, "tests": 0}
    for path in files:
        rel = path.relative_to(root)
        n = len(path.read_text().splitlines())
        kind = "tests" if rel.parts[0] == "tests" else "benches" if is_bench(rel) else "library"
        lines[kind] += n
    cpp = sum(len(p.read_text().splitlines()) for p in (root / "engine").rglob("*.cpp"))
    print(f"lines: library {lines['library']} (+{cpp} C++), benches {lines['benches']}, "
          f"tests {lines['tests']}")
    lib = [p for p in files if p.relative_to(root).parts[0] in LIBRARY]
    modules = {module_name(root, p) for p in lib}
    for types_too in (False, True):
        graph = {module_name(root, p): imports_of(root, p, modules, types_too) for p in lib}
        # A package's __init__ re-exporting its modules is not a cycle with them.
        for name, deps in graph.items():
            graph[name] = {d for d in deps if not name.startswith(d + ".")}
        found = cycles(graph)
        kind = "runtime and type-only imports" if types_too else "runtime imports"
        print(f"import cycles (file level, {kind}): {len(found)}")
        for comp in found:
            print("  " + " <-> ".join(comp))
    internal = {}
    for p in lib:
        name = module_name(root, p)
        if name.split(".")[0] not in ABOVE_ENGINE:
            continue
        for dep in graph[name]:  # the last graph: type-only imports included
            if dep.startswith("engine.") and dep != "engine":
                internal.setdefault(dep, []).append(name)
    print(f"engine internals imported from server/cluster/workloads: {len(internal)} modules")
    for dep in sorted(internal):
        print(f"  {dep}: {', '.join(sorted(internal[dep]))}")


PLATFORMS = ("engine.model.cpu", "engine.model.cuda")
BRINGUP = "engine.model.bringup"  # above the platforms: the one place that knows both


def in_platform(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PLATFORMS)


def in_bringup(module: str) -> bool:
    return module == BRINGUP or module.startswith(BRINGUP + ".")


def model_core_reaches(root: Path) -> list[str]:
    """Imports (type-only ones too) from a module of engine/model outside the platform
    folders and the bring-up into a platform folder, the bring-up, or up into the engine's
    floors above the model."""
    lib = sorted((root / "engine").rglob("*.py"))
    modules = {module_name(root, p) for p in lib}
    found = []
    for path in lib:
        name = module_name(root, path)
        if not name.startswith("engine.model") or in_platform(name) or in_bringup(name):
            continue
        for dep in sorted(imports_of(root, path, modules, True)):
            up = dep == "engine" or dep == "engine.config" or dep.startswith("engine.serving")
            if in_platform(dep) or in_bringup(dep) or up:
                found.append(f"{name} -> {dep}")
    return found


def device_type_branches(root: Path) -> dict[str, int]:
    """Comparisons of ``<x>.type`` with "cpu" or "cuda" per module of engine/, outside the
    platform folders."""
    counts: dict[str, int] = {}
    for path in sorted((root / "engine").rglob("*.py")):
        if in_platform(module_name(root, path)):
            continue
        n = 0
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            typed = any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)
            named = any(isinstance(s, ast.Constant) and s.value in ("cpu", "cuda") for s in sides)
            n += typed and named
        if n:
            counts[str(path.relative_to(root))] = n
    return counts


def sizes(root: Path) -> None:
    """Lines and functions of the serving core's modules and classes named in issue 56."""
    for rel, cls in (("engine/serving/loop.py", None), ("engine/serving/engine.py", "Engine"),
                     ("radix/manager.py", "KVManager")):
        path = root / rel
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        line = f"  {rel}: {len(path.read_text().splitlines())} lines, " + str(
            sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree))
        ) + " defs"
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                defs = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                           for n in node.body)
                line += f"; class {cls}: {node.end_lineno - node.lineno + 1} lines, {defs} defs"
        print(line)


if __name__ == "__main__":
    where = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    main(where)
    reaches = model_core_reaches(where)
    print(f"model core -> a platform folder or a floor above: {len(reaches)} imports")
    for line in reaches:
        print("  " + line)
    branches = device_type_branches(where)
    print(f"device-type branches outside the platform folders: {sum(branches.values())}")
    for rel, n in branches.items():
        print(f"  {rel}: {n}")
    print("serving core sizes:")
    sizes(where)
