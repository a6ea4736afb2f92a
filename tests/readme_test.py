"""The README's Python example runs as written."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_readme_python_example_runs():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_commands_name_existing_files():
    text = open(os.path.join(ROOT, "README.md")).read()
    for path in set(re.findall(r"python (\S+\.py)", text)):
        assert os.path.exists(os.path.join(ROOT, path)), path
    for config in set(re.findall(r"--config=(configs/\w+\.py)", text)):
        assert os.path.exists(os.path.join(ROOT, config)), config


def test_the_layout_example_writes_under_runs_not_over_the_committed_plot():
    text = open(os.path.join(ROOT, "README.md")).read()
    outs = re.findall(r"plot_layout [^`]*?--out=(\S+)", text)
    assert outs and all(out.startswith("runs/") for out in outs), outs
