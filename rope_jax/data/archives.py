"""Corpora read straight from an archive that a system package installs.

  apt-get install linux-source-6.12
  python -m rope_jax.data.prepare --source=linux_source --tokenizer=train:8000 \
      --name=linux8k --data_dir=~/rope_data --workers=2 --tokenizer_train_bytes=100000000

`linux_source`: the Linux 6.12 kernel tree with Debian's patches, the tarball of Debian's
`linux-source-6.12` package (about 150 MB of .tar.xz, 1.4 GB unpacked). One document per
text file: the C sources and headers, assembly, the reStructuredText and plain-text
documentation (`Documentation/` is about 32 MB of English prose), Kconfig and Makefiles,
scripts; files holding a NUL byte are skipped. About 29% of the training tokens are
AMD GPU register tables (generated headers; `benchmarks/corpus_composition.py`). Held
out by a hash of the path (1% validation, 1% test, `splits.by_name`), so the split does
not depend on the tokenizer or on the order the archive stores files in. The archive is
streamed (nothing is unpacked to disk); each pass of `prepare` reads it again. Licence:
the kernel is GPL-2.0 with the Linux syscall note; parts of `Documentation/` are under other free
licences (each file's SPDX line names its own); see the tarball's COPYING and
LICENSES/.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections import Counter
from collections.abc import Iterator

from rope_jax.data import splits
from rope_jax.data.readers import Doc, PrepareError, decode


@dataclasses.dataclass(frozen=True)
class Archive:
    path: str  # the tarball the package installs
    package: str  # the Debian package that installs it
    suffixes: tuple[str, ...]  # text files kept, by suffix ...
    names: tuple[str, ...]  # ... or by file name
    held_out_percent: int = 1  # validation and test each


ARCHIVES = {
    "linux_source": Archive(
        path="/usr/src/linux-source-6.12.tar.xz",
        package="linux-source-6.12",
        suffixes=(".c", ".h", ".S", ".rst", ".txt", ".py", ".sh", ".pl", ".awk", ".y", ".l"),
        names=("Kconfig", "Makefile", "Kbuild", "README", "MAINTAINERS", "CREDITS"),
    ),
}


@dataclasses.dataclass(frozen=True)
class Selection:
    """An archive source: the archive's name, and the paths kept. `linux_source` keeps
    every text file; `linux_source:Documentation/,kernel/` only paths under those
    prefixes; `linux_source:-drivers/gpu/drm/amd/include/asic_reg/` all but those
    (both kinds may be mixed). Held-out documents are the same files whatever the
    selection (the split is a hash of the path), so a selection's validation split is
    exactly the full corpus's validation files under it."""

    name: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def keeps(self, path: str) -> bool:
        if self.include and not path.startswith(self.include):
            return False
        return not (self.exclude and path.startswith(self.exclude))


def selection(source: str) -> Selection | None:
    """The Selection a `--source` names, or None when it names no archive."""
    name, colon, paths = source.partition(":")
    if name not in ARCHIVES:
        return None
    prefixes = [p.strip() for p in paths.split(",")] if colon else []
    if colon and (not prefixes or any(p in ("", "-") for p in prefixes)):
        raise PrepareError(
            f"--source={source}: after '{name}:' give comma-separated path prefixes inside "
            "the tree, e.g. Documentation/ (kept) or -drivers/gpu/ (left out)"
        )
    return Selection(name, tuple(p for p in prefixes if not p.startswith("-")),
                     tuple(p[1:] for p in prefixes if p.startswith("-")))  # fmt: skip


def check(name: str) -> Archive:
    archive = ARCHIVES[name]
    if not os.path.isfile(archive.path):
        raise PrepareError(
            f"--source={name} reads {archive.path}, which is not there: install it with "
            f"`apt-get install {archive.package}`"
        )
    return archive


def _kept(archive: Archive, name: str) -> bool:
    base = posixpath.basename(name)
    return base.endswith(archive.suffixes) or base.split(".")[0] in archive.names


def members(name: str, keeps=None) -> Iterator[tuple[str, bytes]]:
    """(path inside the tree, bytes) of every kept text file, in the archive's order;
    `keeps(path)` (e.g. a Selection's) leaves out the paths it rejects, unread."""
    import tarfile

    archive = check(name)
    with tarfile.open(archive.path, "r|*") as tar:
        for member in tar:
            if not (member.isfile() and _kept(archive, member.name)):
                continue
            rel = member.name.split("/", 1)[-1]  # without the top folder
            if keeps is not None and not keeps(rel):
                continue
            data = tar.extractfile(member).read()
            if b"\0" in data:  # binary (firmware blobs, images with a text suffix)
                continue
            yield rel, data


def documents(source: str, tally: Counter | None = None) -> Iterator[Doc]:
    """Every kept text file of the archive a `--source` selects, held out by a hash of
    its path; `tally` counts the invalid UTF-8 byte sequences replaced, per file."""
    chosen = selection(source)
    percent = ARCHIVES[chosen.name].held_out_percent
    for rel, data in members(chosen.name, chosen.keeps):
        split = splits.by_name(rel, validation_percent=percent, test_percent=percent)
        yield Doc(rel, split, lambda d=data, k=rel: decode(d, k, tally))


def files(source: str) -> list[str]:
    """The tarball the source reads (the same for every selection of it)."""
    return [check(selection(source).name).path]
