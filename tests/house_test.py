"""House rules that CI also runs (`scripts/import_graph.py --check`): no import cycle
between packages (imports inside functions counted), no library module importing
configs/, no function over 80 lines anywhere in the code; and docs/architecture.md names
every module of the package."""

import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_the_check_passes_on_the_repository():
    proc = subprocess.run([sys.executable, "scripts/import_graph.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_long_function_is_named_with_its_place(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    (tmp_path / "m.py").write_text(
        f"def short():\n    return 1\n\n\n@staticmethod\ndef long():\n{body}\n"
    )
    found = import_graph.long_functions([tmp_path])
    assert len(found) == 1 and "m.py:6 long (87 lines)" in found[0]


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_cycle_hidden_in_a_function_fails_the_check(tmp_path, capsys):
    """pkg.a imports pkg.b at the top; pkg.b imports pkg.a only inside a function: the
    check names the cycle and the import that closes it, and lists that import."""
    package = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/m.py": "from pkg.b import n\n",
        "pkg/b/__init__.py": "",
        "pkg/b/n.py": "import os\n\n\ndef load():\n    from pkg.a import m\n\n    return m\n",
    })  # fmt: skip
    assert import_graph.main(["--check", f"--package={package}"]) == 1
    out = capsys.readouterr().out
    assert "import cycle: pkg.a -> pkg.b -> pkg.a, closed by " in out
    assert "pkg/b/n.py:5 in load (pkg.a.m)" in out.split("import cycle")[1]
    assert "project imports inside functions: 1, by package edge" in out
    assert "  pkg.b -> pkg.a\n" in out


def test_without_the_hidden_import_the_tree_passes(tmp_path, capsys):
    package = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/m.py": "from pkg.b import n\n",
        "pkg/b/__init__.py": "",
        "pkg/b/n.py": "def load():\n    from pkg.b import o  # one package: no cycle\n",
        "pkg/b/o.py": "",
    })  # fmt: skip
    assert import_graph.main(["--check", f"--package={package}"]) == 0
    assert "  pkg.b -> pkg.b\n    " in capsys.readouterr().out


def test_a_module_cycle_inside_data_fails_the_check(tmp_path, capsys):
    """Inside data/ the modules themselves import one another without a cycle: one
    closed by an import inside a function is named, with that import."""
    package = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/data/__init__.py": "",
        "pkg/data/readers.py": "def read():\n    from pkg.data import archives\n",
        "pkg/data/archives.py": "from pkg.data import readers\n",
    })  # fmt: skip
    assert import_graph.main(["--check", f"--package={package}"]) == 1
    out = capsys.readouterr().out
    assert "import cycle: pkg.data.archives -> pkg.data.readers -> pkg.data.archives" in out
    assert "pkg/data/readers.py:2 in read (pkg.data.archives)" in out.split("import cycle")[1]


def test_a_library_module_importing_configs_fails_the_check(tmp_path, capsys):
    package = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/tool.py": "def default():\n    from configs import lm\n\n    return lm\n",
    })  # fmt: skip
    assert import_graph.main(["--check", f"--package={package}"]) == 1
    assert "the library imports configs: " in capsys.readouterr().out


def test_the_harness_does_not_import_hf():
    """hf imports the harness (`hf.run`); the harness reads hf:DIR through the sources its
    caller passes (`harness.transfer`), so the edge goes one way."""
    edges = import_graph.package_edges(import_graph.scan()[1])
    assert ("rope_jax.hf", "rope_jax.harness") in edges
    assert ("rope_jax.harness", "rope_jax.hf") not in edges


def test_the_architecture_page_names_every_module():
    """Every module of rope_jax/ is named in docs/architecture.md (`harness/loop`,
    a package as `harness/evals/`), and every module its list names exists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "rope_jax"
    names = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        if rel.name == "__init__.py":
            names.add(f"{rel.parent}/" if rel.parent.parts else None)
        else:
            names.add(str(rel.with_suffix("")))
    missing = sorted(n for n in names - {None} if f"`{n}`" not in text)
    assert not missing, f"docs/architecture.md names no {missing}"
    listed = re.findall(r"^ *- `([\w/]+)`", text.split("## Every module", 1)[1], re.M)
    assert listed and not sorted(set(listed) - names), sorted(set(listed) - names)
