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


def result_pages() -> list[str]:
    """Every .md under results/ (its folders by kind: research/, performance/, faults/,
    device/ and their run folders), as paths from the repository root."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "results")):
        found += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files
                  if f.endswith(".md")]  # fmt: skip
    return sorted(found)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = open(path).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # no headings inside code
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", sorted(set(PAGES + result_pages())))
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

    pages = PAGES + result_pages()
    for page in pages:
        text = open(os.path.join(ROOT, page)).read()
        for module in re.findall(r"python3? -m ([\w.]+)", text):
            if module in ("venv", "pip", "pytest"):
                continue
            assert importlib.util.find_spec(module) is not None, f"{page}: python -m {module}"
        for script in re.findall(r"python3? ((?:[\w-]+/)*[\w-]+\.py)\b", text):
            assert os.path.exists(os.path.join(ROOT, script)), f"{page}: python {script}"


class _Parsed(Exception):
    """Raised by the patched parser once a command's flags parsed: nothing runs."""


def _commands(text: str, prefix: str) -> list[tuple[str, list[str]]]:
    """(module, argv) of every `python -m <prefix>...` command in the code of `text`:
    fenced blocks (continuation lines joined) and inline code spans (which may wrap);
    optional `[...]` parts, comments and shell redirections dropped."""
    import shlex

    fences = re.findall(r"```.*?```", text, flags=re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    lines = [ln for f in fences for ln in re.sub(r"\\\n\s*", " ", f).splitlines()]
    lines += [span.replace("\n", " ") for span in inline]
    out = []
    for line in lines:
        for module, rest in re.findall(rf"python3? -m ({prefix}[\w.]*)(.*)", line):
            rest = re.split(r"\s(?:#|&&|\||>|2>|;)", re.sub(r"\[[^\]]*\]", "", rest))[0]
            out.append((module, [a for a in shlex.split(rest) if a != "..."]))
    return out


def test_every_python_m_command_on_every_page_parses(monkeypatch):
    """Each `python -m rope_jax...` command line of the docs and results pages is given to
    that module's own argument parser (which then stops the run): a renamed or removed
    flag on any page fails here."""
    import argparse
    import importlib

    original = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    pages = PAGES + result_pages()
    checked = 0
    for page in pages:
        for module, argv in _commands(open(os.path.join(ROOT, page)).read(), "rope_jax"):
            main = getattr(importlib.import_module(module), "main", None)
            if main is None or module == "rope_jax.hf":  # absl flags: tests/hf_test.py
                continue
            if all(a.endswith("=...") for a in argv):  # a name in prose, not a command line
                continue
            try:
                main(argv)
            except _Parsed:
                checked += 1
                continue
            except SystemExit as e:
                pytest.fail(f"{page}: python -m {module} {' '.join(argv)}: exit {e.code}")
            pytest.fail(f"{page}: python -m {module} ran without parsing its flags")
    assert checked > 20


def test_every_train_command_on_every_page_names_real_config_fields():
    """`python train.py --config=FILE:ARG --config.a.b=...` on any page: the file's
    get_config(ARG) works and every overridden field exists."""
    from rope_jax import defaults

    pages = PAGES + result_pages()
    checked = 0
    for page in pages:
        text = re.sub(r"\\\n\s*", " ", open(os.path.join(ROOT, page)).read())
        for line in re.findall(r"python3? train\.py ([^`\n]*)", text):
            spec = re.search(r"--config=([\w/]+\.py)(?::([\w=,.]*))?", line)
            if spec is None or re.search(r"=[A-Z]+\b", spec.group(2) or ""):  # ROW: a placeholder
                continue
            module = defaults.load_module(os.path.join(ROOT, spec.group(1)))
            fields = _leaves(defaults.fill(module.get_config(spec.group(2) or None)))
            for field in re.findall(r"--config\.([\w.]+)=", line):
                assert field in fields, f"{page}: python train.py ... --config.{field}"
            checked += 1
    assert checked > 5


def _leaves(config, prefix=""):
    out = set()
    for key, value in config.items():
        if hasattr(value, "items"):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out
