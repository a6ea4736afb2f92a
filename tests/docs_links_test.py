"""The front page and the pages it points to: every relative link reaches a file, and
every #anchor a heading of that file."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "results/README.md"] + [
    os.path.join("docs", f)
    for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
    if f.endswith(".md")
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = open(path).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # no headings inside code
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    here = os.path.dirname(os.path.join(ROOT, page))
    for target in LINK.findall(open(os.path.join(ROOT, page)).read()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, frag = target.partition("#")
        file = os.path.normpath(os.path.join(here, path)) if path else os.path.join(ROOT, page)
        assert os.path.exists(file), f"{page}: {target} -> {file} does not exist"
        if frag and file.endswith(".md"):
            assert frag in anchors(file), f"{page}: {target}: no heading #{frag} in {file}"


def test_the_front_page_stays_short():
    assert len(open(os.path.join(ROOT, "README.md")).read().splitlines()) <= 250


def test_every_command_on_every_page_names_a_module_or_script_that_exists():
    import importlib.util

    pages = PAGES + [os.path.join("results", f) for f in os.listdir(os.path.join(ROOT, "results"))
                     if f.endswith(".md")]  # fmt: skip
    for page in pages:
        text = open(os.path.join(ROOT, page)).read()
        for module in re.findall(r"python3? -m ([\w.]+)", text):
            if module in ("venv", "pip", "pytest"):
                continue
            assert importlib.util.find_spec(module) is not None, f"{page}: python -m {module}"
        for script in re.findall(r"python3? ((?:[\w-]+/)*[\w-]+\.py)\b", text):
            assert os.path.exists(os.path.join(ROOT, script)), f"{page}: python {script}"
