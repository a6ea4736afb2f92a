r"""Draws the package's import graph into docs/packages.png (and prints it as text).

  python scripts/import_graph.py            # docs/packages.png
  python scripts/import_graph.py --check    # only list the floors; fails on an import cycle
                                            # or a function over MAX_FUNCTION_LINES lines

Every module of `rope_jax` is a box; an arrow a -> b means a imports b (dashed: inside
a function, imported only when called). Modules are stacked in floors: a module sits one
floor above the highest module it imports at the top of the file, so arrows point down
and a newcomer reads the architecture from the bottom (pure maths) to the top (tools).
Colours are the subpackages.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rope_jax"
COLOURS = {"rope_jax": "#d9e8fb", "nn": "#fde2c8", "harness": "#d5f0d5", "data": "#efe0f7",
           "experiments": "#f7f3c8"}  # fmt: skip


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str]) -> dict[str, bool]:
    """Project modules imported by `path` -> True if at the top of the file."""
    tree, out = ast.parse(path.read_text()), {}
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]  # submodules by name
            names = [n for n in names if n in modules] or [node.module]  # or names in one
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in filter(modules.__contains__, names):
            out[name] = out.get(name, False) or id(node) in top
    return out


def graph() -> dict[str, dict[str, bool]]:
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    packages = {m for m, p in paths.items() if p.name == "__init__.py"}
    edges = {m: imports(p, set(paths)) for m, p in paths.items() if m not in packages}
    return {
        m: {d: top for d, top in deps.items() if d not in packages} for m, deps in edges.items()
    }


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
    args = p.parse_args(argv)
    edges = graph()
    level = floors(edges)
    for lv in sorted(set(level.values())):
        print(f"floor {lv}: " + ", ".join(sorted(m for m in level if level[m] == lv)))
    if not args.check:
        draw(edges, level, pathlib.Path(args.out))
        print(f"wrote {args.out}")
    too_long = long_functions()
    for line in too_long:
        print(f"over {MAX_FUNCTION_LINES} lines: {line}")
    return 1 if too_long else 0


if __name__ == "__main__":
    sys.exit(main())
