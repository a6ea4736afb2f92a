"""House rules that CI also runs (`scripts/import_graph.py --check`): no import cycle and
no function over 80 lines anywhere in the code."""

import importlib.util
import pathlib
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
