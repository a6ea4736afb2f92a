r"""Draws the package's import graph into docs/packages.png (and prints it as text).

  python scripts/import_graph.py            # docs/packages.png
  python scripts/import_graph.py --check    # only list the floors and the imports inside
                                            # functions; fails on an import cycle between
                                            # packages or between the modules of data/, on
                                            # library code importing configs/, or on a
                                            # function over MAX_FUNCTION_LINES lines

Every module of `rope_jax` is a box; an arrow a -> b means a imports b (dashed: inside
a function, imported only when called). Modules are stacked in floors: a module sits one
floor above the highest module it imports at the top of the file, so arrows point down
and a newcomer reads the architecture from the bottom (pure maths) to the top (tools).
Colours are the subpackages.

The package check counts every import, inside a function or not: an import of package B
anywhere in package A is an edge A -> B (the units are the entries of `rope_jax/`: each
subpackage, each module beside them, and `rope_jax` itself), and a cycle of such edges
fails, named with the import that closes it. An import inside a function hides no cycle
this way; the ones left are listed by package edge, each with its file, line and
function (docs/architecture.md says why they stay: JAX's import time, mostly).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import pathlib
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rope_jax"
CONFIGS = "configs"  # experiment configs: entry points read them, the library never imports them
COLOURS = {"rope_jax": "#d9e8fb", "nn": "#fde2c8", "harness": "#d5f0d5", "data": "#efe0f7",
           "experiments": "#f7f3c8", "hf": "#f7d4d4", "ruler": "#dcf1f1"}  # fmt: skip


class Import(NamedTuple):
    """One project module (or package) named by an import statement."""

    source: str  # the importing module, dotted
    target: str  # the module or package imported (`configs...` too)
    path: pathlib.Path
    line: int
    function: str | None  # the function the import is inside; None: run with the file

    def where(self) -> str:
        rel = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        inside = f" in {self.function}" if self.function else ""
        return f"{rel}:{self.line}{inside} ({self.target})"


def module_name(path: pathlib.Path, base: pathlib.Path = ROOT) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(name: str) -> str:
    """The package-level node of a module: its subpackage of the top package, or the
    module itself beside them (`rope_jax.harness.loop` -> `rope_jax.harness`)."""
    return ".".join(name.split(".")[:2])


def _statements(tree: ast.Module) -> list[tuple[ast.stmt, str | None]]:
    """Every import statement of `tree` with the function it is inside (None: none)."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child, function))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
            else:
                visit(child, function)

    visit(tree, None)
    return found


def _named(node, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules (or, for a name that is no module, the package) `node` imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package up
        here = module.split(".")[: None if is_package else -1]
        base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
    subs = [f"{base}.{a.name}" for a in node.names]
    if not any(m.split(".")[0] == base.split(".")[0] for m in modules):
        return subs  # another package's (configs.lm): its names as given
    found = [n for n in subs if n in modules]
    return found + ([base] if len(found) < len(subs) else [])


def scan(package: pathlib.Path = PACKAGE) -> tuple[set[str], list[Import]]:
    """(every module of `package`, every import in it of a module of it or of configs)."""
    base = package.parent
    paths = {module_name(p, base): p for p in sorted(package.rglob("*.py"))}
    modules, top = set(paths), package.name
    found = []
    for name, path in paths.items():
        for node, function in _statements(ast.parse(path.read_text())):
            for target in _named(node, name, path.name == "__init__.py", modules):
                if target.split(".")[0] in (top, CONFIGS):
                    found.append(Import(name, target, path, node.lineno, function))
    return modules, found


def graph(package: pathlib.Path = PACKAGE) -> dict[str, dict[str, bool]]:
    """Module -> {project module it imports: True if at the top of the file}; packages'
    __init__ modules left out."""
    modules, found = scan(package)
    packages = {module_name(p, package.parent) for p in package.rglob("__init__.py")}
    edges: dict[str, dict[str, bool]] = {m: {} for m in sorted(modules - packages)}
    for imp in found:
        if imp.source in edges and imp.target in modules and imp.target not in packages:
            top = edges[imp.source].get(imp.target, False) or imp.function is None
            edges[imp.source][imp.target] = top
    return edges


def package_edges(found: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """(unit a, unit b) -> the imports that make a import b, inside functions too."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in found:
        edges.setdefault((unit(imp.source), unit(imp.target)), []).append(imp)
    return edges


def _a_cycle(succ: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph `succ`, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def dfs(node, path):
        state[node] = 1
        for nxt in sorted(succ.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [node, nxt]
            if nxt not in state and (cycle := dfs(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(succ):
        if start not in state and (cycle := dfs(start, [])):
            return cycle
    return None


def package_cycles(found: list[Import]) -> list[str]:
    """One line per cycle between packages, naming its packages and the import that
    closes it (an import inside a function if one does, the hidden one); each cycle
    found loses that edge, so every edge closes at most one line."""
    return _cycles(package_edges(found))


# Packages whose modules import one another without a cycle, imports inside functions
# counted (the rest of the library is checked package by package).
ACYCLIC = ("data",)


def module_cycles(found: list[Import], package: str) -> list[str]:
    """One line per import cycle between the modules of `package` (e.g. rope_jax.data),
    each named with the import that closes it, as `package_cycles` does for packages."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in found:
        inside = imp.source.startswith(f"{package}.") and imp.target.startswith(f"{package}.")
        if inside and imp.source != imp.target:
            edges.setdefault((imp.source, imp.target), []).append(imp)
    return _cycles(edges)


def _cycles(edges: dict[tuple[str, str], list[Import]]) -> list[str]:
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            succ.setdefault(a, set()).add(b)
    lines = []
    while cycle := _a_cycle(succ):
        steps = list(itertools.pairwise(cycle))
        hidden = [s for s in steps if all(i.function for i in edges[s])]
        a, b = (hidden or steps)[-1]
        succ[a].discard(b)
        lines.append(f"import cycle: {' -> '.join(cycle)}, closed by {edges[a, b][0].where()}")
    return lines


def configs_imports(found: list[Import]) -> list[str]:
    """Library modules that import the experiment configs (their values come as
    arguments or from `rope_jax.defaults`)."""
    return [f"the library imports {CONFIGS}: {i.where()}" for i in found
            if unit(i.target).split(".")[0] == CONFIGS]  # fmt: skip


def local_imports(found: list[Import]) -> list[str]:
    """The project imports inside functions, under their package edge (`a -> a`: inside
    one package), each with its file, line and function."""
    count = len({(i.path, i.line) for i in found if i.function})
    lines = [f"project imports inside functions: {count}, by package edge"]
    for (a, b), imps in sorted(package_edges(found).items()):
        if local := [i for i in imps if i.function]:
            lines += [f"  {a} -> {b}"] + [f"    {i.where()}" for i in local]
    return lines


def floors(edges: dict[str, dict[str, bool]]) -> dict[str, int]:
    """Floor of each module: 0 if it imports no project module at the top, else one above
    the highest floor it imports."""
    memo: dict[str, int] = {}

    def floor(m, seen=()):
        if m not in memo:
            if m in seen:
                raise SystemExit(f"import cycle through {m}")
            deps = [d for d, top in edges[m].items() if top]
            memo[m] = 1 + max((floor(d, (*seen, m)) for d in deps), default=-1)
        return memo[m]

    return {m: floor(m) for m in edges}


def draw(edges, level, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[int, list[str]] = {}
    for m in sorted(edges, key=lambda m: (m.count("."), m)):
        rows.setdefault(level[m], []).append(m)
    width = max(len(r) for r in rows.values())
    xy = {m: ((i + 0.5) * width / len(r), level[m]) for lv, r in rows.items() for i, m in
          enumerate(r)}  # fmt: skip
    fig, ax = plt.subplots(figsize=(2.1 * width, 1.3 * (len(rows) + 1)))
    for m, deps in edges.items():
        for d, top in deps.items():
            ax.annotate("", xy=xy[d], xytext=xy[m], arrowprops=dict(
                arrowstyle="-|>", color="0.45", lw=0.7, ls="-" if top else "--",
                shrinkA=14, shrinkB=14))  # fmt: skip
    for m, (x, y) in xy.items():
        sub = m.split(".")[1] if m.count(".") > 1 else "rope_jax"
        ax.text(x, y, m.removeprefix("rope_jax."), ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round", fc=COLOURS.get(sub, "white"), ec="0.3"))  # fmt: skip
    ax.set_xlim(0, width)
    ax.set_ylim(-0.7, max(rows) + 0.7)
    ax.set_yticks(sorted(rows), [f"floor {lv}" for lv in sorted(rows)])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title("rope_jax imports (a -> b: a imports b; dashed: inside a function)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


MAX_FUNCTION_LINES = 80
CHECKED = ("rope_jax", "configs", "benchmarks", "scripts", "train.py", "eval.py")


def long_functions(paths=None, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`file:line name (N lines)` of every function longer than `limit` lines (its
    decorators and docstring included)."""
    found = []
    for top in paths or [ROOT / p for p in CHECKED]:
        top = pathlib.Path(top)
        for path in sorted(top.rglob("*.py") if top.is_dir() else [top]):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    n = node.end_lineno - first + 1
                    if n > limit:
                        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                        found.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "packages.png"))
    p.add_argument("--check", action="store_true", help="only check; draw nothing")
    p.add_argument("--package", default=str(PACKAGE), help="the package to check (a test's)")
    args = p.parse_args(argv)
    package = pathlib.Path(args.package).resolve()
    edges = graph(package)
    level = floors(edges)
    for lv in sorted(set(level.values())):
        print(f"floor {lv}: " + ", ".join(sorted(m for m in level if level[m] == lv)))
    if not args.check:
        draw(edges, level, pathlib.Path(args.out))
        print(f"wrote {args.out}")
    found = scan(package)[1]
    print("\n".join(local_imports(found)))
    problems = package_cycles(found) + configs_imports(found)
    for sub in ACYCLIC:
        problems += module_cycles(found, f"{package.name}.{sub}")
    problems += [f"over {MAX_FUNCTION_LINES} lines: {line}"
                 for line in long_functions(None if package == PACKAGE else [package])]  # fmt: skip
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
