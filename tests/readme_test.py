"""The README's Python example runs as written; commands on the front page and the pages
it points to (docs/, results/README.md) name files that exist."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "results/README.md"] + [
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
]


def pages_text() -> str:
    return "\n".join(open(os.path.join(ROOT, p)).read() for p in PAGES)


@pytest.mark.slow
def test_readme_python_example_runs():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_commands_name_existing_files():
    text = pages_text()
    for path in set(re.findall(r"python (\S+\.py)", text)):
        assert os.path.exists(os.path.join(ROOT, path)), path
    for config in set(re.findall(r"--config=(configs/\w+\.py)", text)):
        assert os.path.exists(os.path.join(ROOT, config)), config


def test_the_layout_example_writes_under_runs_not_over_the_committed_plot():
    """The user-facing examples (docs/maths.md says how its own figure was drawn)."""
    text = "".join(open(os.path.join(ROOT, p)).read() for p in ("README.md", "docs/rotary.md"))
    outs = re.findall(r"plot_layout [^`]*?--out=(\S+)", text)
    assert outs and all(out.startswith("runs/") for out in outs), outs
